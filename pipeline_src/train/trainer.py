"""Stage `train`: one task x cell x seed.

GPU first (bf16 autocast, TF32, SDPA; optional torch.compile), CPU fallback with the same params
(bf16 autocast there too where the CPU has bf16 units: pipeline_src/train/precision.py).

How it reads: `run()` builds a `Trainer` (set-up: data, model, optimiser, compilation, and the
state of an interrupted run, if any), calls `Trainer.train()` (the loop: one `train_step` per
optimiser step; every `log_every` steps a log row; every `eval_every` steps `evaluate` and
`save_state`), then `train_outputs.write_outputs()`. Resumable: the full training state (model,
optimiser, RNGs, data position, best metric, patience, log) is saved atomically after every
evaluation (state.py), and a restarted run continues from it; a run killed at any moment
ends with the same weights and metrics as one that was never interrupted (bit for bit on CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..common import StageError, progress, reading, seed_everything
from ..data.tokens import BOS, EOS, PAD, load_spm
from ..model import ModelConfig, Transformer, batch_training_flops, count_parameters, flops_per_token
from ..runtime.gpu_slots import select_device
from ..study import screening, seed_plan
from ..study.config import CellConfig, Study
from . import batching, preemption, state as train_state
from .compiling import compile_for_training, compile_mode, eager, token_loss
from .live_log import LiveLog
from ..model.checkpoint import load_trained_model  # noqa: F401 (trainer.load_trained_model: its readers)
from ..study.paths import SCRATCH, data_paths, output_path, tune_record
from .optim import adamw
from .outputs import memory_mb, write_outputs
from .precision import autocast
from .step_meter import StepMeter


def run(study: Study, task: str, cell_name: str, seed: int) -> None:
    screening.require_own_run(study, "train", task, cell_name)
    if not screening.promoted(study, task, cell_name):  # stage two of a screening, family not promoted
        return screening.write_not_promoted_train(study, task, cell_name, seed)
    if not seed_plan.needed(study, task, cell_name, seed):  # an adaptive seed the plan did not give this cell
        return seed_plan.write_not_needed_train(study, task, cell_name, seed)
    trainer = Trainer(study, task, cell_name, seed)
    trainer.train()
    if trainer.rank == 0:  # rank 0 writes every output
        trainer.evaluate_if_never_evaluated()
        write_outputs(trainer)


class Trainer:
    """One training run: its set-up (`__init__`), the loop (`train`), and the state it carries
    from step to step (`self.state`: plain values, saved with the weights by `save_state`)."""

    def __init__(self, study: Study, task: str, cell_name: str, seed: int, cell: CellConfig | None = None,
                 out_dir: Path | None = None):
        """cell and out_dir: a trial run of the tune stage (its own settings and directory)."""
        self.study, self.task, self.cell_name, self.seed = study, task, cell_name, seed
        self.cell = cell = cell or tuned(study, task, cell_name)
        self.t = t = cell.train
        self.name = f"{task}/{cell_name}/seed{seed}" + (f" (trial, lr {t.lr:g})" if out_dir else "")
        path_fields = dict(study=study.name, task=task, cell=cell_name, seed=seed)
        names = ("ckpt", "metrics", "info", "log", "cost")
        if out_dir is None:
            self.out = {name: Path(output_path("train", name, **path_fields)) for name in names}
            self.scratch = Path(SCRATCH.format(**path_fields))
        else:
            self.out = {name: out_dir / Path(output_path("train", name, **path_fields)).name for name in names}
            self.scratch = out_dir / "scratch"
        bpe_dir = Path(data_paths(study, task, cell_name)[1])  # the cell's data variant

        seed_everything(seed)
        self.device = device = select_device(study)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        self.vocab_size = load_spm(bpe_dir).get_piece_size()
        self.data = TaskData(cell, bpe_dir, data_seed(seed, t.data_order))
        self.model_cfg = model_config(cell, self.vocab_size)
        self.model = Transformer(self.model_cfg).to(device)
        self.rank, self.world = distributed_setup(device)
        # torch's fused AdamW on CUDA; on CPU the same arithmetic without torch.optim's import of
        # torch._dynamo (pipeline_src/train/optim.py). The schedule sets the lr before every step.
        self.optimizer = adamw(self.model.parameters(), device, lr=learning_rate(1, t), betas=t.betas, eps=t.eps,
                               weight_decay=t.weight_decay)
        self.step_fn, self.loss_fn, self.compiled, self.graphs = self._compile()
        self.fingerprint = train_state.fingerprint(study, task, cell_name, self.optimizer)
        resumed = train_state.resume(self.scratch, self.fingerprint, self.model, self.optimizer)
        self.state = resumed or train_state.new_state()
        self.resumed_from = resumed["step"] if resumed else None
        if resumed:
            print(f"resuming {self.name} from step {self.state['step']}", flush=True)
        self.n_params = count_parameters(self.model)
        # A language model has no source: its whole context is the target sequence.
        self.flops_per_token = (flops_per_token(self.model_cfg, 0, t.lm_seq_len) if cell.kind == "lm"
                                else flops_per_token(self.model_cfg, t.max_src_len, t.max_tgt_len))
        self.peak_flops = _peak_flops(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _compile(self):
        """(what a step runs the model through, the loss function, compiled?, CUDA graphs?).
        train.compile: torch.compile, scoped and shaped so that its warm-up stays short
        (pipeline_src/train/compiling.py; cost.json: compiled_graphs, warmup_s, batch_shapes).
        train.cuda_graphs: each compiled region is also replayed as a CUDA graph per shape
        (torch's "reduce-overhead" mode), which removes the per-kernel launch cost small models pay."""
        t, device = self.t, self.device
        step_fn, loss_fn = self.model, token_loss
        compiled, graphs = compile_mode(t.compile, t.compile_on_cpu, t.cuda_graphs, device.type)
        if compiled:
            step_fn, loss_fn = compile_for_training(self.model, t.compile_scope, t.compile_dynamic, graphs)
        if self.world > 1:
            ids = [device.index] if device.type == "cuda" else None
            step_fn = torch.nn.parallel.DistributedDataParallel(step_fn, device_ids=ids)
        return step_fn, loss_fn, compiled, graphs

    # --- the loop ------------------------------------------------------------------------------

    def train(self) -> None:
        t, state = self.t, self.state
        self.model.train()
        self.started, self.started_unix = time.perf_counter(), time.time()
        # a resumed run's earlier sittings, up to their last saved state (the work after it is redone)
        self.wall_before = float(state.get("wall_s", 0.0))
        self.meter = StepMeter(self.device)
        stream = self._batches()
        stop = preemption.StopWatch()  # from here until close(): SIGTERM/SIGUSR1 and the time limit
        live = LiveLog(self.out["log"], state["log"], enabled=self.rank == 0)  # curves as it trains
        bar = progress(total=t.max_steps, initial=state["step"], desc=f"train {self.name}", unit="step")
        try:
            while state["step"] < t.max_steps and "stop_reason" not in state:
                if budget_spent := self._budget_spent():
                    state["stop_reason"] = budget_spent
                    break
                if why := self._told_to_stop(stop):
                    self.save_for_later(why, requeue=stop.out_of_time)  # raises SavedForLater
                self.train_step(stream)
                step = state["step"]
                bar.update(1)
                last = step == t.max_steps or self._tokens_spent()
                evaluate_now = step % t.eval_every == 0 or last
                if not (step % t.log_every == 0 or step == 1 or evaluate_now):
                    continue  # the loss stays on the device: no host sync on this step
                row = self.log_row()
                bar.set_postfix(loss=f"{row['train_loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                state["log"].append(row)
                if evaluate_now:
                    self.evaluate(row)
                    self.save_state()
                    self.meter.restart_clock()
                live.add(row)
            self.read_steps()  # a budget may have stopped the run between reads
        finally:
            stop.close()
            live.close()
            bar.close()
            batching.close(stream)
        if self.world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
        self.wall_s, self.ended_unix = self.wall_before + time.perf_counter() - self.started, time.time()

    def train_step(self, stream) -> None:
        """One optimiser step over the next `grad_accum` batches (this rank's share of each)."""
        t, state, device = self.t, self.state, self.device
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.param_groups[0]["lr"] = learning_rate(state["step"] + 1, t)
        micro = []
        for _ in range(t.grad_accum):
            state["epoch"], state["batch_in_epoch"], batch = next(stream)
            micro.append(batch)
        total_tokens = sum(target_tokens(b) for b in micro)  # over the global batch, on the host copies
        # (every rank counts the global batch, so that all ranks stop at the same step)
        state["global_target_tokens"] = state.get("global_target_tokens", 0) + total_tokens
        # What the step computed, from the batches' real shapes (not wall time, which a shared
        # machine blurs): the speed of cells whose steps differ in kind (decoder-only vs encoder-decoder).
        state["train_flops"] = state.get("train_flops", 0.0) + sum(
            batch_training_flops(self.model_cfg, tuple(b["src"].shape) if b.get("src") is not None else None,
                                 tuple(b["tgt_in"].shape)) for b in micro)
        state["processed_tokens"] = state.get("processed_tokens", 0) + sum(processed_tokens(b) for b in micro)
        parts = [shard(b, self.rank, self.world) for b in micro]
        step_tokens, loss_sum = sum(target_tokens(p) for p in parts), torch.zeros((), device=device)
        self.meter.start_step(parts)
        if self.graphs:  # a new training iteration: the graphs' output buffers of the last one are free
            torch.compiler.cudagraph_mark_step_begin()
        for part in parts:
            with autocast(device, t.precision):
                loss = sequence_loss(self.step_fn, batching.to_device(part, device), t.label_smoothing,
                                     loss_fn=self.loss_fn)
            # DDP averages gradients over ranks; scaling by `world` turns that into the sum, so the
            # gradient is that of the global batch's mean token loss, as in one process.
            (loss * self.world / total_tokens).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_norm or float("inf"))
        self.optimizer.step()
        state["step"] += 1
        state["train_tokens"] += step_tokens
        self.meter.end_step(state["step"], loss_sum, grad_norm, step_tokens)

    # --- the pieces the loop calls -------------------------------------------------------------

    def _told_to_stop(self, stop: preemption.StopWatch) -> str | None:
        """A signal or the job's time limit. Ranks of a multi-process run decide together, at the
        steps where they read their statistics anyway (no extra host sync)."""
        why = stop.reason()
        if self.world == 1:
            return why
        log = self.state["log"]
        if not (self.state["step"] == 0 or (log and log[-1]["step"] == self.state["step"])):
            return None
        import torch.distributed as dist
        flag = torch.tensor([1.0 if why else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return why or ("another rank was told to stop" if flag.item() else None)

    def save_for_later(self, why: str, requeue: bool) -> None:
        """Save the state at this step (after a read of the step statistics, which also keeps the
        NaN guard's promise that a saved state is a good one) and leave. Out of time inside a
        SLURM batch job, the job is requeued; a signal never requeues (it may be an `scancel`,
        and a preempting cluster requeues by itself: workflow/profiles/slurm asks it to)."""
        self.read_steps()
        self.state.setdefault("stops", []).append({"step": self.state["step"], "why": why})
        self.save_state()
        requeued = requeue and self.rank == 0 and preemption.requeue_slurm_job()
        then = "SLURM requeued the job, which continues from there" if requeued else "the same command continues it"
        raise preemption.SavedForLater(
            f"{self.name}: {why}: training state saved at step {self.state['step']} "
            f"({self.scratch / 'state.pt'}); {then}", requeued)

    def _batches(self):
        """Batches in training order from the saved data position; collated ahead in a thread (into
        pinned memory on CUDA) unless train.prefetch is false. Same batches either way."""
        t, state = self.t, self.state
        stream = batching.batch_stream(self.data.epoch_batches, self.data.train_batch, state["epoch"],
                                       state["batch_in_epoch"])
        if t.prefetch or (t.prefetch is None and self.device.type == "cuda"):
            stream = batching.Prefetcher(stream, depth=4, pin=self.device.type == "cuda")
        return stream

    def _tokens_spent(self) -> bool:
        budget = self.t.max_target_tokens
        return budget is not None and self.state.get("global_target_tokens", 0) >= budget

    def _budget_spent(self) -> str | None:
        t = self.t
        if self._tokens_spent():
            return "max_target_tokens"
        if t.max_epochs is not None and self.state["epoch"] >= t.max_epochs:
            return "max_epochs"
        if t.time_budget_s is not None and time.perf_counter() - self.started > t.time_budget_s:
            return "time_budget"
        return None

    def read_steps(self):
        """The steps since the last read (one host sync). A non-finite loss stops the run; the
        state on disk is older than it, because a save always comes right after a read."""
        steps, tokens_per_s = self.meter.read()
        bad = next((s_ for s_, loss_, _, _ in steps if not math.isfinite(loss_)), None)
        if bad is not None:
            raise NonFiniteLoss(
                bad,
                f"{self.name}: non-finite training loss at step {bad}; the last good state is kept in "
                f"{self.scratch / 'state.pt'} (lower lr or enable clipping)")
        return steps, tokens_per_s

    def log_row(self) -> dict:
        steps, tokens_per_s = self.read_steps()
        _, step_loss, grad_norm, step_tokens = steps[-1]
        return {"step": self.state["step"], "epoch": self.state["epoch"], "train_loss": step_loss / max(step_tokens, 1),
                "val_loss": "", "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s, "mem_mb": memory_mb(self.device)}

    def validate(self) -> float:
        with eager() if self.compiled else contextlib.nullcontext():
            return validation_loss(self.model, self.data, self.device, self.t.precision)

    def evaluate(self, row: dict) -> None:
        """Validation loss into the log row; the best weights kept; the weights to average kept;
        patience counted (an early stop is saved with the state, so a resumed run stops too)."""
        t, state, step = self.t, self.state, self.state["step"]
        val = self.validate()
        row["val_loss"] = val
        if val < state["best_val"]:
            state.update(best_val=val, best_step=step, bad_evals=0)
            if self.rank == 0:
                train_state.save(self.scratch / "best.pt", train_state.weights(self.model))
        else:
            state["bad_evals"] += 1
        if t.average_last:
            name = f"eval{step}.pt"
            if self.rank == 0:
                train_state.save(self.scratch / name, train_state.weights(self.model))
            state["averaged"] = (state["averaged"] + [name])[-t.average_last:]
        state["final_val"] = val
        if t.patience and state["bad_evals"] >= t.patience:
            state["stop_reason"] = "early_stopping"

    def save_state(self) -> None:
        if hasattr(self, "started"):  # the wall time so far, summed over the run's sittings
            self.state["wall_s"] = self.wall_before + time.perf_counter() - self.started
        if self.rank == 0:
            train_state.save_state(self.scratch, self.fingerprint, self.model, self.optimizer, self.state)

    def evaluate_if_never_evaluated(self) -> None:
        """A run stopped by a budget before its first evaluation is evaluated once at the end."""
        state = self.state
        if "final_val" in state:
            return
        state["final_val"] = self.validate()
        if state["final_val"] < state["best_val"]:
            state.update(best_val=state["final_val"], best_step=state["step"])
            train_state.save(self.scratch / "best.pt", train_state.weights(self.model))


# ---------------------------------------------------------------------------------------------
# Model and schedule


class NonFiniteLoss(StageError):
    """The training loss became NaN or infinite (a trial of the tune stage records it as failed)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def tuned(study: Study, task: str, cell_name: str) -> CellConfig:
    """The cell's settings, its peak lr taken from the tune stage when it has an lr grid."""
    cell = study.cell(task, cell_name)
    if not cell.train.lr_grid:
        return cell
    path = tune_record(study, task, cell_name)
    if not path.is_file():
        raise StageError(f"{path}: missing; run `python -m pipeline_src tune --params {study.path} --task {task} "
                         f"--cell {cell_name}` first (the cell's lr is chosen from train.lr_grid)")
    with reading(path):
        lr = float(json.loads(path.read_text())["chosen_lr"])
    return dataclasses.replace(cell, train=dataclasses.replace(cell.train, lr=lr))


def data_seed(seed: int, data_order: int) -> int:
    """The seed of the batch order: the run's own, or for data_order k > 0 one that no plain
    seed below 2^20 has."""
    return seed if data_order == 0 else (data_order << 20) + seed


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


def target_tokens(batch: dict) -> int:
    """Loss-bearing tokens of a batch. Call it on the host copy: on a GPU tensor it would stall
    the CPU until the queued work is done."""
    return int((batch["tgt_out"] != PAD).sum())


def processed_tokens(batch: dict) -> int:
    """Source and target tokens (not padding) that went into the model: a decoder-only batch
    holds both in one sequence, an encoder-decoder batch in two."""
    src = batch.get("src")
    return int((batch["tgt_in"] != PAD).sum()) + (int((src != PAD).sum()) if src is not None else 0)


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

    def _targets(self, split: str) -> np.ndarray:
        """Every token the loss predicts on a split, once (a target sequence and its EOS)."""
        if self.cell.kind == "lm":
            stream = self.train_stream if split == "train" else self.val_stream
            return stream[1:]
        data = self.train if split == "train" else self.val
        return np.concatenate([np.append(t, EOS) for t in data.tgt]) if len(data) else np.zeros(0, np.int64)

    def tokens_per_epoch(self) -> int:
        return int(len(self._targets("train")))

    def unigram_val_loss(self, vocab_size: int) -> float:
        """Validation loss (nats per target token) of the unigram distribution of the training
        targets (add-one smoothed): what a model that learned nothing about context reaches. A
        run whose validation loss stays near it did not train."""
        counts = np.bincount(self._targets("train"), minlength=vocab_size).astype(np.float64) + 1.0
        val = self._targets("validation")
        if not len(val):
            return float("nan")
        return float(-np.log(counts[val] / counts.sum()).mean())


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
