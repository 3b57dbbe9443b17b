"""The files a finished training run leaves (paths from the stage table):

ckpt/                last.pt, best.pt (+ averaged.pt with train.average_last), config.json
train_log.tsv        the logged steps: loss, validation loss, lr, grad norm, tokens/s, memory
                     (written as the run goes, live_log.py; rewritten whole here)
train_info.json      identity, outcome, resolved config, provenance
cost.json            wall clock, throughput, MFU, memory, precision, allocator, shapes, warm-up,
                     the steps where the run was stopped and continued (signals, job time limits)
train_metrics.json   numbers only, deterministic (same params + seed -> same bytes on CPU);
                     written last, so its presence means every output above is complete
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from ..common import atomic_dir, atomic_write_json, atomic_write_text, cpu_name, provenance, utc_stamp
from ..runtime import allocator, machine
from ..study.convergence import CONVERGED_RULE, converged
from . import precision, state as train_state
from .compiling import compiled_graphs
from .live_log import log_tsv


def write_outputs(run) -> None:
    """Everything a finished `train.Trainer` run writes, then its scratch directory removed."""
    state, cell = run.state, run.cell
    meta = {"config": cell.to_dict(), "vocab_size": run.vocab_size, "seed": run.seed, "step": state["step"],
            "model_config": dataclasses.asdict(run.model_cfg)}
    write_checkpoints(run, meta)
    atomic_write_text(run.out["log"], log_tsv(state["log"]))
    atomic_write_json(run.out["info"], {
        "task": run.task, "cell": run.cell_name, "seed": run.seed, "kind": cell.kind, "family": cell.family,
        "label": cell.label, "leaks_future": cell.leaks_future, "stop_reason": state.get("stop_reason", "max_steps"),
        "eval_checkpoint": "averaged.pt" if state["averaged"] else "best.pt",
        # the peak learning rate the run trained at (a tuned cell's: the one chosen on validation)
        "lr": cell.train.lr, "converged": converged(state["log"]), "converged_rule": CONVERGED_RULE,
        "config": cell.to_dict(), "provenance": provenance(run.study, seed=run.seed)})
    atomic_write_json(run.out["cost"], cost_record(run))
    final_train = next((r["train_loss"] for r in reversed(state["log"]) if r.get("train_loss") != ""), float("nan"))
    atomic_write_json(run.out["metrics"], {
        "n_params": run.n_params, "flops_per_token": run.flops_per_token, "steps": state["step"],
        "epochs": state["epoch"], "train_tokens": state["train_tokens"], "best_val_loss": state["best_val"],
        "best_step": state["best_step"], "final_val_loss": state["final_val"], "final_train_loss": final_train,
        # whether the run trained at all (report/aggregate.py) and how much of the data it saw
        "unigram_val_loss": run.data.unigram_val_loss(run.vocab_size),
        "epochs_seen": state.get("global_target_tokens", state["train_tokens"]) / max(1, run.data.tokens_per_epoch())})
    shutil.rmtree(run.scratch, ignore_errors=True)
    print(f"trained {run.name}: {state['step']} steps, best val loss {state['best_val']:.4f} "
          f"(step {state['best_step']}), {run.meter.tokens_per_s:.0f} tok/s on {run.device}", flush=True)


def write_checkpoints(run, meta: dict) -> None:
    """ckpt/: the last weights, the best (by validation loss) and the average of the last saved."""
    scratch, state = run.scratch, run.state
    with atomic_dir(run.out["ckpt"]) as ckpt:
        train_state.save(ckpt / "last.pt", {"model": train_state.weights(run.model), "meta": meta})
        best = train_state.load(scratch / "best.pt") if (scratch / "best.pt").exists() else train_state.weights(run.model)
        train_state.save(ckpt / "best.pt", {"model": best, "meta": dict(meta, step=state["best_step"])})
        if state["averaged"]:
            avg = train_state.average([train_state.load(scratch / n) for n in state["averaged"]])
            train_state.save(ckpt / "averaged.pt", {"model": avg, "meta": dict(meta, averaged=state["averaged"])})
        atomic_write_json(ckpt / "config.json", meta)


def cost_record(run) -> dict:
    device, t, meter = run.device, run.cell.train, run.meter
    tokens_per_s = meter.tokens_per_s
    fpt, peak = run.flops_per_token, run.peak_flops
    return {
        "wall_s": run.wall_s, "tokens_per_s": tokens_per_s, "device": device.type,
        # when the training loop ran: how runs sharing a GPU overlapped (bench/study_throughput.py)
        "start_utc": utc_stamp(run.started_unix, "milliseconds"), "end_utc": utc_stamp(run.ended_unix, "milliseconds"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(), "peak_mem_mb": memory_mb(device, peak=True),
        # forked from the start-up server (pipeline_src/runtime/preload.py): its peak memory leaves out the
        # pages of the libraries that the copy never touched (~50 MB less on a CPU)
        "preloaded": os.environ.get("PIPELINE_PRELOADED") == str(os.getpid()),
        "precision": precision.name(device, t.precision),
        # what decides the run's floats: check-reference expects identical bytes only where all match
        "machine": machine.facts(precision.name(device, t.precision),
                                 torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "mfu": (3 * fpt * tokens_per_s / peak) if peak else None, "peak_flops": peak,
        "achieved_flops": 3 * fpt * tokens_per_s,  # the convention of study/estimate.py (FLOPs at the max lengths)
        # measured from every step's batches (trainer.py): what the run computed and read
        "train_flops": run.state.get("train_flops", 0.0), "processed_tokens": run.state.get("processed_tokens", 0),
        "target_tokens": run.state.get("global_target_tokens", run.state["train_tokens"]),
        "resumed_from_step": run.resumed_from, "stops": run.state.get("stops", []), "pad_fraction": meter.pad_fraction, "batch_shapes": len(meter.shapes),
        "warmup_s": meter.warmup_s, "allocator": allocator.state(), "compiled": run.compiled, "cuda_graphs": run.graphs,
        "compile_scope": t.compile_scope if run.compiled else None,
        "compiled_graphs": compiled_graphs() if run.compiled else 0}


def memory_mb(device, peak: bool = False) -> float:
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
