"""Stopping a training job on purpose, and continuing it later from the very same step.

A training job stops early when it is told to (SIGTERM: what `kill`, `scancel` and a cluster's
preemption send; SIGUSR1: what `sbatch --signal` is usually set to) or when its time is nearly
up: PIPELINE_MAX_JOB_MINUTES, or the time limit of the SLURM job it runs in (read once at start
with squeue). Either way the loop finishes the step under way, saves the whole training state
(train_state.save_state) and the stage exits with EXIT_SAVED. Run again, the same command
continues from that step, with the weights and metrics of a run that was never stopped.

Out of time inside a SLURM batch job, the stage also asks SLURM to requeue the job (`scontrol
requeue`), so a training longer than the partition's time limit goes on in the next allocation by
itself (PIPELINE_REQUEUE=0 turns that off). A signal never requeues: it may be the user's own
`scancel`; a cluster that preempts requeues the job itself when it was submitted with --requeue
(workflow/profiles/slurm sets the executor's `requeue`). The job budget lives in the environment,
not the params file, because it says where a run executes, not what it computes: changing it
re-runs nothing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

EXIT_SAVED = 75  # sysexits' EX_TEMPFAIL: stopped with everything saved; run the same command again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PROCESS_START = time.perf_counter()  # a job budget counts from here (imported first by __main__)
SLURM_MARGIN_S = 30.0  # before a SLURM time limit: saving, requeueing and the controller's own slack


class SavedForLater(Exception):
    """Raised by the training loop once its state is saved; the stage exits with EXIT_SAVED."""

    def __init__(self, message: str, requeued: bool):
        super().__init__(message)
        self.requeued = requeued


class StopWatch:
    """Why the training loop should stop now (a signal, or too little time left for one more
    turn of the loop), or None. Its signal handlers are in place from creation until close()."""

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        deadlines = []
        if environ.get("PIPELINE_MAX_JOB_MINUTES"):
            deadlines.append(PROCESS_START + _minutes(environ["PIPELINE_MAX_JOB_MINUTES"]) * 60)
        slurm_left = slurm_time_left_s(environ)
        if slurm_left is not None:
            deadlines.append(time.perf_counter() + slurm_left - SLURM_MARGIN_S)
        self.deadline = min(deadlines, default=None)
        self.signal: str | None = None
        self.out_of_time = False
        self._previous: dict = {}
        self._last_call: float | None = None
        self._slowest_turn_s: float | None = None  # the longest time between two calls of reason()
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def close(self) -> None:
        """Put back the signal handlers there were before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _note(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name  # acted on after the step under way

    def reason(self) -> str | None:
        """Called once per turn of the training loop, before its step. The next turn is assumed to
        take up to 1.5 x the slowest turn of this run so far (evaluations, warm-up and, on a GPU,
        the host's waits for the device at log reads included) plus 2 s."""
        now = time.perf_counter()
        if self._last_call is not None:
            self._slowest_turn_s = max(self._slowest_turn_s or 0.0, now - self._last_call)
        self._last_call = now
        if self.signal:
            return f"{self.signal} received"
        # at least one step per run, whatever its set-up took: a run must move forward
        self.out_of_time = (self.deadline is not None and self._slowest_turn_s is not None
                            and now + 1.5 * self._slowest_turn_s + 2.0 > self.deadline)
        return "the job's time is nearly up" if self.out_of_time else None


def _minutes(text: str) -> float:
    try:
        minutes = float(text)
    except ValueError:
        minutes = -1.0
    if not minutes > 0:
        from ..common import StageError
        raise StageError(f"PIPELINE_MAX_JOB_MINUTES={text!r}: expected a positive number of minutes")
    return minutes


def slurm_time_left_s(environ=None) -> float | None:
    """Seconds left before this SLURM job's time limit (squeue's %L), None outside SLURM or
    when the job has no limit."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_slurm_duration(out)


def parse_slurm_duration(text: str) -> float | None:
    """SLURM's [days-]hours:minutes:seconds (or minutes:seconds) in seconds; None for UNLIMITED,
    NOT_SET, INVALID or anything else."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not (1 <= len(parts) <= 3) or not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        return None
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + int(days or 0) * 86400


def requeue_slurm_job(environ=None) -> bool:
    """Ask SLURM to put this batch job back in the queue (it is then stopped and started again
    from the top, keeping its job id). False outside a batch job, with PIPELINE_REQUEUE=0, or if
    SLURM refuses (a job submitted with --no-requeue)."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job or environ.get("PIPELINE_REQUEUE", "1") == "0":
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
