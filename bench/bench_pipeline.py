"""Workflow overhead on a ~100-job study: Snakemake dry-run and no-op DVC commands.

In a throw-away copy of the repository (code, rules, schema only) this writes a study grid
params file built from the demo's `reorder` task (--cells cells x --seeds seeds: 12 x 4 gives
48 train + 48 evaluate + download/filter/bpe/aggregate/figures/tables/claims/report, and a code record
per stage kind), generates its
dvc.yaml with `python -m pipeline_src dvc-yaml`, and times, median of --reps runs each:

  plan, nothing built   `snakemake -n` (whole DAG scheduled)        target <= 3 s
                        `dvc status` (every stage changed; `dvc repro --dry` cannot plan past
                        a missing dependency, so it has no "nothing built" figure)
  no-op, all built      `snakemake -n` (nothing to be done)        target <= 3 s
                        `dvc status`, `dvc repro --dry`, `dvc repro` target <= 5 s each

"All built" is faked cheaply: every stage's outputs are written as tiny files/directories in
stage order (so Snakemake's mtimes are consistent) and recorded with `dvc commit -f`, after which
both tools must report that nothing is to be done (checked).

    python bench/bench_pipeline.py [--quick] [--cells 12] [--seeds 4] [--reps 3] [--keep]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from common import BIN, OUT_DIR, REPO, copy_repo, md_table, median, timed_run, write_report

SNAKE_TARGET, DVC_TARGET = 3.0, 5.0
STUDY = "benchgrid"
PARAMS = f"workflow/studies/{STUDY}/params.yaml"


def grid_params(n_cells: int, n_seeds: int) -> dict:
    """The demo study reduced to its `reorder` task, with n_cells cells and n_seeds seeds."""
    demo = yaml.safe_load((REPO / "workflow/studies/demo/params.yaml").read_text())
    task = demo["tasks"]["reorder"]
    cells = list(demo["cells"])   # every defined cell that makes sense for translation
    cells = [c for c in cells if demo["cells"][c].get("model", {}).get("arch") != "encoder_only"]
    if n_cells > len(cells):
        raise SystemExit(f"--cells {n_cells}: the demo defines only {len(cells)} translation cells")
    task["cells"] = cells[:n_cells]
    return {"study": STUDY, "description": "bench_pipeline grid (generated)", "device": "cpu",
            "seeds": list(range(n_seeds)), "datasets": {task["dataset"]: demo["datasets"][task["dataset"]]},
            "tasks": {"reorder": task}, "cells": {c: demo["cells"][c] for c in cells[:n_cells]},
            "report": demo.get("report", {})}


def job_outputs(work: Path) -> list[tuple[bool, Path]]:
    """(is_directory, path) of every job's outputs, in execution order."""
    from pipeline_src.study.config import load_study
    from pipeline_src.study.stages import DIRECTORIES, build_jobs
    return [(name in DIRECTORIES, work / path) for job in build_jobs(load_study(work / PARAMS))
            for name, path in job.outs.items()]


def fake_outputs(outs: list[tuple[bool, Path]]) -> None:
    for is_dir, p in outs:
        if is_dir:
            p.mkdir(parents=True, exist_ok=True)
            (p / "fake.txt").write_text(f"{p}\n")
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("{}\n" if p.suffix == ".json" else f"{p}\n")


def order_mtimes(outs: list[tuple[bool, Path]]) -> None:
    """Strictly increasing mtimes in execution order (dvc commit re-links outputs, scrambling them)."""
    t0 = time.time()
    for i, (is_dir, p) in enumerate(outs):
        for q in ([*p.rglob("*"), p] if is_dir else [p]):
            os.utime(q, (t0 + i * 0.01, t0 + i * 0.01), follow_symlinks=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run of each command (smoke test)")
    ap.add_argument("--cells", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--reps", type=int, help="runs per command, median reported (default 3, quick 1)")
    ap.add_argument("--timeout", type=float, default=600, help="per command, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary repository copy")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="bench_pipeline."))
    snake = [str(BIN / "snakemake"), "-n", "--cores", "2", "--config", f"params={PARAMS}"]
    dvc = str(BIN / "dvc")
    rows, results = [], {}

    def measure(label: str, cmd: list[str], target: float | None, expect: str | None = None) -> str:
        times, cpus, out = [], [], ""
        for _ in range(reps):
            t, cpu, out = timed_run(cmd, work, timeout=args.timeout)
            times.append(t)
            cpus.append(cpu)
        if expect and not re.search(expect, out):
            raise SystemExit(f"{label}: output does not match {expect!r}:\n{out[-2000:]}")
        t = median(times)
        met = None if target is None else t <= target
        results[label] = {"cmd": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd)),
                          "median_s": t, "times_s": times, "cpu_s": cpus, "target_s": target, "target_met": met}
        rows.append([label, f"`{results[label]['cmd']}`", f"{t:.2f}", f"{min(times):.2f}", f"{median(cpus):.2f}",
                     f"≤ {target:g}" if target else "–", {True: "yes", False: "NO", None: "–"}[met]])
        return out

    try:
        copy_repo(work)
        (work / PARAMS).parent.mkdir(parents=True, exist_ok=True)
        (work / PARAMS).write_text(yaml.safe_dump(grid_params(args.cells, args.seeds), sort_keys=False))
        t_gen, _, _ = timed_run([sys.executable, "-m", "pipeline_src", "dvc-yaml", "--params", PARAMS], work)
        dvc_yaml = work / PARAMS.replace("params.yaml", "dvc.yaml")
        n_stages = len(yaml.safe_load(dvc_yaml.read_text())["stages"])
        timed_run([dvc, "init", "--no-scm", "-q"], work)
        timed_run([dvc, "config", "core.analytics", "false"], work)

        out = measure("plan: snakemake -n (nothing built)", snake, SNAKE_TARGET, r"total\s+\d+")
        n_jobs = int(re.search(r"^total\s+(\d+)", out, re.M).group(1))
        target = str(dvc_yaml.relative_to(work))
        measure("plan: dvc status (nothing built)", [dvc, "status", target], None, r"changed outs")
        n_dvc_jobs = len(timed_run([dvc, "stage", "list", target], work)[2].strip().splitlines())
        outs = job_outputs(work)
        fake_outputs(outs)
        t_commit, _, _ = timed_run([dvc, "commit", "-f", "-q"], work, timeout=args.timeout)
        order_mtimes(outs)
        n_outs = len(outs)
        timed_run([dvc, "status", target], work)   # untimed: DVC re-hashes the re-timed outputs once
        measure("no-op: snakemake -n", snake, SNAKE_TARGET, r"Nothing to be done")
        measure("no-op: dvc status", [dvc, "status", target], DVC_TARGET, r"up to date")
        measure("no-op: dvc repro --dry", [dvc, "repro", "--dry", target], DVC_TARGET, r"up to date|didn't change")
        out = measure("no-op: dvc repro", [dvc, "repro", target], DVC_TARGET, r"up to date|didn't change")
        if "Running stage" in out:
            raise SystemExit(f"dvc repro ran a stage in the no-op state:\n{out[-2000:]}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    md = (f"Study grid: 1 task × {args.cells} cells × {args.seeds} seeds = {n_jobs} Snakemake jobs "
          f"({n_dvc_jobs} DVC stages, {n_stages} dvc.yaml entries); `dvc-yaml` generation {t_gen:.2f} s; "
          f"{n_outs} fake outputs recorded by `dvc commit -f` in {t_commit:.2f} s. Median of {reps} run(s), "
          f"wall clock including interpreter start-up (targets apply to it); CPU s = user+sys of the command, "
          f"the figure to trust on a loaded machine.\n\n"
          + md_table(["case", "command", "median s", "min s", "CPU s", "target s", "target met"], rows) + "\n")
    write_report("pipeline", "Workflow overhead: Snakemake dry-run and no-op DVC",
                 {"cells": args.cells, "seeds": args.seeds, "snakemake_jobs": n_jobs, "dvc_stages": n_dvc_jobs,
                  "dvc_yaml_entries": n_stages, "dvc_yaml_generation_s": t_gen, "dvc_commit_s": t_commit,
                  "fake_outputs": n_outs, "reps": reps, "results": results}, md, quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
