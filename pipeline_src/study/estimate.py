"""A study's training compute before anything runs (`python -m pipeline_src validate` prints it).

Per training job: target tokens = max_steps x grad_accum x the target tokens of a full batch
(batch_tokens; for sequence-to-sequence its target share max_tgt_len / max_src_len when the source
is longer), an upper bound (padding and early stopping only lower it); FLOPs = 3 x FLOPs per
token x tokens, with FLOPs per token from model/accounting.py at the configured maximum lengths,
exactly as train/trainer.py computes them for MFU, so the benchmark's achieved FLOP/s (same convention)
converts them to time. Hours = FLOPs / the achieved
FLOP/s of the most recent real-cell benchmark (cost.json: MFU x measured peak), if there is one:
reports/bench/real_cell.json (bench/bench_real_cell.py) first, else the committed H100 record.
A CPU study (device: cpu; auto shows both) uses the CPU records instead: the achieved FLOP/s of
one single-threaded training job, and as many jobs at a time as the machine has cores (what
`snakemake --cores N` runs), so the wall-clock line is training only: data preparation,
evaluation and the report come on top.

A study with a parts file (pipeline_src/node/parts.py; the GPU study) also gets its wall time on the
GPU the file names, part by part (`predict_parts`), by list-scheduling its jobs on the GPU's job
slots as Snakemake does. What is measured and what is assumed is said where each number is set.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..common import ConfigError
from ..data.tokens import BOS, EOS, PAD
from ..model import ModelConfig, Transformer, count_parameters, flops_per_token
from .config import Study

PARAMS_MATCH_TOLERANCE = 0.01  # a cell's `params_match`: the largest relative difference accepted

ROOT = Path(__file__).resolve().parents[2]
BENCH_FILES = (ROOT / "reports" / "bench" / "real_cell.json",
               ROOT / "bench" / "results" / "h100" / "real_cell_multi30k_cost.json")
CPU_BENCH_FILES = (ROOT / "reports" / "bench" / "real_cell_cpu.json",
                   ROOT / "bench" / "results" / "cpu" / "real_cell_cpu.json")


def job_compute(study: Study, task: str, cell_name: str) -> tuple[float, float]:
    """(training tokens, training FLOPs) of one seed of one cell: upper bounds."""
    cell = study.cell(task, cell_name)
    t = cell.train
    vocab = study.bpe_config(task, cell.filter_variant, cell.bpe_variant).vocab_size  # the cell's tokenizer (a cell may override bpe)
    mcfg = ModelConfig(vocab_size=vocab, pad_id=PAD, bos_id=BOS, eos_id=EOS, **cell.model)
    if cell.kind == "lm":
        per_step = max(1, t.batch_tokens // t.lm_seq_len) * t.lm_seq_len
        fpt = flops_per_token(mcfg, 0, t.lm_seq_len)
    else:  # batch_tokens bounds rows x the longer side; the target's share of it carries the loss
        per_step = t.batch_tokens * min(1.0, t.max_tgt_len / max(t.max_src_len, 1))
        fpt = flops_per_token(mcfg, t.max_src_len, t.max_tgt_len)
    tokens = float(t.max_steps * t.grad_accum * per_step)
    if t.max_target_tokens is not None:  # per_step counts target tokens, so the budget bounds them
        tokens = min(tokens, float(t.max_target_tokens))
    # the tune stage's trials, once per cell: spread over the seeds of the first round
    trials = len(t.lr_grid or ()) * (t.lr_tune_steps or t.max_steps) * t.grad_accum * per_step
    tokens += trials / max(1, len(study.first_seeds))
    return tokens, 3 * fpt * tokens


def cell_parameters(study: Study, task: str, cell_name: str) -> int:
    """Trainable parameters of a cell's model at its tokenizer's configured vocabulary, counted
    on torch's meta device (shapes only, no memory)."""
    import torch

    cell = study.cell(task, cell_name)
    vocab = study.bpe_config(task, cell.filter_variant, cell.bpe_variant).vocab_size
    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=vocab, pad_id=PAD, bos_id=BOS, eos_id=EOS, **cell.model))
    return count_parameters(model)


