"""What a training run keeps on disk while it runs, so that a restarted run continues exactly.

The scratch directory of a run (stages.SCRATCH) holds `state.pt` (model, optimiser, every RNG,
the data position and the loop's bookkeeping, written after every evaluation), `best.pt` (the
weights with the best validation loss so far) and, with train.average_last, `eval<step>.pt`.
Every file is written through a temporary name and a rename, so a kill never leaves a torn one.
A state is resumed only by the run that wrote it: its fingerprint is the hash of the params the
run reads, the state format and the optimiser's implementation.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..common import atomic_file, reading

STATE_FORMAT = 2  # 2: optimiser per device (pipeline_src/train/optim.py), no scheduler state


def new_state() -> dict:
    """The loop's bookkeeping at step 0 (saved with the weights; plain Python values)."""
    return {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_val": float("inf"), "best_step": 0, "bad_evals": 0,
            "log": [], "train_tokens": 0, "averaged": []}


def fingerprint(study, task: str, cell_name: str, optimizer) -> str:
    """Identifies the run a saved state belongs to (CPU and CUDA optimisers differ)."""
    params = study.section_hash(f"tasks.{task}.model", f"tasks.{task}.train", study.cell_key(cell_name))
    return f"{params}/{STATE_FORMAT}/{type(optimizer).__module__}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, obj) -> None:
    """torch.save through a temporary file + rename: a kill never leaves a torn checkpoint, and a
    full or read-only disk is one line naming the file (common.atomic_file), however torch words it."""
    with atomic_file(path, lambda: serialized_size(obj)) as f:
        torch.save(obj, f)


def load(path: Path):
    # RNG states hold numpy arrays and tuples, which the weights-only unpickler refuses;
    # this file is our own scratch state, never a downloaded checkpoint.
    with reading(path):
        return torch.load(path, map_location="cpu", weights_only=False)


def serialized_size(obj) -> int:
    """The bytes torch.save writes for `obj` (counted, not stored: asked only when a save failed)."""
    counter = _Counter()
    torch.save(obj, counter)
    return counter.n


class _Counter:
    n = 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.n += size
        return size

    def flush(self) -> None:
        pass


def weights(model) -> dict:
    """A CPU copy of the model's parameters and buffers."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def average(states: list[dict]) -> dict:
    return {k: sum(s[k].float() for s in states) / len(states) if states[0][k].is_floating_point() else states[-1][k]
            for k in states[0]}


def resume(scratch: Path, fingerprint_: str, model, optimizer) -> dict | None:
    """The saved loop state, with model, optimiser and RNGs restored from it; None when there is
    nothing to resume. A state written by other params is deleted with its scratch directory."""
    state_path = scratch / "state.pt"
    resumed = None
    if state_path.exists():
        saved = load(state_path)
        if saved.get("fingerprint") == fingerprint_:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            set_rng_state(saved["rng"])
            resumed = saved["state"]
        else:  # params changed since that state was written: it belongs to another run
            shutil.rmtree(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    return resumed


def save_state(scratch: Path, fingerprint_: str, model, optimizer, state: dict) -> None:
    save(scratch / "state.pt", {"fingerprint": fingerprint_, "model": model.state_dict(),
                                "optimizer": optimizer.state_dict(), "rng": rng_state(), "state": state})
