"""A training run's curves while it trains, for every run of a study at once.

Every logged step (train.log_every, and each evaluation) goes at once to
  train_log.tsv    one row per logged step (the stage's output, complete when the run ends), and
  tensorboard/     TensorBoard event files beside it: loss/train, loss/validation, lr, grad_norm,
                   tokens_per_s. `tensorboard --logdir data/<study>/runs` shows every cell and
                   seed of a study side by side, live, each run named task/cell/seedN.
A resumed run rewrites the TSV from its saved log and tells TensorBoard to drop what the
interrupted run logged after that point (purge_step), so neither shows a step twice.
PIPELINE_TENSORBOARD=0 turns the event files off. Nothing here feeds back into training: the
metrics are the same bytes either way.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .common import atomic_write_text

LOG_COLUMNS = ["step", "epoch", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_mb"]
SCALARS = {"train_loss": "loss/train", "val_loss": "loss/validation", "lr": "lr", "grad_norm": "grad_norm",
           "tokens_per_s": "tokens_per_s"}


def log_tsv(rows: list[dict]) -> str:
    return "\t".join(LOG_COLUMNS) + "\n" + "".join(_line(r) for r in rows)


def _line(row: dict) -> str:
    return "\t".join(_fmt(row.get(c, "")) for c in LOG_COLUMNS) + "\n"


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


class LiveLog:
    """Opened when a run's loop starts (with the rows a resumed run already has), fed one row
    per logged step, closed when the loop ends. Only rank 0 of a multi-process run writes."""

    def __init__(self, tsv_path: Path, rows: list[dict], enabled: bool = True):
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        atomic_write_text(tsv_path, log_tsv(rows))  # a resumed run's rows, none from after its state
        self.tsv = open(tsv_path, "a", encoding="utf-8")
        if os.environ.get("PIPELINE_TENSORBOARD", "1") != "0":
            from torch.utils.tensorboard import SummaryWriter

            events = tsv_path.parent / "tensorboard"
            if not rows:  # a fresh start: whatever an earlier attempt logged is void
                shutil.rmtree(events, ignore_errors=True)
            self.writer = SummaryWriter(str(events), purge_step=rows[-1]["step"] + 1 if rows else None,
                                        flush_secs=10)

    def add(self, row: dict) -> None:
        if not self.enabled:
            return
        self.tsv.write(_line(row))
        self.tsv.flush()
        if self.writer is not None:
            for column, tag in SCALARS.items():
                if row.get(column) not in ("", None):
                    self.writer.add_scalar(tag, float(row[column]), row["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self.tsv.close()
        if self.writer is not None:
            self.writer.close()