def matched_parameters(study: Study) -> list[str]:
    """One line per cell that declares `params_match`, in every task that trains it and the cell it
    matches; ConfigError (naming both cells) where the counts differ by more than 1 %."""
    lines = []
    for task in study.tasks.values():
        for name in task.cells:
            target = (study.raw.get("cells", {}).get(name) or {}).get("params_match")
            if not target:
                continue
            if target not in task.cells:
                raise ConfigError(f"{study.path}: cells.{name}.params_match: cell {target!r} is not trained by task "
                                  f"{task.name!r}, which trains {name!r}")
            ours, theirs = cell_parameters(study, task.name, name), cell_parameters(study, task.name, target)
            share = abs(ours - theirs) / theirs
            if share > PARAMS_MATCH_TOLERANCE:
                raise ConfigError(f"{study.path}: cells.{name}.params_match: {name} has {ours:,} parameters in task "
                                  f"{task.name!r}, {target} {theirs:,} ({100 * share:.1f} % apart; at most "
                                  f"{100 * PARAMS_MATCH_TOLERANCE:g} %)")
            lines.append(f"  {task.name}: {name} has {ours:,} parameters, {target} {theirs:,} "
                         f"({100 * (ours - theirs) / theirs:+.2f} %)")
    return lines


def measured_throughput(files=None, device: str = "cuda") -> tuple[float, str] | None:
    """(achieved training FLOP/s, a description of where it was measured) or None, from the first
    record measured on `device` ("cuda" or "cpu"): a GPU's estimate never rests on a CPU's record."""
    for path in BENCH_FILES if files is None else files:
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        # a bench_real_cell report (its "cost", possibly under "results") or a bare cost.json
        cost = record.get("cost") or record.get("results", {}).get("cost") or record
        if cost.get("device", "cuda") != device:
            continue
        where = f"{cost.get('device_name', cost.get('device'))}, {_shown(path)}"
        if cost.get("mfu") and cost.get("peak_flops"):
            return cost["mfu"] * cost["peak_flops"], where
        if cost.get("achieved_flops"):
            return cost["achieved_flops"], where
    return None


