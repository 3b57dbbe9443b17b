"""A study whose whole run (Snakemake and its jobs) is killed with SIGKILL is resumed by the very
same command, while a second live run on the same directory is still refused
(pipeline_src/runtime/run_lock.py, profiles/default/config.yaml). Real Snakemake on the tiny study."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from project_copy import copy_project

from pipeline_src.runtime.run_lock import claim_run

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml"
BIN = Path(sys.executable).parent
PARAMS = "workflow/studies/tiny/params.yaml"
CMD = [str(BIN / "snakemake"), "--cores", "2", "--config", f"params={PARAMS}"]

# serial: kills a run at random moments and times a live lock (Makefile `test` runs these alone)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _env(repo):
    return dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(repo))


def _start(repo):
    # A session of its own, so that the whole tree (Snakemake and its jobs) can be killed at once.
    return subprocess.Popen(CMD, cwd=repo, env=_env(repo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_for(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _flock_held(path: Path) -> bool:
    if not path.exists():
        return False
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@pytest.fixture()
def repo(tmp_path):
    repo = tmp_path / "repo"
    copy_project(repo)
    (repo / PARAMS).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY, repo / PARAMS)
    return repo


def test_sigkilled_run_resumes_with_the_same_command_and_a_live_run_is_refused(repo):
    # 1. Kill the whole run while a training job is running, as a power loss or the OOM killer would.
    crashed = _start(repo)
    _wait_for(lambda: any((repo / "logs/tiny/train").glob("*.log")), "a training job to start")
    time.sleep(1.0)
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.wait()
    locks = list((repo / ".snakemake/locks").glob("*.lock"))
    assert locks, "the killed run left no Snakemake lock: the test did not reproduce the crash"
    assert any((repo / ".snakemake/incomplete").iterdir()), "no job was incomplete at the kill"

    # 2. The same command resumes; meanwhile a second run of the same study is refused.
    resumed = _start(repo)
    run_lock = repo / ".snakemake/pipeline-tiny.run"
    _wait_for(lambda: _flock_held(run_lock), "the resumed run to take its run lock")
    _wait_for(lambda: any((repo / ".snakemake/locks").glob("*.lock")), "the resumed run to lock the directory")
    # Snakemake tries its directory lock only when it has jobs to run; paused, the resumed run
    # cannot finish the study while the second one starts (which may take longer on a busy machine).
    os.kill(resumed.pid, signal.SIGSTOP)
    try:
        second = subprocess.run(CMD, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=300)
    finally:
        os.kill(resumed.pid, signal.SIGCONT)
    out = resumed.communicate(timeout=600)[0]
    assert second.returncode != 0, f"a second live run was not refused:\n{second.stdout[-2000:]}{second.stderr[-2000:]}"
    assert "cannot be locked" in second.stdout + second.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert "removed stale lock" in out

    # 3. The resumed study is complete and sound: every cell's metrics parse, nothing left to do.
    assert (repo / "reports/tiny/report.pdf").stat().st_size > 0
    for cell in ("baseline", "pe_none"):
        for path in (f"data/tiny/runs/reorder/{cell}/seed0/train_metrics.json",
                     f"data/tiny/eval/reorder/{cell}/seed0/eval_metrics.json"):
            json.loads((repo / path).read_text())
    dry = subprocess.run(CMD + ["-n"], cwd=repo, env=_env(repo), capture_output=True, text=True)
    assert "Nothing to be done" in dry.stdout + dry.stderr
    assert not (repo / ".snakemake/locks").exists() or not any((repo / ".snakemake/locks").iterdir())


def test_claim_run_removes_only_this_studys_locks_and_only_without_a_live_holder(tmp_path):
    locks = tmp_path / ".snakemake/locks"
    locks.mkdir(parents=True)
    (locks / "0.output.lock").write_text("data/tiny/raw/x\nreports/tiny/report.pdf\n")
    (locks / "1.output.lock").write_text("data/other/raw/x\n")
    # A live holder (here a second open file description, as another process would have).
    holder = open(tmp_path / ".snakemake/pipeline-tiny.run", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert claim_run("tiny", tmp_path) == []
    assert (locks / "0.output.lock").exists()
    holder.close()  # the holder dies: its flock goes with it
    assert claim_run("tiny", tmp_path) == [locks / "0.output.lock"]
    assert not (locks / "0.output.lock").exists() and (locks / "1.output.lock").exists()
