"""One pending re-scheduling timer in Snakemake's scheduler instead of one per finished job.

Snakemake 9's job scheduler (snakemake/scheduling/job_scheduler.py) always has a job-rate limiter
(`--max-jobs-per-timespan`, default 100/1s), and every round of job selection ends by starting a
`threading.Timer` that wakes the scheduler again one timespan later. A round also starts whenever
a job finishes, and that round starts a timer of its own: the timers form chains that never stop,
one more per finished job. After N jobs the scheduler runs N rounds a second, each checking the
inputs of every waiting job. In the demo study (126 jobs, ~100 s) that was 4,675 rounds (201 with
one timer) and ~11 s of CPU (176.6 s against 165.3 s for the whole run), taken from the training
jobs beside it on a 2-core machine; in a study of hours it grows with the run's length. The
timers are also not daemon threads, so Snakemake waits for the last ones (up to a timespan)
before it exits.

`coalesce_reevaluation_timers()` (called from workflow/rules/common.smk) makes the scheduler keep
at most one such timer, as a daemon thread. A round still follows every finished job and at least
one every timespan while the run lasts, which is all the rate limiter needs: its waiting jobs are
reconsidered when their slot frees. Nothing else of Snakemake changes; a Snakemake without this
method (another version) is left as it is.
"""
from __future__ import annotations

import threading


def coalesce_reevaluation_timers() -> bool:
    """Patch Snakemake's JobScheduler as above; True if it was patched (now or before)."""
    try:
        from snakemake.scheduling.job_scheduler import JobScheduler
    except ImportError:
        return False
    original = getattr(JobScheduler, "_schedule_reevalutation", None)  # sic: Snakemake's spelling
    if original is None:
        return False
    if getattr(original, "coalesced", False):
        return True

    def _schedule_reevalutation(self, delay) -> None:
        semaphore = getattr(self, "_open_jobs", None)
        if semaphore is None:  # not the scheduler this was written for
            return original(self, delay)
        guard = self.__dict__.setdefault("_reevaluation_guard", threading.Lock())
        with guard:
            pending = self.__dict__.get("_reevaluation_timer")
            if pending is not None and pending.is_alive():
                return  # that one wakes the scheduler no later than this one would

            def wake() -> None:
                with guard:
                    self._reevaluation_timer = None
                semaphore.release()

            timer = threading.Timer(delay, wake)
            timer.daemon = True
            self._reevaluation_timer = timer
            timer.start()

    _schedule_reevalutation.coalesced = True
    JobScheduler._schedule_reevalutation = _schedule_reevalutation
    return True
