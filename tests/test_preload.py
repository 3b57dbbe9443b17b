"""The start-up server (`python -m pipeline_src preload COMMAND`, pipeline_src/runtime/preload.py): a stage
forked from it gives a normal run's bytes, exit status and streams; signals reach it; a job killed
outright takes its stage with it; a job whose start-up settings differ runs the normal way."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from project_copy import checkout_env
from test_train import _prepare_data, _write_params

from pipeline_src.runtime import preload
from pipeline_src.study.config import load_study

RUN = "data/tiny/runs/reorder/baseline/seed0"
EVAL = "data/tiny/eval/reorder/baseline/seed0"
TIMING = {"wall_s", "tokens_per_s", "warmup_s", "start_utc", "end_utc", "achieved_flops", "mfu", "peak_mem_mb",
          "preloaded"}


def _stage(*args):
    return [sys.executable, "-m", "pipeline_src", *args]


def _under_server(command: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(_stage("preload", *command), cwd=cwd, env=checkout_env(**env), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("preload")
    _prepare_data(d, _write_params(d, max_steps=30, eval_every=15, log_every=5))
    return d


def _copy(prepared: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-a", f"{prepared}/.", str(dest)], check=True)
    return dest


def test_a_stage_forked_from_the_server_gives_the_normal_runs_bytes(prepared, tmp_path):
    train = ["train", "--params", "tiny.yaml", "--task", "reorder", "--cell", "baseline", "--seed", "0"]
    evaluate = ["evaluate", "--params", "tiny.yaml", "--task", "reorder", "--cell", "baseline", "--seed", "0"]
    normal = _copy(prepared, tmp_path / "normal")
    alone = checkout_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    alone.pop("PIPELINE_PRELOAD", None)  # a process of its own, also when the tests run under a server
    for args in (train, evaluate):
        subprocess.run(_stage(*args), cwd=normal, env=alone, check=True, capture_output=True)
    forked = _copy(prepared, tmp_path / "forked")
    # As Snakemake runs a job: its thread settings in the environment, which the copy applies.
    script = " && ".join(f"OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GOTO_NUM_THREADS=1 "
                         f"{sys.executable} -m pipeline_src {' '.join(args)}" for args in (train, evaluate))
    proc = _under_server(["bash", "-c", script], forked)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in (f"{RUN}/train_metrics.json", f"{RUN}/train_log.tsv", f"{RUN}/ckpt/best.pt",
                 f"{EVAL}/eval_metrics.json"):
        a, b = (normal / name).read_bytes(), (forked / name).read_bytes()
        if name.endswith("train_log.tsv"):  # its last two columns are throughput
            a, b = ([line.split("\t")[:-2] for line in x.decode().splitlines()] for x in (a, b))
        assert a == b, name
    cost = {k: json.loads((d / RUN / "cost.json").read_text()) for k, d in (("normal", normal), ("forked", forked))}
    assert cost["normal"]["preloaded"] is False and cost["forked"]["preloaded"] is True
    assert {k: v for k, v in cost["normal"].items() if k not in TIMING} == \
        {k: v for k, v in cost["forked"].items() if k not in TIMING}


def test_the_table_stages_fork_from_a_second_server_and_give_the_normal_runs_bytes(prepared, tmp_path):
    """aggregate, figures and tables (pandas, SciPy, matplotlib) run in copies of the second
    server, forked from the first when the first of them asks: the same files as normal runs."""
    alone = checkout_env()
    alone.pop("PIPELINE_PRELOAD", None)
    trained = _copy(prepared, tmp_path / "trained")
    study = load_study(trained / "tiny.yaml")
    jobs = [("--task", t.name, "--cell", c, "--seed", str(seed)) for t in study.tasks.values() for c in t.cells
            for seed in study.seeds]
    script = " && ".join(f"{sys.executable} -m pipeline_src {stage} --params tiny.yaml {' '.join(job)}"
                         for job in jobs for stage in ("train", "evaluate"))
    proc = _under_server(["bash", "-c", script], trained)  # (as made does not matter here)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stages = ("aggregate", "figures", "tables")
    normal = _copy(trained, tmp_path / "normal")
    for stage in stages:
        subprocess.run(_stage(stage, "--params", "tiny.yaml"), cwd=normal, env=alone, check=True, capture_output=True)
    forked = _copy(trained, tmp_path / "forked")
    script = " && ".join(f"{sys.executable} -m pipeline_src {stage} --params tiny.yaml" for stage in stages)
    proc = _under_server(["bash", "-c", script], forked)
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = sorted(p.relative_to(normal) for p in (normal / "reports").rglob("*")
                  if p.is_file() and p.suffix in (".csv", ".tex", ".png", ".json"))
    assert len(made) > 5 and any(p.suffix == ".png" for p in made), made
    for rel in made:
        assert (normal / rel).read_bytes() == (forked / rel).read_bytes(), rel


def test_a_table_stage_asks_the_second_server_and_a_training_job_the_first(tmp_path, monkeypatch):
    import socket
    import threading

    path = str(tmp_path / "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + preload.TABLES_SOCKET_SUFFIX)  # only the second server listens
    listener.listen(1)
    asked = []

    def serve_one():
        for _ in range(2):
            conn, _ = listener.accept()
            data, _fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
            asked.append(preload._receive(conn, data)["argv"])
            preload._send(conn, {"run_here": "a test"})
            conn.close()

    server = threading.Thread(target=serve_one, daemon=True)
    server.start()
    monkeypatch.setenv("PIPELINE_PRELOAD", path)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a job's process, which has not loaded it
    for stage in ("figures", "evaluate"):  # evaluate: rouge-score (nltk) is loaded there
        monkeypatch.setattr(sys, "argv", ["pipeline_src", stage, "--params", "tiny.yaml"])
        assert preload.run_in_preloaded() is None  # told to run here
    server.join(timeout=10)
    assert asked == [["figures", "--params", "tiny.yaml"], ["evaluate", "--params", "tiny.yaml"]]
    monkeypatch.setattr(sys, "argv", ["pipeline_src", "train", "--params", "tiny.yaml"])
    assert preload.run_in_preloaded() is None  # the first server's socket: nobody there, so here
    listener.close()


def test_exit_status_streams_and_the_job_directory_are_the_jobs(tmp_path):
    (tmp_path / "sub").mkdir()
    script = (f"cd sub && echo 'study: [' > bad.yaml && {sys.executable} -m pipeline_src validate --params bad.yaml "
              f"> out.txt 2> err.txt; echo status=$?; {sys.executable} -m pipeline_src validate --params missing.yaml "
              f"2>&1 | cat; echo status=${{PIPESTATUS[0]}}")
    proc = _under_server(["bash", "-c", script], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "status=2"
    assert "bad.yaml" in (tmp_path / "sub" / "err.txt").read_text() and (tmp_path / "sub" / "out.txt").read_text() == ""
    assert "error: missing.yaml: params file not found" in proc.stdout and proc.stdout.rstrip().endswith("status=2")
    assert _under_server(["bash", "-c", "exit 3"], tmp_path).returncode == 3  # the command's own status


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _forked_copies(server: int, job: int) -> list[int]:
    """The server's copies that run a stage: children of its per-job supervisors."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    return [p for p in pids if p != job and _parent(_parent(p)) == server and _parent(p) != _parent(job)]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "SIGKILL to the stage"])
