"""Before a SLURM run submits anything, ask SLURM whether it would accept the jobs.

The SLURM executor plugin reports a refused `sbatch` as a failed job, and for a group job (see
workflow/profiles/slurm) Snakemake prints only "Error in group cell", without sbatch's reason. So
the run's distinct requests (partition, GPUs, memory, time, account) are first put to
`sbatch --test-only`, which answers at once without queueing anything, and a refusal or an
unreachable controller stops the run with one line that names the rule, the request and
SLURM's answer. Every call is bounded by a timeout, so nothing here can hang.
"""
from __future__ import annotations

import shutil
import subprocess

TIMEOUT_S = 60  # sbatch itself gives up on an unreachable controller after ~20 s


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
