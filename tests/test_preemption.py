"""A training job told to stop (SIGTERM, SIGUSR1) or out of time saves the step under way and
exits 75; the same command continues it to the weights and metrics of a run never stopped."""
import datetime
import json
import random
import re
import subprocess
import time

import pytest
import torch

from pipeline_src.train import preemption
from test_train import _clear, _env, _outputs, _prepare_data, _train_cmd, _weights, _write_params

# serial: signals at random moments and a 5-second job budget (Makefile `test` runs these alone)
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def signal_dir(tmp_path_factory):
    """The tiny study's data, with one evaluation only (at the end): a state saved before it can
    only come from a stop, and would once have lost every step."""
    d = tmp_path_factory.mktemp("preempt")
    _prepare_data(d, _write_params(d, "signal.yaml", max_steps=400, eval_every=400, log_every=10))
    return d


def _reference(d, params="signal.yaml"):
    metrics, ckpt, _ = _outputs(d)
    _clear(d)
    subprocess.run(_train_cmd(params), cwd=d, env=_env(), check=True, capture_output=True)
    return metrics.read_bytes(), _weights(ckpt)


def _start_and_wait_for_the_loop(d, env):
    """The run, once its progress bar (made just before the loop) has appeared on stderr."""
    proc = subprocess.Popen(_train_cmd("signal.yaml"), cwd=d, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    seen = b""
    while b"train reorder/baseline/seed0" not in seen:
        byte = proc.stderr.read(1)
        assert byte, f"the run ended before its loop began: {seen[-500:]!r}"
        seen += byte
    return proc


@pytest.fixture(scope="module")
def uninterrupted(signal_dir):
    """The run never stopped, made once for both signals: its metrics and weights, and how long
    its loop, final writes and exit take (from its progress bar's appearance on)."""
    d = signal_dir
    metrics, ckpt, _ = _outputs(d)
    _clear(d)
    proc = _start_and_wait_for_the_loop(d, _env(PIPELINE_QUIET="0"))
    started = time.perf_counter()
    proc.communicate()
    loop_s = time.perf_counter() - started
    assert proc.returncode == 0
    made = metrics.read_bytes(), _weights(ckpt), loop_s
    _clear(d)
    return made


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_saves_the_step_under_way_and_the_same_command_continues_identically(signal_dir, uninterrupted,
                                                                                          sig):
    d = signal_dir
    metrics, ckpt, scratch = _outputs(d)
    reference_metrics, reference_weights, loop_s = uninterrupted
    _clear(d)
    env = _env(PIPELINE_QUIET="0")

    saved_steps = []
    for attempt in range(12):
        proc = _start_and_wait_for_the_loop(d, env)
        time.sleep(random.uniform(0.0, 0.6) * loop_s)
        signum = getattr(__import__("signal"), sig)
        proc.send_signal(signum)
        err = proc.stderr.read().decode()
        code = proc.wait()
        if code in (0, -signum):  # the signal came after the loop (default action: killed) or the end
            _clear(d)
            saved_steps = []
            continue
        assert code == preemption.EXIT_SAVED, err[-2000:]
        line = [l for l in err.splitlines() if l.startswith("stopped:")]
        assert len(line) == 1 and f"{sig} received" in line[0] and "the same command continues it" in line[0], err
        saved = int(re.search(r"saved at step (\d+)", line[0])[1])
        assert saved > (saved_steps[-1] if saved_steps else 0)  # every stop kept the steps it had made
        state = torch.load(scratch / "state.pt", map_location="cpu", weights_only=False)
        assert state["state"]["step"] == saved and not metrics.exists()
        saved_steps.append(saved)
        if len(saved_steps) == 2:
            break
    if not metrics.exists():
        subprocess.run(_train_cmd("signal.yaml"), cwd=d, env=_env(), check=True, capture_output=True)
    assert len(saved_steps) == 2 and all(0 < s < 400 for s in saved_steps)
    assert metrics.read_bytes() == reference_metrics
    weights = _weights(ckpt)
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)


