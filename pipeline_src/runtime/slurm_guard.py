"""Bounded failure behaviour of a SLURM run: one clear line, never a hang.

check(): before a SLURM run submits anything, ask SLURM whether it would accept the jobs. The SLURM executor plugin reports a refused `sbatch` as a failed job, and for a group job (see
workflow/profiles/slurm) Snakemake prints only "Error in group cell", without sbatch's reason. So
the run's distinct requests (partition, GPUs, memory, time, account) are first put to
`sbatch --test-only`, which answers at once without queueing anything, and a refusal or an
unreachable controller stops the run with one line that names the rule, the request and
SLURM's answer. Every call is bounded by a timeout, so nothing here can hang.

watch(): while the run lasts, ping the controller. When a status query fails on every attempt,
the plugin silently stops tracking the jobs it asked about, and Snakemake then waits forever for
them. So if the controller stays unreachable for PIPELINE_SLURM_UNREACHABLE_S seconds (default
300), the run says so in one line and stops: SIGTERM first (Snakemake's graceful exit), then,
since a graceful exit waits for the very jobs the plugin lost track of, a hard exit 30 s later.
Its locks are then stale and the same command, typed again, continues the study
(pipeline_src/runtime/run_lock.py); submitted jobs keep running under SLURM meanwhile.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

TIMEOUT_S = 60  # sbatch itself gives up on an unreachable controller after ~20 s
GRACE_S = 30  # after SIGTERM, before the hard exit


def sbatch_args(resources) -> tuple[str, ...]:
    """The sbatch options the plugin derives from these job resources (the parts SLURM checks)."""
    get = resources.get
    args = []
    if get("slurm_partition"):
        args += ["-p", str(get("slurm_partition"))]
    if get("slurm_account"):
        args += ["-A", str(get("slurm_account"))]
    if get("runtime"):
        args += ["-t", str(get("runtime"))]
    if get("mem_mb"):
        args += ["--mem", str(get("mem_mb"))]
    if get("gres"):
        args += [f"--gres={get('gres')}"]
    gpus = get("gpu")
    if gpus:
        model = get("gpu_model")
        args += [f"--gpus={model}:{gpus}" if model else f"--gpus={gpus}"]
    return tuple(args)


def check(jobs) -> None:
    """Raise SystemExit with one line if SLURM would refuse any of these jobs' requests."""
    if shutil.which("sbatch") is None:
        raise SystemExit("error: the SLURM profile needs `sbatch` on PATH (a SLURM login node); none found")
    tried = {}
    for job in jobs:
        if job.is_local:  # runs where Snakemake runs (the code records): never queued
            continue
        args = sbatch_args(job.resources)
        if args in tried:
            continue
        tried[args] = job.name
        cmd = ["sbatch", "--test-only", *args, "--wrap", "true"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: SLURM did not answer `{' '.join(cmd)}` within {TIMEOUT_S} s "
                             "(controller unreachable?)") from None
        if proc.returncode != 0:
            reason = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
            raise SystemExit(f"error: SLURM would not run the jobs of rule {job.name} "
                             f"(sbatch {' '.join(args)}): {reason}")


def controller_up(timeout_s: float = 30) -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=timeout_s).returncode == 0
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False


def watch(unreachable_s: float | None = None, poll_s: float = 15) -> threading.Thread:
    """Start a daemon thread that stops this process (SIGTERM) once the controller has been
    unreachable for `unreachable_s` seconds in a row."""
    if unreachable_s is None:
        unreachable_s = float(os.environ.get("PIPELINE_SLURM_UNREACHABLE_S", 300))

    def loop():
        down_since = None
        while True:
            time.sleep(poll_s)
            if controller_up():
                down_since = None
                continue
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since >= unreachable_s:
                print(f"error: the SLURM controller has been unreachable for {now - down_since:.0f} s "
                      "(scontrol ping); stopping. Jobs already submitted keep running; run the same "
                      "command again when the controller is back", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(GRACE_S)
                os._exit(1)

    thread = threading.Thread(target=loop, name="slurm-controller-watch", daemon=True)
    thread.start()
    return thread
