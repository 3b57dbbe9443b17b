"""Give each concurrent job a GPU of its own.

Snakemake's `--resources gpu=N` caps how many GPU jobs run at once but cannot tell a job *which*
GPU to use (snakemake/snakemake#281), so N jobs would all start on cuda:0. Each job therefore
claims a free GPU itself: it takes an exclusive, non-blocking `flock` on one lock file per GPU
and keeps it for its lifetime. The kernel drops the lock when the process exits, even on
SIGKILL, so a crashed job never leaves a GPU claimed.

If the scheduler already chose (CUDA_VISIBLE_DEVICES set by SLURM or by hand), that choice is
respected: the job claims among the GPUs it can see.

Several jobs per GPU: a small task's cell cannot fill a large GPU alone, so
PIPELINE_JOBS_PER_GPU=K gives every GPU K slots (one lock file each); run Snakemake with
`--resources gpu=<GPUs x K>`. Jobs spread over the GPUs first (slot 0 of every GPU, then slot 1,
...), so K only matters once every GPU is busy.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

_held = []  # open lock files; kept referenced so the locks live as long as the process


def lock_dir() -> Path:
    path = Path(os.environ.get("PIPELINE_GPU_LOCK_DIR", Path(tempfile.gettempdir()) / "pipeline_gpu_slots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _visible_key(index: int) -> str:
    """A lock name that identifies the physical GPU, so jobs with different
    CUDA_VISIBLE_DEVICES settings still exclude each other."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(ids):
            return ids[index]
    return str(index)


def jobs_per_gpu() -> int:
    """K from PIPELINE_JOBS_PER_GPU (default 1)."""
    raw = os.environ.get("PIPELINE_JOBS_PER_GPU", "1")
    if not raw.isdigit() or int(raw) < 1:
        from ..common import StageError
        raise StageError(f"PIPELINE_JOBS_PER_GPU={raw!r}: must be an integer >= 1")
    return int(raw)


def claim_gpu(n_gpus: int | None = None, wait_s: float = 3600.0, poll_s: float = 2.0) -> int:
    """Index (as torch sees it) of a GPU with a slot no other job holds; waits while all are taken."""
    if n_gpus is None:
        import torch
        n_gpus = torch.cuda.device_count()
    per_gpu = jobs_per_gpu()
    if n_gpus <= 1:  # nothing to choose: Snakemake's --resources gpu=K already caps the jobs
        return 0
    deadline = time.monotonic() + wait_s
    while True:
        for slot in range(per_gpu):
            for index in range(n_gpus):
                name = f"gpu{_visible_key(index)}.lock" if slot == 0 else f"gpu{_visible_key(index)}.slot{slot}.lock"
                handle = open(lock_dir() / name, "a+")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                handle.seek(0)
                handle.truncate()
                handle.write(f"{os.getpid()}\n")
                handle.flush()
                _held.append(handle)
                return index
        if time.monotonic() > deadline:
            raise TimeoutError(f"no free GPU among {n_gpus} (x {per_gpu} jobs each) after {wait_s:.0f} s "
                               f"(locks in {lock_dir()})")
        time.sleep(poll_s)


def select_device(study):
    """The torch device a job of `study` runs on: a free GPU slot, or the CPU at PIPELINE_CPU_THREADS threads."""
    import torch

    from ..common import StageError

    want = study.device
    if want == "cuda" and not torch.cuda.is_available():
        raise StageError("device: cuda requested in the params file but torch sees no CUDA device")
    if want in ("auto", "cuda") and torch.cuda.is_available():
        if "LOCAL_RANK" in os.environ:  # torchrun: one process per GPU, chosen by torchrun
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", claim_gpu())
    torch.set_num_threads(int(os.environ.get("PIPELINE_CPU_THREADS", "1")))
    return torch.device("cpu")
