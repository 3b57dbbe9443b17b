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

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

from ..common import StageError, atomic_write_text, write_error, writing

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
    per logged step, closed when the loop ends. Only rank 0 of a multi-process run writes.

    A full or read-only disk under either file is one line naming it (common.writing), and the
    row it could not write is cut off again: the files end with the last whole row."""

    def __init__(self, tsv_path: Path, rows: list[dict], enabled: bool = True):
        self.enabled = enabled
        self.writer = None
        self.failed = False  # a write was refused: close() must not raise it a second time
        if not enabled:
            return
        self.tsv_path = tsv_path
        atomic_write_text(tsv_path, log_tsv(rows))  # a resumed run's rows, none from after its state
        with writing(tsv_path):
            self.tsv = open(tsv_path, "ab", buffering=0)  # unbuffered: a failed row leaves nothing to flush later
        if os.environ.get("PIPELINE_TENSORBOARD", "1") != "0":
            from torch.utils.tensorboard import SummaryWriter

            events = tsv_path.parent / "tensorboard"
            if not rows:  # a fresh start: whatever an earlier attempt logged is void
                shutil.rmtree(events, ignore_errors=True)
            _quiet_event_writer_threads()
            try:
                self.writer = SummaryWriter(str(events), purge_step=rows[-1]["step"] + 1 if rows else None,
                                            flush_secs=10)
                self.writer.flush()
            except Exception as e:  # noqa: BLE001 - see common.writing
                line = write_error(_own_event_file(events), e, lambda: _events_size({}, 0))
                if line is None:
                    raise
                with contextlib.suppress(OSError):  # the empty file it began, if it got that far
                    _own_event_file(events).unlink(missing_ok=True)
                self.tsv.close()
                raise line from e
            self.events = _own_event_file(events)

    def add(self, row: dict) -> None:
        if not self.enabled:
            return
        line = _line(row).encode("utf-8")
        end = os.fstat(self.tsv.fileno()).st_size
        try:
            with writing(self.tsv_path, len(line)):
                view = memoryview(line)
                while view:
                    view = view[self.tsv.write(view):]
        except StageError:
            self.failed = True
            os.ftruncate(self.tsv.fileno(), end)
            raise
        if self.writer is None:
            return
        scalars = {tag: float(row[column]) for column, tag in SCALARS.items() if row.get(column) not in ("", None)}
        end = self.events.stat().st_size if self.events.is_file() else None
        try:
            # flushed at every row: a failed write surfaces here, in the training thread, not in
            # TensorBoard's writer thread after the run has moved on
            with writing(self.events, lambda: _events_size(scalars, row["step"])):
                for tag, value in scalars.items():
                    self.writer.add_scalar(tag, value, row["step"])
                self.writer.flush()
        except StageError:
            self.failed = True
            if end is not None:
                os.truncate(self.events, end)
            raise

    def close(self) -> None:
        if not self.enabled:
            return
        self.tsv.close()
        if self.writer is None:
            return
        if self.failed:  # its writer thread is gone with the error already said
            with contextlib.suppress(Exception):
                self.writer.close()
            return
        with writing(self.events):
            self.writer.close()


def _own_event_file(events: Path) -> Path:
    """This process's event file (a resumed run adds one beside the interrupted run's)."""
    mine = sorted(events.glob(f"events.out.tfevents.*.{os.getpid()}.*"), key=os.path.getmtime)
    return mine[-1] if mine else events / "events.out.tfevents"


def _events_size(scalars: dict, step: int) -> int:
    """The bytes TensorBoard writes for one row: a record (12-byte header, 4-byte CRC) per scalar;
    with no scalars, the record that opens a new file."""
    from tensorboard.compat.proto.event_pb2 import Event
    from torch.utils.tensorboard.summary import scalar

    events = [Event(wall_time=time.time(), step=step, summary=scalar(tag, value)) for tag, value in scalars.items()]
    return sum(len(e.SerializeToString()) + 16 for e in events or [Event(wall_time=time.time(), file_version="brain.Event:2")])


def _quiet_event_writer_threads() -> None:
    """TensorBoard writes its event files in a thread of its own. When the disk refuses a write,
    that thread prints a traceback and dies, and the next flush raises the same error in the
    training thread, which says it in one line: the thread's traceback would only repeat it."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writer", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook.quiets_event_writer = True
    threading.excepthook = hook