def test_signals_reach_the_stage_and_a_killed_job_takes_it_along(prepared, tmp_path, how):
    d = _copy(prepared, tmp_path / "run")
    _write_params(d, "long.yaml", max_steps=100000, eval_every=100000, log_every=5)
    job = (f"{sys.executable} -m pipeline_src train --params long.yaml --task reorder --cell baseline --seed 0 "
           f"& echo $! > job.pid; wait $!; echo $? > job.status")
    server = subprocess.Popen(_stage("preload", "bash", "-c", job), cwd=d, env=checkout_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _signal_the_job(d, server, how)
    finally:  # a failed check leaves no training behind
        if server.poll() is None and (d / "job.pid").exists():
            os.kill(int((d / "job.pid").read_text()), signal.SIGKILL)
            server.communicate(timeout=60)


def _signal_the_job(d: Path, server: subprocess.Popen, how: str) -> None:
    log = d / "data/tiny/runs/reorder/baseline/seed0/train_log.tsv"
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) > 2):  # training under way
        assert time.monotonic() < deadline and server.poll() is None, server.communicate()
        time.sleep(0.2)
    job_pid = int((d / "job.pid").read_text())
    copies = _forked_copies(server.pid, job_pid)
    assert len(copies) == 1 and job_pid not in copies, copies
    if how == "SIGKILL to the stage":  # e.g. the kernel's out-of-memory killer: the job dies of it too
        os.kill(copies[0], signal.SIGKILL)
    else:
        os.kill(job_pid, getattr(signal, how))
    _, err = server.communicate(timeout=120)
    status = int((d / "job.status").read_text())
    if how == "SIGTERM":  # forwarded: the stage saves its state and stops, as under a cluster's notice
        assert status == 75 and "SIGTERM received: training state saved" in err, err[-2000:]
    else:  # the job died at once; its stage, with nothing to save, goes with it
        assert status == 128 + signal.SIGKILL
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in copies):
            assert time.monotonic() < deadline, "the forked stage outlived its job"
            time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def _request(**env) -> dict:
    return {"executable": os.path.realpath(sys.executable), "flags": preload._flags(), "xoptions": sys._xoptions,
            "warnoptions": sys.warnoptions, "env": dict(os.environ, **env), "limits": preload._limits(),
            "placement": preload._placement()}