def test_a_job_budget_ends_each_run_before_it_and_the_runs_add_up_to_the_uninterrupted_one(signal_dir):
    """PIPELINE_MAX_JOB_MINUTES: each run leaves in time with its state saved (exit 75), and
    repeating the command (what a requeued cluster job does) finishes the training."""
    d = signal_dir
    params = _write_params(d, "budget.yaml", max_steps=500, eval_every=100, log_every=10)  # ~10 s of training
    metrics, ckpt, _ = _outputs(d)
    started = time.perf_counter()
    reference_metrics, reference_weights = _reference(d, params)
    # 5 s a run, or a third of the uninterrupted run where that is longer: on a slow machine a
    # run's start-up (Python, torch, the data) takes much of 5 s, and the runs would add up only
    # after dozens of restarts (with a quarter this test took 35 s and 77 s in two emulated CI runs).
    budget_s = max(5.0, (time.perf_counter() - started) / 3)
    _clear(d)
    runs, saved_at = [], 0
    while not metrics.exists():
        started = time.perf_counter()
        proc = subprocess.run(_train_cmd(params), cwd=d, capture_output=True, text=True,
                              env=_env(PIPELINE_MAX_JOB_MINUTES=str(budget_s / 60), PIPELINE_CPU_THREADS="1"))
        runs.append((proc.returncode, time.perf_counter() - started, budget_s))
        assert proc.returncode in (0, preemption.EXIT_SAVED), proc.stderr[-2000:]
        if proc.returncode:
            assert "the job's time is nearly up" in proc.stderr
            step = int(re.search(r"training state saved at step (\d+)", proc.stderr)[1])
            assert step > saved_at  # every run moves forward, by one step at least
            # Where start-up and the safety margin (1.5 x the slowest turn + 2 s) take nearly all of
            # the budget, as on a slow or busy machine, a run makes a few steps only: the next run
            # gets half as much again, as a requeued job would get a longer limit.
            if step - saved_at < 25:
                budget_s *= 1.5
            saved_at = step
        assert len(runs) < 40
    assert len(runs) >= 2 and all(code == preemption.EXIT_SAVED for code, _, _ in runs[:-1])
    assert all(took < budget + 1.0 for _, took, budget in runs[:-1])  # left before its budget, with the save
    assert metrics.read_bytes() == reference_metrics
    weights = _weights(ckpt)
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
    # the run's wall time sums its sittings (each up to its saved state), not the last one's alone
    cost = json.loads(metrics.with_name("cost.json").read_text())
    last = (datetime.datetime.fromisoformat(cost["end_utc"]) - datetime.datetime.fromisoformat(cost["start_utc"]))
    assert cost["wall_s"] > last.total_seconds() + 0.5, (cost["wall_s"], last, runs)


@pytest.mark.parametrize("text,seconds", [("5:07", 307), ("1:00:00", 3600), ("2-03:04:05", 2 * 86400 + 11045),
                                          ("0:30", 30), ("UNLIMITED", None), ("NOT_SET", None), ("", None),
                                          ("INVALID", None)])
def test_slurm_durations(text, seconds):
    assert preemption.parse_slurm_duration(text) == seconds


def test_outside_slurm_there_is_no_limit_and_nothing_to_requeue():
    assert preemption.slurm_time_left_s({}) is None
    assert preemption.requeue_slurm_job({}) is False
    assert preemption.requeue_slurm_job({"SLURM_JOB_ID": "7", "PIPELINE_REQUEUE": "0"}) is False
    stop = preemption.StopWatch({})
    try:
        assert stop.deadline is None and stop.reason() is None
    finally:
        stop.close()


def test_a_bad_job_budget_is_one_line_naming_the_variable():
    from pipeline_src.common import StageError
    with pytest.raises(StageError, match="PIPELINE_MAX_JOB_MINUTES='ten'"):
        preemption.StopWatch({"PIPELINE_MAX_JOB_MINUTES": "ten"})
