"""Snakemake's scheduler keeps one re-scheduling timer, not one more per finished job
(pipeline_src/runtime/scheduler_timers.py), and the workflow turns this on."""
import threading
import time
from pathlib import Path

from snakemake.scheduling.job_scheduler import JobScheduler

from pipeline_src.runtime.scheduler_timers import coalesce_reevaluation_timers

ROOT = Path(__file__).resolve().parent.parent


def test_many_requests_while_one_timer_is_pending_wake_the_scheduler_once():
    assert coalesce_reevaluation_timers() and coalesce_reevaluation_timers()  # idempotent
    scheduler = object.__new__(JobScheduler)  # only the timer's state is used
    scheduler._open_jobs = threading.Semaphore(0)
    before = threading.active_count()
    for _ in range(5):  # five rounds ended (five finished jobs) within one timespan
        scheduler._schedule_reevalutation(0.2)
    assert threading.active_count() == before + 1  # one timer, not five
    assert scheduler._reevaluation_timer.daemon  # Snakemake does not wait for it to exit
    assert scheduler._open_jobs.acquire(timeout=10)  # it woke the scheduler ...
    time.sleep(0.5)
    assert not scheduler._open_jobs.acquire(blocking=False)  # ... once
    scheduler._schedule_reevalutation(0.05)  # the next round after it gets a timer again
    assert scheduler._open_jobs.acquire(timeout=10)


def test_the_workflow_coalesces_the_timers_of_its_main_process():
    text = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    main_process = text[text.index("if workflow.is_main_process:"):text.index("REPORT_PDF =")]
    assert "coalesce_reevaluation_timers()" in main_process
