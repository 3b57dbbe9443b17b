"""A study's training compute before anything runs (`python -m pipeline_src validate` prints it).

Per training job: target tokens = max_steps x grad_accum x the target tokens of a full batch
(batch_tokens; for sequence-to-sequence its target share max_tgt_len / max_src_len when the source
is longer), an upper bound (padding and early stopping only lower it); FLOPs = 3 x FLOPs per
token x tokens, with FLOPs per token from model/accounting.py at the configured maximum lengths,
exactly as train.py computes them for MFU, so the benchmark's achieved FLOP/s (same convention)
converts them to time. Hours = FLOPs / the achieved
FLOP/s of the most recent real-cell benchmark (cost.json: MFU x measured peak), if there is one:
reports/bench/real_cell.json (bench/bench_real_cell.py) first, else the committed H100 record.
A CPU study (device: cpu; auto shows both) uses the CPU records instead: the achieved FLOP/s of
one single-threaded training job, and as many jobs at a time as the machine has cores (what
`snakemake --cores N` runs), so the wall-clock line is training only: data preparation,
evaluation and the report come on top.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .config import Study
from .data.tokens import BOS, EOS, PAD
from .model import ModelConfig, flops_per_token

ROOT = Path(__file__).resolve().parent.parent
BENCH_FILES = (ROOT / "reports" / "bench" / "real_cell.json",
               ROOT / "bench" / "results" / "h100" / "real_cell_multi30k_cost.json")
CPU_BENCH_FILES = (ROOT / "reports" / "bench" / "real_cell_cpu.json",
                   ROOT / "bench" / "results" / "cpu" / "real_cell_cpu.json")


def job_compute(study: Study, task: str, cell_name: str) -> tuple[float, float]:
    """(training tokens, training FLOPs) of one seed of one cell: upper bounds."""
    cell = study.cell(task, cell_name)
    t = cell.train
    vocab = study.bpe_config(task, cell.fv, cell.tv).vocab_size  # the cell's tokenizer (a cell may override bpe)
    mcfg = ModelConfig(vocab_size=vocab, pad_id=PAD, bos_id=BOS, eos_id=EOS, **cell.model)
    if cell.kind == "lm":
        per_step = max(1, t.batch_tokens // t.lm_seq_len) * t.lm_seq_len
        fpt = flops_per_token(mcfg, 0, t.lm_seq_len)
    else:  # batch_tokens bounds rows x the longer side; the target's share of it carries the loss
        per_step = t.batch_tokens * min(1.0, t.max_tgt_len / max(t.max_src_len, 1))
        fpt = flops_per_token(mcfg, t.max_src_len, t.max_tgt_len)
    tokens = float(t.max_steps * t.grad_accum * per_step)
    return tokens, 3 * fpt * tokens


def measured_throughput(files=None) -> tuple[float, str] | None:
    """(achieved training FLOP/s, a description of where it was measured) or None."""
    for path in BENCH_FILES if files is None else files:
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        # a bench_real_cell report (its "cost", possibly under "results") or a bare cost.json
        cost = record.get("cost") or record.get("results", {}).get("cost") or record
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
        tokens = sum(r[0] for r in runs) * len(study.seeds)
        flops = sum(r[1] for r in runs) * len(study.seeds)
        total_tokens, total_flops = total_tokens + tokens, total_flops + flops
        what = {1: " (screening stage one)", 2: " (screening stage two, if promoted)"}.get(task.stage, "")
        lines.append(f"  {name}{what}: {len(cells)} cells x {len(study.seeds)} seeds, "
                     f"{tokens:.3g} training tokens, {flops:.3g} FLOPs")
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
    if study.device in ("cpu", "auto"):
        text += "\n" + cpu_line(total_flops, len(study.seeds) * sum(len(study.own_cells(n)) for n in study.all_tasks))
    return "\n".join([text, *lines])


def cpu_line(total_flops: float, runs: int, cores: int | None = None) -> str:
    measured = measured_throughput(CPU_BENCH_FILES)
    if not measured:
        return "  (no CPU real-cell benchmark yet: bench/bench_real_cell.py --name real_cell_cpu measures it)"
    rate, where = measured
    cores = cores or os.cpu_count() or 1
    core_min = total_flops / rate / 60
    wall_min = core_min / max(1, min(cores, runs))
    return (f"  = {core_min:,.0f} CPU core-minutes at {rate / 1e9:.0f} GFLOP/s per one-thread training job ({where}); "
            f"{min(cores, runs)} jobs at a time on this machine's {cores} cores: ~{wall_min:,.0f} min of training")
