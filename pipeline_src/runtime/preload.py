"""Start-up server: stage processes forked from one that has already imported the libraries.

A job of a small study (the demo, the test suite's studies) spends most of its ~1.1 s importing
torch and the other libraries (~0.8 s), not in its stage. Under

    python -m pipeline_src preload COMMAND...      (e.g. snakemake ..., dvc repro ..., pytest ...)

this process imports them once, then runs COMMAND with PIPELINE_PRELOAD naming a socket. Each
`python -m pipeline_src <stage>` started under it, however deep (Snakemake, DVC, a test), sends
its arguments, working directory, environment and standard streams there instead of importing
anything. The server forks a copy of itself, which runs the stage in that directory and
environment, importing pipeline_src afresh from there, as a normal run does. The arithmetic is the
same, so are the bytes (tests/test_preload.py).

What stays as in a normal run:
* the exit status is the stage's, and a stage killed by a signal kills the job's process with
  the same signal;
* signals sent to the job's process (SIGTERM, SIGINT, SIGUSR1, ...) reach the stage; if the job's
  process is killed outright (SIGKILL), the stage and anything it started are killed with it;
* the job's working directory, environment, umask, resource limits (`ulimit`), CPUs (`taskset`),
  nice value and thread settings (Snakemake's per-job OMP_NUM_THREADS and the like) are applied
  to its copy;
* a job whose interpreter or environment differs where it matters before its first line runs
  (another Python, its flags, allocator or library settings read at import), or that could not
  be matched (a higher limit or priority than the server's, another cgroup), runs the normal
  way, and so does every job under SLURM, whose limits and accounting belong to the job's own
  processes. So does one with PIPELINE_PRELOAD unset or its server gone.

The table stages (TABLE_STAGES: data preparation, evaluation and the report's) fork from a second
server, forked from the first when the first of them asks, which has also imported datasets,
pandas, SciPy, matplotlib and rouge-score (whose nltk import costs a summarisation evaluation
~0.5 s); training jobs never have those loaded unless they import them.

What differs: the stage is not a child of the job's process, so whatever measures a job's process
tree from outside (Snakemake's `benchmark:` files: memory and CPU columns; wall time is right)
sees only the forwarding process. The benchmarks (bench/) run without the server for that reason.
And a copy's peak memory (cost.json, which says "preloaded") leaves out the library pages it never
touched.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import signal
import socket
import struct
import sys

# Read before a stage's first line runs (by the interpreter, or by a library at import), so a job
# that sets one of these differently from the server runs the normal way; those in
# _APPLIED_PER_JOB are applied to the forked copy instead.
_IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_", "ATEN_", "ONEDNN_", "DNNL_",
                         "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "GLIBC_TUNABLES",
                         "PIPELINE_MALLOC", "TOKENIZERS_", "HF_", "TRANSFORMERS_", "HOME", "XDG_", "LANG", "LC_", "MPL")
_APPLIED_PER_JOB = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")
# Read by torch only when it compiles, from the job's environment, which the copy has: torch sets
# TORCHINDUCTOR_CACHE_DIR in its own process's environment the first time it compiles, so a test
# process or driver that compiled once would otherwise send every later job the normal way.
_READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# Thread counts, which Snakemake sets for every job (its `threads`): applied to the job's copy
# through the libraries' own calls, as long as each group asks for one number.
_THREAD_GROUPS = {"torch": ("OMP_NUM_THREADS", "MKL_NUM_THREADS"), "blas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")}
_NO_EFFECT_HERE = ("VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")  # macOS's Accelerate; numexpr, not loaded
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGALRM)
_HEADER = struct.Struct("!I")  # each message: its length, then JSON
# Stages that read and write tables, draw or score summaries (datasets, pandas, SciPy, matplotlib,
# rouge-score: ~0.5-1 s to import) fork from a second server that has those loaded too. It is
# forked from the first when the first such job asks, so the copies that train never have them: a
# training job's peak memory (cost.json) stays that of a normal run.
TABLE_STAGES = ("download", "filter", "bpe", "evaluate", "promote", "plan", "aggregate", "figures", "tables", "claims",
                "report")
TABLES_SOCKET_SUFFIX = ".tables"


# --- the job's side: `python -m pipeline_src <stage>` ------------------------------------------------


def run_in_preloaded() -> int | None:
    """Run this stage in a copy of the server; its exit status, or None to run it here."""
    path = os.environ.get("PIPELINE_PRELOAD")
    if not path or "torch" in sys.modules or os.environ.get("SLURM_JOB_ID") or sys.gettrace() or sys.getprofile():
        return None  # not asked; already a copy of the server (or loaded anyway); a SLURM job; a profiler
    if sys.argv[1:2] and sys.argv[1] in TABLE_STAGES:
        path += TABLES_SOCKET_SUFFIX
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        return None  # the server is gone: run here
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask,
               "limits": _limits(), "placement": _placement(),
               "executable": os.path.realpath(sys.executable), "flags": _flags(),
               "xoptions": sys._xoptions, "warnoptions": sys.warnoptions}
    streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
    body = json.dumps(request).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body)) + body], streams)
    reply = _receive(conn)
    if reply is None or "run_here" in reply:
        return None
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # already ended: its status is on its way
            pass

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    reply = _receive(conn)
    if reply is None:  # the server died under the stage
        print("error: the start-up server (PIPELINE_PRELOAD) went away while the stage ran", file=sys.stderr)
        return 1
    status = reply["status"]
    if status < 0:  # killed by a signal: die of the same one, so that the caller sees what it would have
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


def _limits() -> dict[str, list[int]]:
    """The process's resource limits (memory, open files, ...), which a job's parent may have set."""
    import resource

    return {name: list(resource.getrlimit(getattr(resource, name))) for name in dir(resource)
            if name.startswith("RLIMIT_")}


def _placement() -> dict:
    """Where the process may run and at what priority: its CPUs, nice value and cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            cgroup = f.read()
    except OSError:
        cgroup = ""
    return {"cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0), "cgroup": cgroup}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _flags() -> list:
    flags = sys.flags
    return [getattr(flags, name) for name in dir(flags)
            if not name.startswith(("_", "n_")) and name not in ("count", "index", "dont_write_bytecode")]


def _send(conn: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    conn.sendall(_HEADER.pack(len(body)) + body)


def _receive(conn: socket.socket, first: bytes = b"") -> dict | None:
    data = first
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return None
        data += chunk
    return json.loads(data[_HEADER.size:_HEADER.size + _HEADER.unpack_from(data)[0]])


# --- the server: `python -m pipeline_src preload COMMAND...` ----------------------------------------


def _import_libraries() -> None:
    """What every training and evaluation job imports (~0.9 s): also the params file's schema
    checker, which every stage loads, and TensorBoard's writer, which every training run opens
    (~0.13 s, 8 MB together). Not what only some stages use (pandas, matplotlib, rouge-score,
    datasets: ~0.3-1 s, 30-80 MB each): the second server has those (_import_table_libraries), so
    a training job's peak memory (cost.json) stays what it is in a normal run."""
    from .allocator import keep_freed_memory

    keep_freed_memory()  # as every stage does, before torch allocates; the copies inherit it
    import jsonschema  # noqa: F401
    import numpy  # noqa: F401
    import numpy.random  # noqa: F401
    import sacrebleu  # noqa: F401
    import sentencepiece  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import yaml  # noqa: F401


def _import_table_libraries() -> None:
    """What the table stages (TABLE_STAGES) import besides (~2 s, ~170 MB)."""
    import datasets  # noqa: F401
    import matplotlib.pyplot  # noqa: F401  (the backend is chosen when a figure is first drawn)
    import pandas  # noqa: F401
    import rouge_score.rouge_scorer  # noqa: F401  (ROUGE of summarisation evaluations)
    import scipy.stats  # noqa: F401


def serve(command: list[str]) -> int:
    """Run COMMAND with PIPELINE_PRELOAD set, serving its stage processes; COMMAND's exit status."""
    import shutil
    import subprocess
    import tempfile

    if not command:
        print("usage: python -m pipeline_src preload COMMAND [ARGS...]", file=sys.stderr)
        return 2
    _import_libraries()
    _openblas_threads()
    folder = tempfile.mkdtemp(prefix="pipeline-preload-")
    path = os.path.join(folder, "socket")
    listener, tables_listener = _listen(path), _listen(path + TABLES_SOCKET_SUFFIX)
    try:
        proc = subprocess.Popen(command, env=dict(os.environ, PIPELINE_PRELOAD=path))
    except OSError as e:
        print(f"error: preload: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
        return 127
    # A stop meant for this process (`kill`, `timeout`) is passed on to the command, which decides.
    # Ctrl-C and Ctrl-\ are not: the terminal sends them to the command itself (it is in the same
    # process group), and a second copy would read as a second, impatient Ctrl-C.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: proc.poll() is None and proc.send_signal(signum))
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, lambda _signum, _frame: None)
    tables_server = None
    done = os.pidfd_open(proc.pid)  # readable when the command has ended
    try:
        # The table stages' server starts when the first of them connects (its connection waits
        # in the listener's queue meanwhile) and ends with this one.
        for _ in _accept(listener, lambda: proc.poll() is None, done, tables_listener):
            tables_server = _start_tables_server(tables_listener, listener, done)
            tables_listener.close()
    finally:
        listener.close()
        if tables_server:
            with contextlib.suppress(ProcessLookupError):
                os.kill(tables_server, signal.SIGTERM)
            os.waitpid(tables_server, 0)
        tables_listener.close()
        os.close(done)
        shutil.rmtree(folder, ignore_errors=True)
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def _listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    return listener


def _accept(listener: socket.socket, running, wake: int | None = None, waiting: socket.socket | None = None):
    """Fork a supervisor for each job that connects to `listener` while running() holds (checked
    when `wake` is readable, and every second). Yields (once) when a job first connects to
    `waiting`, which is then the caller's to serve."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    for extra in (wake, waiting):
        if extra is not None:
            selector.register(extra, selectors.EVENT_READ)
    supervisors: set[int] = set()
    try:
        while running():
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is waiting:
                    selector.unregister(waiting)
                    waiting = None
                    yield
                if key.fileobj is not listener:
                    continue
                conn, _ = listener.accept()
                pid = os.fork()
                if pid == 0:  # one supervisor per job: it forks the job's copy and reports its end
                    code = 1
                    try:
                        selector.close()
                        for fd in (listener, waiting, wake):
                            if fd is not None:
                                os.close(fd if isinstance(fd, int) else fd.detach())
                        code = _supervise(conn)
                    finally:
                        os._exit(code)
                conn.close()
                supervisors.add(pid)
            for pid in list(supervisors):  # reap the supervisors that have ended
                if os.waitpid(pid, os.WNOHANG)[0]:
                    supervisors.discard(pid)
    finally:
        selector.close()


def _start_tables_server(tables_listener: socket.socket, listener: socket.socket, done: int) -> int:
    """Fork the server of the table stages: a copy of this one that imports their libraries too,
    then serves `tables_listener` until this process is gone."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        listener.close()
        os.close(done)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this one's stop ends it; its jobs run on
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        _import_table_libraries()
        for _ in _accept(tables_listener, lambda: os.getppid() == parent):
            pass
        code = 0
    except BaseException:  # noqa: BLE001 - its jobs then run the normal way (nothing accepts them)
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _supervise(conn: socket.socket) -> int:
    """In a fork of the server: take one job's request, fork the copy that runs it, wait for it
    and send its exit status; kill it if the job's process goes away first."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # the job's process forwards what is meant for the stage
    data, fds, _flags_, _addr = socket.recv_fds(conn, 1 << 16, 3)
    request = _receive(conn, data)
    if request is None or len(fds) != 3:
        return 1
    why = _differs(request)
    if why:
        _send(conn, {"run_here": why})
        return 0
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            conn.close()
            code = _run_stage(request, fds)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    ended = os.pidfd_open(pid)
    selector = selectors.DefaultSelector()
    selector.register(ended, selectors.EVENT_READ)
    selector.register(conn, selectors.EVENT_READ)
    status = None
    while status is None:
        # The timeout also polls the copy: once, under heavy load, a supervisor was seen waiting
        # here with its copy gone, and a job that hangs is worse than one that reports.
        events = selector.select(timeout=5.0)
        if not events or any(key.fd == ended for key, _ in events):
            try:
                done, raw = os.waitpid(pid, os.WNOHANG if not events else 0)
            except ChildProcessError:  # reaped by someone else: its status is lost
                done, raw = pid, 1 << 8
            status = raw if done else None
            continue
        if not conn.recv(1):  # the job's process is gone (killed): the stage goes with it
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            os.waitpid(pid, 0)
            return 0
    try:
        _send(conn, {"status": os.waitstatus_to_exitcode(status)})
    except OSError:
        pass  # the job's process went away as the stage ended
    return 0


def _differs(request: dict) -> str | None:
    """Why this job must run the normal way (something read before its first line differs), or None."""
    if request["executable"] != os.path.realpath(sys.executable):
        return f"another Python ({request['executable']})"
    if request["flags"] != _flags() or request["xoptions"] != sys._xoptions or \
            request["warnoptions"] != sys.warnoptions:
        return "other interpreter flags"
    placement, here = request["placement"], _placement()
    if placement["cgroup"] != here["cgroup"]:
        return "another cgroup"  # its own memory and CPU share, as a cluster or systemd-run gives a job
    if placement["nice"] < here["nice"]:
        return "a higher priority than the server's"
    if not set(placement["cpus"]) <= set(here["cpus"]):
        return "CPUs the server may not use"
    ours = _limits()
    for name, (_soft, hard) in request["limits"].items():
        if name in ours and _above(hard, ours[name][1]):
            return f"{name} above the server's"  # a limit can be lowered in the copy, never raised
    env = request["env"]
    per_job = set(_APPLIED_PER_JOB) | set(_READ_WHEN_USED) | {v for group in _THREAD_GROUPS.values() for v in group} | \
        set(_NO_EFFECT_HERE)
    for name in sorted(set(env) | set(os.environ)):
        if name.startswith(_IMPORT_TIME_PREFIXES) and name not in per_job and env.get(name) != os.environ.get(name):
            return f"{name} differs"
    if "numexpr" in sys.modules and env.get("NUMEXPR_NUM_THREADS") != os.environ.get("NUMEXPR_NUM_THREADS"):
        return "NUMEXPR_NUM_THREADS differs"
    for names in _THREAD_GROUPS.values():
        if _thread_count(env, names) is None:
            return f"{'/'.join(names)} differ"
    if _thread_count(env, _THREAD_GROUPS["blas"]) and _openblas_threads() is None:
        return "OPENBLAS_NUM_THREADS differs (no OpenBLAS call to set it)"
    return None


def _above(limit: int, than: int) -> bool:
    import resource

    return than != resource.RLIM_INFINITY and (limit == resource.RLIM_INFINITY or limit > than)


def _thread_count(env: dict, names: tuple[str, ...]) -> int | None:
    """0: as in the server; n: the job asks each of NAMES for n threads; None: neither."""
    if all(env.get(n) == os.environ.get(n) for n in names):
        return 0
    values = {env.get(n) for n in names}
    if len(values) == 1 and (value := values.pop()) is not None and value.isdigit() and int(value) > 0:
        return int(value)
    return None


@functools.cache  # looked up once, in the server; its copies inherit the answer
def _openblas_threads():
    """numpy's OpenBLAS `set_num_threads`, found in the libraries this process has loaded, or None."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1] and ".so" in line}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(lib, name):
                return getattr(lib, name)
    return None


def _encoding(stream) -> str:
    return getattr(stream, "encoding", None) or "utf-8"


def _run_stage(request: dict, fds: list[int]) -> int:
    """In the job's copy of the server: become the job's process, then run its stage."""
    import runpy

    server_paths = _become_the_job(request, fds)
    _python_as_started_there(request, server_paths)
    try:
        runpy.run_module("pipeline_src", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then status 1
        import traceback

        traceback.print_exc()
        code = 1
    # Reached when the stage did not end the process itself (exit_now in __main__ leaves that to
    # the interpreter under a profiler or with a thread still running): end as the interpreter
    # would, waiting for non-daemon threads, then the atexit handlers and a flush.
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    return code


def _become_the_job(request: dict, fds: list[int]) -> list[str]:
    """The job's process group, signals, streams, directory, limits, CPUs, priority, environment
    and thread counts; returns the server's own PYTHONPATH entries, which the job's replace."""
    import resource
    import tempfile
    import time

    os.setpgid(0, 0)  # its own group: killing the job kills it and what it started, and nothing else
    for sig in FORWARDED_SIGNALS + (signal.SIGCHLD,):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name, limit in request["limits"].items():  # e.g. a memory limit the job was started with
        if hasattr(resource, name) and list(resource.getrlimit(getattr(resource, name))) != limit:
            resource.setrlimit(getattr(resource, name), tuple(limit))
    placement = request["placement"]  # `taskset`, `nice`
    if set(placement["cpus"]) != os.sched_getaffinity(0):
        os.sched_setaffinity(0, placement["cpus"])
    if placement["nice"] != os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, placement["nice"])
    torch_threads = _thread_count(request["env"], _THREAD_GROUPS["torch"])
    blas_threads = _thread_count(request["env"], _THREAD_GROUPS["blas"])
    server_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ.clear()
    os.environ.update(request["env"], PIPELINE_PRELOADED=str(os.getpid()))  # cost.json says so
    if torch_threads:  # what OMP_NUM_THREADS / MKL_NUM_THREADS would have set at start-up
        import torch

        torch.set_num_threads(torch_threads)
    if blas_threads:
        _openblas_threads()(blas_threads)
    tempfile.tempdir = None  # found again from the job's TMPDIR
    time.tzset()
    return server_paths


def _python_as_started_there(request: dict, server_paths: list[str]) -> None:
    """sys.path, standard streams, bytecode writing, the job's own pipeline_src and a fresh
    `random` state, as `python -m pipeline_src` started in the job's directory has them."""
    import importlib
    import io
    import random

    job_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # sys.path as `python -m` builds it in that directory: it first, then PYTHONPATH, then the rest.
    rest = [p for p in sys.path[1:] if p not in server_paths]
    sys.path[:] = [os.getcwd(), *job_paths, *rest]
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    # Standard streams on the job's descriptors, buffered as the interpreter would have them.
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=_encoding(sys.stdin), errors="strict")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
                                  encoding=_encoding(getattr(sys, name)),
                                  errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    for name in [m for m in sys.modules if m == "pipeline_src" or m.startswith("pipeline_src.")]:
        del sys.modules[name]  # the job's own code, from its own directory, as in a normal run
    importlib.invalidate_caches()
    random.seed()  # fresh per process, as in a normal run (the stages seed what they compute)
    sys.argv = ["-m", *request["argv"]]