def test_a_job_whose_start_up_settings_differ_runs_the_normal_way():
    assert preload._differs(_request()) is None
    assert preload._differs(_request(PYTHONPATH="/elsewhere", TMPDIR="/tmp/x")) is None  # applied to the copy
    # torch's compile cache folder, which torch puts in its process's environment when it first
    # compiles (a test process that compiled once), is read when a job compiles, not at import.
    assert preload._differs(_request(TORCHINDUCTOR_CACHE_DIR="/tmp/inductor", TRITON_CACHE_DIR="/tmp/t")) is None
    assert preload._differs(_request(TORCHINDUCTOR_MAX_AUTOTUNE="1")) == "TORCHINDUCTOR_MAX_AUTOTUNE differs"
    # Snakemake's per-job thread settings: one number per library, applied through its own call.
    same = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GOTO_NUM_THREADS="1",
                VECLIB_MAXIMUM_THREADS="1", NUMEXPR_NUM_THREADS="1")
    assert preload._differs(_request(**same)) is None
    assert preload._differs(_request(**dict(same, MKL_NUM_THREADS="2"))) == "OMP_NUM_THREADS/MKL_NUM_THREADS differ"
    assert preload._differs(_request(PYTHONHASHSEED="7")) == "PYTHONHASHSEED differs"
    assert preload._differs(_request(PIPELINE_MALLOC="system")) == "PIPELINE_MALLOC differs"
    assert preload._differs(dict(_request(), executable="/usr/bin/python3.9")).startswith("another Python")
    # Where it runs: fewer CPUs or a lower priority are applied to the copy; not another cgroup.
    here = preload._placement()
    assert preload._differs(dict(_request(), placement=dict(here, cpus=here["cpus"][:1], nice=here["nice"] + 5))) is None
    assert preload._differs(dict(_request(), placement=dict(here, cgroup="0::/elsewhere\n"))) == "another cgroup"
    # Resource limits: a lower one is applied to the copy (test_faults.py's memory limit runs so
    # under `make test`), a higher one than the server's cannot be.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lower = dict(_request(), limits=dict(preload._limits(), RLIMIT_NOFILE=[64, 64]))
    assert preload._differs(lower) is None
    if hard != resource.RLIM_INFINITY:
        higher = dict(_request(), limits=dict(preload._limits(), RLIMIT_NOFILE=[soft, hard + 1]))
        assert preload._differs(higher) == "RLIMIT_NOFILE above the server's"


def test_importing_the_figures_stage_leaves_the_environment_alone():
    """A test process that imports the figures stage in-process then starts stage jobs: a variable
    set at import (once MPLBACKEND) would make the server refuse every later job of that process
    as started differently (39 jobs of the test suite ran the normal way so)."""
    code = "import json, os; import pipeline_src.report.figures; print(json.dumps(sorted(os.environ)))"
    env = checkout_env()
    env.pop("MPLBACKEND", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(proc.stdout) == sorted(env)
