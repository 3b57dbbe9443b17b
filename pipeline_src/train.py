"""Train one task x cell x seed.

GPU first (bf16 autocast, TF32, SDPA; optional torch.compile), CPU fallback with the same params
(bf16 autocast there too where the CPU has bf16 units: pipeline_src/precision.py).
Resumable: the full training state (model, optimiser, RNGs, data position, best
metric, patience, log) is saved atomically to a scratch directory every `eval_every` steps, and a
restarted run continues from it; a run killed at any moment ends with the same weights and
metrics as one that was never interrupted (bit for bit on CPU).

Outputs (paths from the stage table): ckpt/{best,last}.pt (+ averaged.pt), train_metrics.json
(numbers only; deterministic: same params + seed -> same bytes on CPU), train_info.json (identity,
outcome, resolved config, provenance), train_log.tsv, cost.json (wall clock).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from . import allocator, batching, precision, screening
from .precision import autocast
from .compiling import compile_for_training, compiled_graphs, eager, token_loss
from .common import (StageError, atomic_dir, cpu_name, atomic_write_json, atomic_write_text, progress, provenance,
                     seed_everything)
from .config import CellConfig, Study
from .data.tokens import BOS, EOS, PAD, load_spm
from .gpu_slots import claim_gpu
from .optim import adamw
from .model import ModelConfig, Transformer, count_parameters, flops_per_token
from .stages import SCRATCH, data_paths, output_path
from .step_meter import StepMeter

STATE_FORMAT = 2  # 2: optimiser per device (pipeline_src/optim.py), no scheduler state
LOG_COLUMNS = ["step", "epoch", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_mb"]


# ---------------------------------------------------------------------------------------------
# Model and schedule


def model_config(cell: CellConfig, vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, pad_id=PAD, bos_id=BOS, eos_id=EOS, **cell.model)


def learning_rate(step: int, cfg) -> float:
    """Peak lr `cfg.lr` reached after `warmup_steps` (linear warm-up), then:
    inverse_sqrt - the paper's schedule, lr ∝ step^-0.5 (Vaswani et al. §5.3, rescaled to the peak);
    cosine - to zero at max_steps; constant."""
    step = max(step, 1)
    warm = cfg.warmup_steps
    if warm and step < warm:
        return cfg.lr * step / warm
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * math.sqrt(max(warm, 1) / step)
    if cfg.schedule == "cosine":
        progress_ = (step - warm) / max(1, cfg.max_steps - warm)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_)))
    return cfg.lr


def select_device(study: Study) -> torch.device:
    want = study.device
    if want == "cuda" and not torch.cuda.is_available():
        raise StageError("device: cuda requested in the params file but torch sees no CUDA device")
    if want in ("auto", "cuda") and torch.cuda.is_available():
        if "LOCAL_RANK" in os.environ:  # torchrun: one process per GPU, chosen by torchrun
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", claim_gpu())
    torch.set_num_threads(int(os.environ.get("PIPELINE_CPU_THREADS", "1")))
    return torch.device("cpu")


def target_tokens(batch: dict) -> int:
    """Loss-bearing tokens of a batch. Call it on the host copy: on a GPU tensor it would stall
    the CPU until the queued work is done."""
    return int((batch["tgt_out"] != PAD).sum())


def sequence_loss(model, batch: dict, label_smoothing: float = 0.0, reduction: str = "sum",
                  loss_fn=token_loss) -> torch.Tensor:
    """Summed cross-entropy over the target tokens (PAD ignored)."""
    logits = model(batch["src"], batch["tgt_in"], unpadded=batch.get("unpadded", False))
    return loss_fn(logits, batch["tgt_out"], label_smoothing, reduction)


# ---------------------------------------------------------------------------------------------
# Data


class TaskData:
    """Training batches for one epoch at a time, and the validation batches."""

    def __init__(self, cell: CellConfig, bpe_dir: Path, seed: int):
        self.cell, self.seed, t = cell, seed, cell.train
        self.arch = cell.model["arch"]
        if cell.kind == "lm":
            self.train_stream, _ = batching.load_lm_stream(bpe_dir, "train")
            self.val_stream, _ = batching.load_lm_stream(bpe_dir, "validation")
            self.rows = max(1, t.batch_tokens // t.lm_seq_len)
            self.train_starts = batching.lm_windows(self.train_stream, t.lm_seq_len)
            self.val_starts = batching.lm_windows(self.val_stream, t.lm_seq_len)
        else:
            self.train = batching.load_seq2seq(bpe_dir, "train", t.max_src_len, t.max_tgt_len)
            self.val = batching.load_seq2seq(bpe_dir, "validation", t.max_src_len, t.max_tgt_len)
        if self.epoch_batches(0) == []:
            raise StageError(f"task {cell.task}: the training split is empty after encoding")

    def epoch_batches(self, epoch: int, seed: int | None = -1, split: str = "train") -> list[tuple]:
        """Batch plans (indices, length, rows) of one epoch; length/rows are None for dynamic
        shapes. seed None keeps file order (validation)."""
        t = self.cell.train
        seed = self.seed if seed == -1 else seed
        static = t.length_buckets > 0
        if self.cell.kind == "lm":
            n = len(self.train_starts if split == "train" else self.val_starts)
            return [(idx, None, self.rows if static else None) for idx in batching.lm_batches(n, self.rows, seed, epoch)]
        data = self.train if split == "train" else self.val
        if static:
            return batching.seq2seq_bucket_batches(data, t.batch_tokens, self.arch, t.length_buckets, seed, epoch)
        return [(idx, None, None) for idx in batching.seq2seq_batches(data, t.batch_tokens, self.arch, seed, epoch)]

    def train_batch(self, plan: tuple, split: str = "train") -> dict:
        idx, length, rows = plan
        if self.cell.kind == "lm":
            stream, starts = (self.train_stream, self.train_starts) if split == "train" else (self.val_stream, self.val_starts)
            return batching.collate_lm(stream, starts, idx, self.cell.train.lm_seq_len, rows)
        return batching.collate_seq2seq(self.train if split == "train" else self.val, idx, self.arch, length, rows)

    def val_batches(self):
        for plan in self.epoch_batches(0, seed=None, split="validation"):
            yield self.train_batch(plan, split="validation")


@torch.no_grad()
def validation_loss(model, data: TaskData, device, precision: str) -> float:
    """Mean NLL per target token (no label smoothing), the quantity perplexity is made from."""
    model.eval()
    total, count = 0.0, 0
    for batch in data.val_batches():
        with autocast(device, precision):
            loss = sequence_loss(model, batching.to_device(batch, device))
        total, count = total + float(loss), count + target_tokens(batch)
    model.train()
    return total / max(count, 1)


# ---------------------------------------------------------------------------------------------
# Several processes (torchrun): every rank builds the same global batch and keeps its share


def distributed_setup(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world


def shard(batch: dict, rank: int, world: int) -> dict:
    """Rows rank, rank+world, ... of a global batch. A rank left without rows keeps one row with
    no target tokens, so that every rank still joins the gradient all-reduce."""
    if world == 1:
        return batch
    n = batch["tgt_in"].size(0)
    rows = list(range(rank, n, world))
    empty = not rows
    rows = rows or [0]
    out = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    if empty:
        out["tgt_out"] = torch.full_like(out["tgt_out"], PAD)
    return out


# ---------------------------------------------------------------------------------------------
# State: everything needed to continue exactly where a run stopped


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save(path: Path, obj) -> None:
    """torch.save through a temporary file + rename: a kill never leaves a torn checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load(path: Path):
    # RNG states hold numpy arrays and tuples, which the weights-only unpickler refuses;
    # this file is our own scratch state, never a downloaded checkpoint.
    return torch.load(path, map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------------------------------


def run(study: Study, task: str, cell_name: str, seed: int) -> None:
    screening.require_own_run(study, "train", task, cell_name)
    if not screening.promoted(study, task, cell_name):  # stage two of a screening, family not promoted
        return screening.write_not_promoted_train(study, task, cell_name, seed)
    cell = study.cell(task, cell_name)
    t = cell.train
    wc = dict(study=study.name, task=task, cell=cell_name, seed=seed)
    out = {name: Path(output_path("train", name, **wc)) for name in ("ckpt", "metrics", "info", "log", "cost")}
    scratch = Path(SCRATCH.format(**wc))
    bpe_dir = Path(data_paths(study, task, cell_name)[1])  # the cell's data variant

    seed_everything(seed)
    device = select_device(study)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    vocab_size = load_spm(bpe_dir).get_piece_size()
    data = TaskData(cell, bpe_dir, seed)
    mcfg = model_config(cell, vocab_size)
    model = Transformer(mcfg).to(device)
    rank, world = distributed_setup(device)
    # torch's fused AdamW on CUDA; on CPU the same arithmetic without torch.optim's import of
    # torch._dynamo (pipeline_src/optim.py). The schedule sets the lr before every step.
    optimizer = adamw(model.parameters(), device, lr=learning_rate(1, t), betas=t.betas, eps=t.eps,
                      weight_decay=t.weight_decay)
    # train.compile: torch.compile, scoped and shaped so that its warm-up stays short
    # (pipeline_src/compiling.py; cost.json: compiled_graphs, warmup_s, batch_shapes).
    # train.cuda_graphs: each compiled region is also replayed as a CUDA graph per shape (torch's
    # "reduce-overhead" mode), which removes the per-kernel launch cost small models pay.
    step_fn, loss_fn, compiled, graphs = model, token_loss, False, False
    if t.compile and device.type == "cuda":
        compiled, graphs = True, t.cuda_graphs
        step_fn, loss_fn = compile_for_training(model, t.compile_scope, t.compile_dynamic, graphs)

    def validate() -> float:
        with eager() if compiled else contextlib.nullcontext():
            return validation_loss(model, data, device, t.precision)
    if world > 1:
        step_fn = torch.nn.parallel.DistributedDataParallel(step_fn, device_ids=[device.index] if device.type == "cuda" else None)

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_val": math.inf, "best_step": 0, "bad_evals": 0,
             "log": [], "train_tokens": 0, "averaged": []}
    state_path = scratch / "state.pt"
    resumed_from = None
    # (STATE_FORMAT: a state saved by an older version of this file is not resumed from)
    fingerprint = study.section_hash(*[k for k in (f"tasks.{task}.model", f"tasks.{task}.train", f"cells.{cell_name}")])
    fingerprint = f"{fingerprint}/{STATE_FORMAT}/{type(optimizer).__module__}"  # (CPU and CUDA optimisers differ)
    if state_path.exists():
        saved = _load(state_path)
        if saved.get("fingerprint") == fingerprint:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            _set_rng_state(saved["rng"])
            state = saved["state"]
            resumed_from = state["step"]
            print(f"resuming {task}/{cell_name}/seed{seed} from step {state['step']}", flush=True)
        else:  # params changed since that state was written: it belongs to another run
            shutil.rmtree(scratch)
    scratch.mkdir(parents=True, exist_ok=True)

    n_params = count_parameters(model)
    # A language model has no source: its whole context is the target sequence.
    fpt = flops_per_token(mcfg, 0, t.lm_seq_len) if cell.kind == "lm" else flops_per_token(mcfg, t.max_src_len, t.max_tgt_len)
    peak = _peak_flops(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    started, started_unix, meter = time.perf_counter(), time.time(), StepMeter(device)
    # Batches in training order from the saved data position; collated ahead in a thread (into
    # pinned memory on CUDA) unless train.prefetch is false. Same batches either way.
    stream = batching.batch_stream(data.epoch_batches, data.train_batch, state["epoch"], state["batch_in_epoch"])
    if t.prefetch or (t.prefetch is None and device.type == "cuda"):
        stream = batching.Prefetcher(stream, depth=4, pin=device.type == "cuda")
    bar = progress(total=t.max_steps, initial=state["step"], desc=f"train {task}/{cell_name}/s{seed}", unit="step")

    def read_steps():
        """The steps since the last read (one host sync). A non-finite loss stops the run; the
        state on disk is older than it, because a save always comes right after a read."""
        steps, tokens_per_s = meter.read()
        bad = next((s_ for s_, loss_, _, _ in steps if not math.isfinite(loss_)), None)
        if bad is not None:
            bar.close()
            batching.close(stream)
            raise StageError(
                f"{task}/{cell_name}/seed{seed}: non-finite training loss at step {bad}; "
                f"the last good state is kept in {state_path} (lower lr or enable clipping)")
        return steps, tokens_per_s

    while state["step"] < t.max_steps and "stop_reason" not in state:
        if t.max_epochs is not None and state["epoch"] >= t.max_epochs:
            state["stop_reason"] = "max_epochs"
            break
        if t.time_budget_s is not None and time.perf_counter() - started > t.time_budget_s:
            state["stop_reason"] = "time_budget"
            break
        optimizer.zero_grad(set_to_none=True)
        optimizer.param_groups[0]["lr"] = learning_rate(state["step"] + 1, t)
        micro = []
        for _ in range(t.grad_accum):
            state["epoch"], state["batch_in_epoch"], batch = next(stream)
            micro.append(batch)
        total_tokens = sum(target_tokens(b) for b in micro)  # over the global batch, on the host copies
        parts = [shard(b, rank, world) for b in micro]
        step_tokens, loss_sum = sum(target_tokens(p) for p in parts), torch.zeros((), device=device)
        meter.start_step(parts)
        if graphs:  # a new training iteration: the graphs' output buffers of the last one are free
            torch.compiler.cudagraph_mark_step_begin()
        for part in parts:
            with autocast(device, t.precision):
                loss = sequence_loss(step_fn, batching.to_device(part, device), t.label_smoothing, loss_fn=loss_fn)
            # DDP averages gradients over ranks; scaling by `world` turns that into the sum, so the
            # gradient is that of the global batch's mean token loss, as in one process.
            (loss * world / total_tokens).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm or float("inf"))
        optimizer.step()
        state["step"] += 1
        state["train_tokens"] += step_tokens
        meter.end_step(state["step"], loss_sum, grad_norm, step_tokens)
        step = state["step"]
        evaluate_now = step % t.eval_every == 0 or step == t.max_steps
        bar.update(1)
        if not (step % t.log_every == 0 or step == 1 or evaluate_now):
            continue  # the loss stays on the device: no host sync on this step
        steps, tokens_per_s = read_steps()
        _, step_loss, grad_norm, step_tokens = steps[-1]
        row = {"step": step, "epoch": state["epoch"], "train_loss": step_loss / max(step_tokens, 1), "val_loss": "",
               "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "mem_mb": _memory_mb(device)}
        bar.set_postfix(loss=f"{row['train_loss']:.3f}", tok_s=f"{tokens_per_s:.0f}")
        if evaluate_now:
            val = validate()
            row["val_loss"] = val
            if val < state["best_val"]:
                state.update(best_val=val, best_step=step, bad_evals=0)
                if rank == 0:
                    _save(scratch / "best.pt", _weights(model))
            else:
                state["bad_evals"] += 1
            if t.average_last:
                name = f"eval{step}.pt"
                if rank == 0:
                    _save(scratch / name, _weights(model))
                state["averaged"] = (state["averaged"] + [name])[-t.average_last:]
            state["final_val"] = val
        state["log"].append(row)
        if evaluate_now:
            if t.patience and state["bad_evals"] >= t.patience:
                state["stop_reason"] = "early_stopping"  # saved with the state: a resumed run stops too
            if rank == 0:
                _save(state_path, {"fingerprint": fingerprint, "model": model.state_dict(),
                                   "optimizer": optimizer.state_dict(),
                                   "rng": _rng_state(), "state": state})
            meter.restart_clock()
    read_steps()  # a budget may have stopped the run between reads
    bar.close()
    batching.close(stream)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    wall, ended_unix = time.perf_counter() - started, time.time()
    if rank != 0:  # rank 0 writes every output
        return

    if "final_val" not in state:  # stopped by a budget before the first evaluation
        state["final_val"] = validate()
        if state["final_val"] < state["best_val"]:
            state.update(best_val=state["final_val"], best_step=state["step"])
            _save(scratch / "best.pt", _weights(model))
    meta = {"config": cell.to_dict(), "vocab_size": vocab_size, "seed": seed, "step": state["step"],
            "model_config": dataclasses.asdict(mcfg)}
    with atomic_dir(out["ckpt"]) as ckpt:
        torch.save({"model": _weights(model), "meta": meta}, ckpt / "last.pt")
        best = _load(scratch / "best.pt") if (scratch / "best.pt").exists() else _weights(model)
        torch.save({"model": best, "meta": dict(meta, step=state["best_step"])}, ckpt / "best.pt")
        if state["averaged"]:
            avg = _average([_load(scratch / n) for n in state["averaged"]])
            torch.save({"model": avg, "meta": dict(meta, averaged=state["averaged"])}, ckpt / "averaged.pt")
        atomic_write_json(ckpt / "config.json", meta)
    log_text = "\t".join(LOG_COLUMNS) + "\n" + "".join(
        "\t".join(_fmt(r.get(c, "")) for c in LOG_COLUMNS) + "\n" for r in state["log"])
    atomic_write_text(out["log"], log_text)
    final_train = next((r["train_loss"] for r in reversed(state["log"]) if r.get("train_loss") != ""), float("nan"))
    atomic_write_json(out["info"], {
        "task": task, "cell": cell_name, "seed": seed, "kind": cell.kind, "family": cell.family, "label": cell.label,
        "leaks_future": cell.leaks_future, "stop_reason": state.get("stop_reason", "max_steps"),
        "eval_checkpoint": "averaged.pt" if state["averaged"] else "best.pt",
        "config": cell.to_dict(), "provenance": provenance(study, seed=seed)})
    tokens_per_s = meter.tokens_per_s
    atomic_write_json(out["cost"], {
        "wall_s": wall, "tokens_per_s": tokens_per_s, "device": device.type,
        # when the training loop ran: how runs sharing a GPU overlapped (bench/study_throughput.py)
        "start_utc": _utc(started_unix), "end_utc": _utc(ended_unix),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(), "peak_mem_mb": _memory_mb(device, peak=True), "precision": precision.name(device, t.precision),
        "mfu": (3 * fpt * tokens_per_s / peak) if peak else None, "peak_flops": peak,
        "achieved_flops": 3 * fpt * tokens_per_s,  # the convention of estimate.py (FLOPs at the max lengths)
        "resumed_from_step": resumed_from, "pad_fraction": meter.pad_fraction, "batch_shapes": len(meter.shapes),
        "warmup_s": meter.warmup_s, "allocator": allocator.state(), "compiled": compiled, "cuda_graphs": graphs,
        "compile_scope": t.compile_scope if compiled else None, "compiled_graphs": compiled_graphs() if compiled else 0})
    # Written last, so its presence means every output above is complete. Numbers only in
    # the metrics file (what DVC and people compare); what the run was and how it
    # was made go to train_info.json.
    atomic_write_json(out["metrics"], {
        "n_params": n_params, "flops_per_token": fpt, "steps": state["step"],
        "epochs": state["epoch"], "train_tokens": state["train_tokens"], "best_val_loss": state["best_val"],
        "best_step": state["best_step"], "final_val_loss": state["final_val"], "final_train_loss": final_train})
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"trained {task}/{cell_name}/seed{seed}: {state['step']} steps, best val loss {state['best_val']:.4f} "
          f"(step {state['best_step']}), {tokens_per_s:.0f} tok/s on {device}", flush=True)


def _weights(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _average(states: list[dict]) -> dict:
    return {k: sum(s[k].float() for s in states) / len(states) if states[0][k].is_floating_point() else states[-1][k]
            for k in states[0]}


def _utc(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).isoformat(timespec="milliseconds")


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _memory_mb(device, peak: bool = False) -> float:
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_flops(device) -> float | None:
    """Measured dense bf16 matmul throughput of this GPU (the MFU denominator); None on CPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    tick, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - tick)


def load_trained_model(ckpt_dir, device="cpu", which: str | None = None):
    """(model in eval mode, meta) from a train stage's ckpt/ directory."""
    ckpt_dir = Path(ckpt_dir)
    if which is None:
        which = "averaged.pt" if (ckpt_dir / "averaged.pt").exists() else "best.pt"
    blob = torch.load(ckpt_dir / which, map_location="cpu", weights_only=True)
    meta = blob["meta"]
    cfg = ModelConfig(**meta["model_config"])
    model = Transformer(cfg)
    model.load_state_dict(blob["model"])
    return model.to(device).eval(), meta
