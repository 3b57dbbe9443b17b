"""Training-step bookkeeping that keeps the GPU busy: nothing here reads a device value per step.

A step's loss and gradient norm stay on the device until `read()` (every `log_every` steps and
before every evaluation/save): one host-device sync returns the values of all pending steps,
in order, so the log and the NaN guard still see every step. Timing is taken between reads
(after a sync), so it covers whole steps including data and logging, and excludes evaluation.
The first step of every new batch shape is timed on its own (compile warm-up).
"""
from __future__ import annotations

import time

import torch


class StepMeter:
    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []  # step, loss, grad norm, tokens
        self.timed_tokens, self.timed_s = 0, 0.0
        self.pad_slots, self.all_slots = 0, 0
        self.shapes: set = set()
        self.warmup_s = 0.0
        self._window_start = time.perf_counter()
        self._window_tokens = 0
        self._warmup_tick: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self, batches: list[dict]) -> None:
        """Count padding; a shape not seen before starts a timed warm-up step (two syncs, once
        per shape)."""
        from .batching import pad_slots
        for batch in batches:
            pad, slots = pad_slots(batch)
            self.pad_slots, self.all_slots = self.pad_slots + pad, self.all_slots + slots
        shape = tuple(tuple(t.shape) for b in batches for t in (b["src"], b["tgt_in"]) if t is not None)
        if shape not in self.shapes:
            self.shapes.add(shape)
            self._sync()
            self._warmup_tick = time.perf_counter()

    def end_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int) -> None:
        self.pending.append((step, loss.detach(), grad_norm.detach(), tokens))
        self._window_tokens += tokens
        if self._warmup_tick is not None:
            self._sync()
            self.warmup_s += time.perf_counter() - self._warmup_tick
            self._warmup_tick = None

    def read(self) -> tuple[list[tuple[int, float, float, int]], float]:
        """(pending steps as (step, summed loss, grad norm, target tokens), tokens/s since the
        last read). The one host-device sync of the window."""
        if not self.pending:
            return [], 0.0
        values = torch.stack([torch.stack((loss.float(), norm.float())) for _, loss, norm, _ in self.pending]).tolist()
        self._sync()
        elapsed = time.perf_counter() - self._window_start
        rows = [(step, v[0], v[1], tokens) for (step, _, _, tokens), v in zip(self.pending, values)]
        rate = self._window_tokens / max(elapsed, 1e-9)
        self.timed_tokens, self.timed_s = self.timed_tokens + self._window_tokens, self.timed_s + elapsed
        self.pending, self._window_tokens = [], 0
        self._window_start = time.perf_counter()
        return rows, rate

    def restart_clock(self) -> None:
        """After an evaluation: its time is not training time."""
        self._window_start = time.perf_counter()

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / max(self.timed_s, 1e-9)

    @property
    def pad_fraction(self) -> float | None:
        return self.pad_slots / self.all_slots if self.all_slots else None