def _shown(path: Path) -> str:
    """The record's path as a reader of the project finds it (relative to its root when inside)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def summary(study: Study) -> str:
    lines, total_tokens, total_flops = [], 0.0, 0.0
    # Screening stages count too: stage one in full, stage two's own cells as if all were promoted
    # (its other cells are the screened task's runs, counted there).
    for name, task in study.all_tasks.items():
        cells = study.own_cells(name)
        if not cells:
            continue
        runs = [job_compute(study, name, c) for c in cells]
        seeds = len(study.first_seeds)  # adaptive seeds: the first round (the plan decides the rest)
        tokens = sum(r[0] for r in runs) * seeds
        flops = sum(r[1] for r in runs) * seeds
        total_tokens, total_flops = total_tokens + tokens, total_flops + flops
        what = {1: " (screening stage one)", 2: " (screening stage two, if promoted)"}.get(task.stage, "")
        lines.append(f"  {name}{what}: {len(cells)} cells x {seeds} seeds, "
                     f"{tokens:.3g} training tokens, {flops:.3g} FLOPs")
    if study.adaptive_seeds:
        extra = len(study.seeds) - len(study.first_seeds)
        lines.append(f"  adaptive seeds: the plan may add {extra} seed{'s' if extra != 1 else ''} to the cells of "
                     f"unsettled claim comparisons (not counted above; each added cell costs {extra}/"
                     f"{len(study.first_seeds)} of its first round)")
    text = f"estimated training compute (upper bound: max_steps, no early stopping): " \
           f"{total_tokens:.3g} tokens, {total_flops:.3g} FLOPs"
    if study.device in ("cuda", "auto"):
        measured = measured_throughput()
        if measured:
            rate, where = measured
            hours = total_flops / rate / 3600
            when = f"{hours:,.1f} GPU-hours" if hours >= 1 else f"{hours * 60:.1f} GPU-minutes"
            text += f"\n  = {when} at {rate / 1e12:.1f} TFLOP/s achieved by the last real-cell benchmark ({where})"
        else:
            text += "\n  (no real-cell benchmark yet: bench/bench_real_cell.py measures the throughput for hours)"
    if study.device in ("cuda", "auto"):
        from ..node.parts_layout import layout_path

        if layout_path(study).is_file():  # a study that runs in parts: its wall time, part by part
            text += "\n" + predict_parts(study)["text"]
    if study.device in ("cpu", "auto"):
        text += "\n" + cpu_line(total_flops, len(study.first_seeds) * sum(len(study.own_cells(n)) for n in study.all_tasks))
    return "\n".join([text, *lines])


def cpu_line(total_flops: float, runs: int, cores: int | None = None) -> str:
    measured = measured_throughput(CPU_BENCH_FILES, device="cpu")
    if not measured:
        return "  (no CPU real-cell benchmark yet: bench/bench_real_cell.py --name real_cell_cpu measures it)"
    rate, where = measured
    cores = cores or os.cpu_count() or 1
    core_min = total_flops / rate / 60
    wall_min = core_min / max(1, min(cores, runs))
    return (f"  = {core_min:,.0f} CPU core-minutes at {rate / 1e9:.0f} GFLOP/s per one-thread training job ({where}); "
            f"{min(cores, runs)} jobs at a time on this machine's {cores} cores: ~{wall_min:,.0f} min of training")


# --- wall time of a study in parts, on one GPU ---------------------------------------------------------
#
# Measured on an H100 (the records are read, not copied):
#   * a training step of the eager engine is launch-bound: its time grows with the number of layers
#     and hardly with d_model or the batch (bench/results/h100/train_step_b64.md: d128/2+2 11.7 ms,
#     d256/3+3 19.8 ms, d512/6+6 40.4 ms at 8k-token batches, isolated). The real Multi30k cell
#     (d512, 6+6 layers, 8k-token batches, with its data loading, logging and evaluations) made
#     `steps` steps in `wall_s` seconds (real_cell_multi30k_metrics.json, _cost.json): 47.5 ms,
#     i.e. 3.96 ms per layer and step, which is what a job here is given, alone on the GPU.
#   * data: a part prepares its tasks' data first. The reference CPU study's download, filter and
#     BPE stages of Multi30k and PTB (reports/reference/cpu/timing.json: the longest job of each
#     stage, 1.5 + 1.4 + 2.6 s on a 2-core CPU) give it; the node's CPU is not slower.
#   * decoding: beam 4 over 512 sentences in 0.28 s for d256/3+3 (decode_b512_within_sentence.md):
#     a 1,000-sentence test set is ~1 s of an evaluation job.
# Assumed (never measured; the first run of a study in parts measures them):
SHARING_EFFICIENCY = 0.5  # K >= 2 jobs sharing one GPU make K x 0.5 times the steps of one job alone
# a train/evaluate process before its first step: importing torch and the stages (2.1 s measured on
# a 2-core CPU), the CUDA context and libraries, the peak-FLOP/s probe, data and model (assumed)
JOB_START_S = 8.0
EVAL_WORK_S = 5.0         # an evaluation's own work: test/validation perplexity passes and decoding
PART_START_S = 10.0       # per part: listing its targets, Snakemake's DAG (node.sh's import checks: once)
PACK_S = 10.0             # packing a part's archive
# After a study has run in parts, its own records replace the step time and the evaluation time:
# per task, the measured seconds per layer and step while the jobs shared the GPU, and the mean
# evaluate job (bench/study_throughput.py's record, written by `parts build --reference`).
H100_RECORDS = ROOT / "bench" / "results" / "h100"
STEP_RECORDS = ((ROOT / "reports" / "bench" / "real_cell.json", None),
                (H100_RECORDS / "real_cell_multi30k_cost.json", H100_RECORDS / "real_cell_multi30k_metrics.json"))
DATA_RECORD = ROOT / "reports" / "reference" / "cpu" / "timing.json"
REAL_CELL_LAYERS = 12  # bench/real_cell.yaml: the base model, 6 + 6 layers


def _layers(model: dict) -> int:
    arch = model.get("arch", "encoder_decoder")
    if arch == "decoder_only":
        return int(model["dec_layers"])
    if arch == "encoder_only":
        return int(model["enc_layers"])
    return int(model["enc_layers"]) + int(model["dec_layers"])


def measured_step() -> tuple[float, str] | None:
    """(seconds per layer and step of one eager training job alone on the GPU, where measured)."""
    for cost_path, metrics_path in STEP_RECORDS:
        if not cost_path.exists():
            continue
        record = json.loads(cost_path.read_text())
        cost = record.get("cost") or record.get("results", {}).get("cost") or record
        metrics = record.get("metrics") or record.get("results", {}).get("metrics") or (
            json.loads(metrics_path.read_text()) if metrics_path and metrics_path.exists() else {})
        layers = _layers(record["model"]) if isinstance(record.get("model"), dict) and "enc_layers" in record["model"] \
            else REAL_CELL_LAYERS
        if cost.get("wall_s") and metrics.get("steps") and not cost.get("compiled"):
            where = f"{cost.get('device_name')}, {_shown(cost_path)}"
            return cost["wall_s"] / metrics["steps"] / layers, where
    return None


def measured_study(study: Study) -> tuple[dict, str] | None:
    """Per task: (seconds per layer-step while sharing, mean evaluate seconds, jobs that could run at
    once while they were measured) from this study's own finished runs on the GPU, if recorded.
    A run's seconds hold only at the concurrency they were measured at: a run alone is faster than
    one of 8 sharing the GPU, so they are not a measure of 8 at once."""
    candidates = [ROOT / "reports" / "reference" / "h100" / "throughput.json",
                  H100_RECORDS / f"study_{study.name}_throughput.json"]
    for path in candidates:
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        if record.get("study") != study.name:
            continue
        per_task: dict[str, dict] = {}
        for r in record.get("runs", []):
            if r["task"] not in study.tasks or not r.get("steps") or not r.get("wall_s"):
                continue
            layers = _layers(study.cell(r["task"], r["cell"]).model) if r["cell"] in study.tasks[r["task"]].cells \
                else None
            if not layers:
                continue
            d = per_task.setdefault(r["task"], {"step": [], "eval": []})
            d["step"].append(r["wall_s"] / r["steps"] / layers)
            if r.get("evaluate_s"):
                d["eval"].append(r["evaluate_s"])
        slots = _slots_per_task(study, path.parent / "timing.json")
        if per_task:
            return ({t: (sum(d["step"]) / len(d["step"]),
                         sum(d["eval"]) / len(d["eval"]) if d["eval"] else None,
                         slots.get(t)) for t, d in per_task.items()},
                    _shown(path))
    return None


def _slots_per_task(study: Study, timing_path: Path) -> dict[str, int]:
    """Per task: how many jobs could run at once in the parts that measured it (timing.json's
    job_slots_used: the layout's jobs_per_gpu, or fewer when Snakemake had fewer cores)."""
    if not timing_path.exists():
        return {}
    from ..node.parts_layout import load_layout

    used = {p["part"]: p.get("job_slots_used") for p in json.loads(timing_path.read_text()).get("parts", [])}
    slots: dict[str, int] = {}
    for part in load_layout(study).parts:
        if used.get(part.name):
            for task in {r[0] for r in part.runs}:
                slots[task] = min(slots.get(task, used[part.name]), used[part.name])
    return slots


def _data_seconds() -> float:
    """Download, filter and BPE of a part's tasks, one after the other (each stage's longest job)."""
    if DATA_RECORD.exists():
        stages = json.loads(DATA_RECORD.read_text()).get("stage_seconds", {})
        if all(s in stages for s in ("download", "filter", "bpe")):
            return sum(stages[s]["max_s"] for s in ("download", "filter", "bpe"))
    return 3 * 30.0


def _makespan(jobs: list[tuple[float, float]], slots: int) -> float:
    """Training jobs in order, each followed by its evaluation, on `slots` slots; a slot that frees
    takes an evaluation that is ready first (as Snakemake, which starts what is ready)."""
    import heapq
    from collections import deque

    free = [0.0] * slots
    ready: list[tuple[float, float]] = []  # (ready at, seconds) of evaluations
    todo = deque(jobs)
    end = 0.0
    while todo or ready:
        t = heapq.heappop(free)
        if ready and (ready[0][0] <= t or not todo):
            at, dur = heapq.heappop(ready)
            finish = max(t, at) + dur
        else:
            train, evaluate = todo.popleft()
            finish = t + train
            heapq.heappush(ready, (finish, evaluate))
        heapq.heappush(free, finish)
        end = max(end, finish)
    return end


def _benchmarked_peak_flops() -> float | None:
    """The GPU's measured peak FLOP/s, from the first real-cell benchmark record there is."""
    for path in BENCH_FILES:
        if path.exists():
            d = json.loads(path.read_text())
            return (d.get("cost") or d).get("peak_flops")
    return None


def _extension_line(parts: dict, extensions: set) -> str:
    return ("    then, only if the slot has time left, extension parts: "
            + ", ".join(f"{name} {sec / 60:.1f} min" for name, sec in parts.items() if name in extensions)
            + f" ({sum(parts[n] for n in extensions) / 60:.1f} min more)")


def predict_parts(study: Study, layout=None) -> dict:
    """{"parts": {name: seconds}, "study_s": seconds of the core parts, "text": lines for validate,
    "basis": sources}."""
    from ..node.parts_layout import load_layout

    layout = layout or load_layout(study)
    if study.device == "cpu":
        return {"parts": {}, "study_s": None, "basis": None, "text": "  (a CPU study: no GPU prediction)"}
    k = layout.jobs_per_gpu
    own = measured_study(study)
    alone = measured_step()
    if own is None and alone is None:
        return {"parts": {}, "study_s": None, "basis": None,
                "text": "  (no measured training-step record: bench/bench_real_cell.py makes one)"}
    share = 1.0 if k == 1 else SHARING_EFFICIENCY
    parts, flops_rate, trial_jobs = {}, [], 0
    at_once = {}  # task -> jobs that could run at once while its own runs were measured
    for part in layout.parts:
        jobs, tunes = [], {}
        slots = k
        for task, cell_name, _seed in part.runs:
            cell = study.cell(task, cell_name)
            layers = _layers(cell.model)
            step_s, eval_s = None, None
            if own and task in own[0]:
                step_s, eval_s, measured_at = own[0][task]
                step_s *= layers
                if measured_at:  # a run's seconds hold at the concurrency they were measured at
                    at_once[task] = measured_at
                    slots = min(slots, measured_at)
            if step_s is None:
                step_s = alone[0] * layers / share
            if eval_s is None:
                eval_s = JOB_START_S + EVAL_WORK_S
            steps = cell.train.max_steps
            jobs.append((JOB_START_S + steps * step_s, eval_s))
            if cell.train.lr_grid:  # the cell's lr trials, one job before its runs (no evaluation job)
                trial_steps = len(cell.train.lr_grid) * (cell.train.lr_tune_steps or steps)
                tunes[(task, cell_name)] = (JOB_START_S + trial_steps * step_s, 0.0)
            flops_rate.append(job_compute(study, task, cell_name)[1] / steps / step_s)
        parts[part.name] = PART_START_S + _data_seconds() + _makespan([*tunes.values(), *jobs], slots) + PACK_S
        trial_jobs += len(tunes)
    extensions = {p.name for p in layout.parts if p.extension}
    total = sum(sec for name, sec in parts.items() if name not in extensions)  # the core parts: the target's
    peak = _benchmarked_peak_flops()
    together = min([k, *at_once.values()])  # jobs at once in the prediction
    mean_rate = together * sum(flops_rate) / len(flops_rate) if flops_rate else 0.0
    gpu = layout.gpu or (alone[1].split(",")[0] if alone else "the GPU")
    if together < k:
        basis = (f"measured: this study's own runs ({own[1]}), per task, with at most "
                 + ", ".join(f"{a} ({t})" for t, a in at_once.items())
                 + f" jobs at once, so predicted at that many; {k} jobs sharing the GPU never measured")
    elif own:
        basis = f"measured: this study's own runs ({own[1]}), per task, {k} jobs sharing the GPU"
    else:
        basis = (f"measured: {alone[0] * 1e3:.2f} ms per layer and step of one eager job alone ({alone[1]}); "
                 f"assumed: {k} jobs sharing the GPU make {k * share:g}x one job's steps (never measured), "
                 f"{JOB_START_S:g} s to start each job")
    core = len(parts) - len(extensions)
    lines = [f"  = {total / 60:.1f} min on one {gpu} in {core} parts, {together} jobs sharing it"
             + (f" (target {layout.study_limit_s / 60:g} min)" if layout.study_limit_s else "") + ": "
             + ", ".join(f"{name} {sec / 60:.1f} min" for name, sec in parts.items() if name not in extensions)
             + f" (each part stops at {layout.limit_s / 60:g} min)",
             f"    {basis}"]
    if extensions:
        lines.insert(1, _extension_line(parts, extensions))
    if trial_jobs:
        lines.append(f"    includes {trial_jobs} lr-grid trial jobs (each cell's grid x lr_tune_steps, before its runs)")
    if peak and mean_rate:
        lines.append(f"    while {together} jobs share it: ~{mean_rate / 1e12:.0f} TFLOP/s of training, "
                     f"{100 * mean_rate / peak:.0f} % MFU (measured peak {peak / 1e12:.0f} TFLOP/s)")
    over = [n for n, sec in parts.items() if sec > layout.limit_s]
    if over:
        lines.append(f"    !! predicted past the part limit of {layout.limit_s:g} s: {', '.join(over)}")
    if layout.study_limit_s and total > layout.study_limit_s:
        lines.append(f"    !! predicted past the study's target of {layout.study_limit_s:g} s")
    return {"parts": {n: round(v, 1) for n, v in parts.items()}, "study_s": round(total, 1),
            "text": "\n".join(lines), "basis": basis}
