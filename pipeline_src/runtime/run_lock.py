"""Let the same command resume a study after a crash, while two live runs stay refused.

Snakemake locks a working directory with plain files (`.snakemake/locks/N.{input,output}.lock`,
each listing the paths a run reads or writes) and deletes them when it exits. A run killed with
SIGKILL (power loss, OOM killer, a lost cluster head node) cannot delete them, and every later run
then refuses to start until someone types `snakemake --unlock`.

A lock file cannot tell a live run from a dead one, a kernel lock can: each Snakemake run of a
study holds an exclusive `flock` on `.snakemake/pipeline-<study>.run` for its lifetime, and the
kernel drops it when the process dies, however it dies. A run that gets the flock therefore knows
that no run of its study is alive, so Snakemake lock files naming the study's paths are stale and
it removes them; a run that does not get it leaves them alone, and Snakemake refuses the second
run as before. Incomplete outputs of the dead run are redone by `rerun-incomplete`
(profiles/default/config.yaml and the profiles in workflow/profiles/).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..common import writing

_held = []  # the open flock handle; referenced so that the lock lives as long as the process


def study_prefixes(study: str) -> tuple[str, ...]:
    """Path prefixes that only this study's jobs write (see stages.OUTPUTS)."""
    return (f"data/{study}/", f"reports/{study}/", f"logs/{study}/")


def claim_run(study: str, workdir: str | os.PathLike = ".") -> list[Path]:
    """Take the study's run flock; if no live run holds it, delete the study's stale Snakemake
    lock files and return them. Returns [] when another live run holds the flock."""
    snakedir = Path(workdir) / ".snakemake"
    run_file = snakedir / f"pipeline-{study}.run"
    with writing(run_file):  # a full or read-only disk: one line (a StageError), before any job starts
        snakedir.mkdir(exist_ok=True)
        handle = open(run_file, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return []  # a live run of this study: its locks are real
    _held.append(handle)
    removed = []
    prefixes = study_prefixes(study)
    for lock in sorted((snakedir / "locks").glob("*.lock")):
        try:
            paths = lock.read_text().split()
        except FileNotFoundError:
            continue
        if any(p.startswith(prefixes) for p in paths):
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed
