"""Helpers shared by the bench/bench_*.py scripts (not a benchmark itself: `make bench` skips it).

machine_info()  what the numbers were measured on: CPU model, cores, load, torch/CUDA, GPU
write_report()  reports/bench/<name>.json (machine, versions, date, results) + <name>.md, printed
md_table()      a Markdown table from rows of cells
device helpers  pick_device / sync / autocast (bf16 on CUDA, as pipeline_src/train/trainer.py trains)
copy_repo()     a throw-away copy of the parts of the repository a workflow run needs
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline_src.common import cpu_name, package_versions  # noqa: E402

OUT_DIR = REPO / "reports" / "bench"
BIN = Path(sys.executable).parent  # snakemake / dvc of the running environment


def mirror_dir() -> Path:
    """The offline dataset mirror: PIPELINE_DATA_MIRROR, else ../shared/datasets beside the checkout."""
    return Path(os.environ.get("PIPELINE_DATA_MIRROR", REPO.parent / "shared" / "datasets")).resolve()


def machine_info() -> dict:
    info = {"platform": platform.platform(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "memory_gb": _memory_gb()}
    with contextlib.suppress(ImportError):
        import torch
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), cuda=torch.version.cuda,
                    cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                        cudnn=torch.backends.cudnn.version())
    return info


def _memory_gb() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return "–" if v is None else str(v)

    align = ["---" if i == 0 else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(name: str, title: str, results: dict, body_md: str, quick: bool = False,
                 out_dir: str | Path = OUT_DIR) -> dict:
    """Write <out_dir>/<name>.json and <name>.md, print the Markdown, return the full record."""
    machine = machine_info()
    record = {"benchmark": name, "quick": quick,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
              "machine": machine, "versions": package_versions(), **results}
    where = machine.get("gpu") or machine["cpu"]
    head = [f"# {title}" + (" (QUICK smoke run: not a measurement)" if quick else ""), "",
            f"{record['date']} · {where} · {machine['usable_cores']} cores (load {machine['load_avg_1_5_15']}) · "
            f"torch {machine.get('torch')} (CUDA {machine.get('cuda')}) · `{record['command']}`", "", ""]
    md = "\n".join(head) + body_md.rstrip() + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"wrote {out / (name + '.json')} and {name}.md")
    return record


def median(xs) -> float:
    return float(statistics.median(xs))


# --- torch devices --------------------------------------------------------------------------


def pick_device(name: str = "auto"):
    import torch
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as pipeline_src/train/trainer.py
        torch.backends.cudnn.allow_tf32 = True
    return device


def torch_setup(args):
    """Device and thread settings every torch benchmark takes from its common flags."""
    import torch
    device = pick_device(args.device)
    if args.threads or args.quick:  # quick runs happen on busy machines, where 2+ threads thrash
        torch.set_num_threads(args.threads or 1)
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device):
    """bf16 autocast on CUDA (what training uses), fp32 elsewhere."""
    import torch
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def peak_bf16_flops(device) -> float | None:
    """Measured dense bf16 matmul FLOP/s (the MFU denominator, same probe as training); None on CPU."""
    from pipeline_src.train.trainer import _peak_flops
    return _peak_flops(device)


# --- workflow copies ------------------------------------------------------------------------

REPO_ITEMS = ("pipeline_src", "workflow", "Snakefile", "params.yaml", "pyproject.toml")


def copy_repo(dst: Path, items=REPO_ITEMS) -> Path:
    """Copy the code and workflow (no data, logs, caches or generated dvc.yaml/dvc.lock) to dst."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "dvc.yaml", "dvc.lock")
    for item in items:
        src = REPO / item
        if src.is_dir():
            shutil.copytree(src, dst / item, ignore=ignore)
        elif src.exists():
            (dst / item).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / item)
    return dst


def tool_env(code: Path | None = None, keep_server: bool = False) -> dict:
    """Environment in which `python`, `snakemake` and `dvc` are those of this interpreter's venv, and
    `pipeline_src` is imported from `code` (default: the command's working directory). The caller's
    other PYTHONPATH entries stay: on a GPU node run from a bundle they hold the bundle's packages
    (workflow/node/node.sh), without which the stages cannot import datasets or jsonschema.
    Every job runs in a process of its own, never forked from a start-up server (PIPELINE_PRELOAD,
    pipeline_src/runtime/preload.py): its CPU time and memory are then the command's children's, as the
    tables report them. keep_server: a smoke run's jobs (--quick, whose figures nobody reads) fork
    from the server the caller runs under, if any, which saves each of them importing torch."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", DVC_NO_ANALYTICS="1",
               PIPELINE_QUIET="1")
    if not keep_server:
        env.pop("PIPELINE_PRELOAD", None)
    carried = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    path = ([str(code)] if code else []) + carried
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    return env


def timed_run(cmd: list[str], cwd: Path, timeout: float | None = None, check: bool = True,
              keep_server: bool = False) -> tuple[float, float, str]:
    """Run a command; return (wall seconds, CPU seconds user+sys of the command and its children,
    combined stdout+stderr). CPU time is the load-robust figure on a busy machine. Raises on a
    non-zero exit if check. keep_server: see tool_env."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tick = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=tool_env(keep_server=keep_server), capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - tick
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = proc.stdout + proc.stderr
    if check and proc.returncode:
        raise RuntimeError(f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{output[-3000:]}")
    return wall, cpu, output


def run_stage(work: Path, params: str, *args: str) -> None:
    """`python -m pipeline_src <args> --params <params>` in the work folder `work`, one thread,
    quiet; exits with the stage's last error lines if it fails (the probes' runs)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PIPELINE_QUIET="1", PIPELINE_CPU_THREADS="1")
    cmd = [sys.executable, "-m", "pipeline_src", *args, "--params", params]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"probe: {' '.join(args)} ({params}) failed:\n{proc.stderr[-2000:]}")
