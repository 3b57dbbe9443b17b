"""How fast a study's training runs went, alone and together (tokens/s, MFU, padding, batch
shapes, compile warm-up, several cells sharing one GPU), taken from a real study's own records
instead of a benchmark.

It reads what the train stage wrote for every finished run (data/<study>/runs/<task>/<cell>/
seed<s>/cost.json and train_metrics.json), the evaluate stage's Snakemake benchmark files
(logs/<study>/bench/evaluate/*.tsv) and, if run.sh recorded it, the GPU's utilisation
(logs/<study>/gpu_util.csv). A run counts once it has train_metrics.json, which the train stage
writes last; runs still training are left out, so a study that is still running, failed, or was
cut off with its machine gives the figures of the runs it finished.

Aggregate over a task's training window (first run's start to last run's end, from cost.json's
start_utc/end_utc):
  target tok/s = sum of the runs' target tokens / window,
  MFU          = sum of 3 x FLOPs per token x target tokens / window / the peak bf16 matmul
                 FLOP/s the runs measured,
  runs at once = sum of the runs' training wall time / window (the mean number sharing the GPU).
Evaluation jobs share the same GPU slots inside that window, so it is a lower bound on what the
training alone would reach.

    python bench/study_throughput.py --study gpu [--root DIR] [--state finished|running|failed]
                                     [--source TEXT] [--out bench/results/h100] [--name study_gpu_throughput]

--root: where data/ and logs/ are (default: the repository, where workflow/node/unpack.sh puts a
study that ran on a node). Target: none; it reports what a study achieved.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
from pathlib import Path

from common import REPO, md_table


def _time(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).timestamp()


def read_runs(root: Path, study: str) -> list[dict]:
    """One record per finished training run, sorted by task, cell, seed. A run is finished when it
    has train_metrics.json, which the train stage writes after cost.json and its other outputs."""
    runs = []
    for metrics_path in sorted((root / "data" / study / "runs").glob("*/*/seed*/train_metrics.json")):
        run_dir = metrics_path.parent
        cost = json.loads((run_dir / "cost.json").read_text())
        metrics = json.loads(metrics_path.read_text())
        task, cell, seed = run_dir.parent.parent.name, run_dir.parent.name, int(run_dir.name[len("seed"):])
        tokens = metrics["train_tokens"]
        if cost.get("resumed_from_step") and metrics["steps"]:  # only this segment's share was timed
            tokens *= (metrics["steps"] - cost["resumed_from_step"]) / metrics["steps"]
        bench = root / "logs" / study / "bench" / "evaluate" / f"{task}-{cell}-s{seed}.tsv"
        eval_s = None
        if bench.is_file():
            with bench.open() as f:
                eval_s = float(next(csv.DictReader(f, delimiter="\t"))["s"])
        runs.append({"task": task, "cell": cell, "seed": seed, "steps": metrics["steps"],
                     "segment_tokens": tokens, "flops_per_token": metrics["flops_per_token"],
                     "start": _time(cost["start_utc"]) if cost.get("start_utc") else None,
                     "end": _time(cost["end_utc"]) if cost.get("end_utc") else None,
                     "evaluate_s": eval_s, **{k: cost.get(k) for k in (
                         "wall_s", "tokens_per_s", "mfu", "peak_flops", "pad_fraction", "batch_shapes", "warmup_s",
                         "peak_mem_mb", "device_name", "precision", "compiled", "cuda_graphs")}})
    return runs


def aggregate(runs: list[dict]) -> dict:
    """The runs' combined throughput over the window from the first start to the last end."""
    timed = [r for r in runs if r["start"] is not None and r["end"] is not None]
    if not timed:
        return {"runs": len(runs), "window_s": None, "runs_at_once": None, "target_tok_s": None, "mfu": None}
    window = max(r["end"] for r in timed) - min(r["start"] for r in timed)
    tokens = sum(r["segment_tokens"] for r in timed)
    flops = sum(3 * r["flops_per_token"] * r["segment_tokens"] for r in timed)
    peaks = [r["peak_flops"] for r in timed if r["peak_flops"]]
    return {"runs": len(timed), "window_s": window, "runs_at_once": sum(r["wall_s"] for r in timed) / window,
            "target_tok_s": tokens / window, "mfu": flops / window / max(peaks) if peaks else None}


def gpu_utilisation(root: Path, study: str) -> float | None:
    """Mean of nvidia-smi's utilisation.gpu samples over the study (run.sh samples every 2 s)."""
    path = root / "logs" / study / "gpu_util.csv"
    if not path.is_file():
        return None
    values = []
    with path.open() as f:
        for row in csv.reader(f):
            try:
                values.append(float(row[1]))
            except (IndexError, ValueError):
                pass
    return statistics.fmean(values) if values else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _pct(x):
    return None if x is None else f"{100 * x:.1f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True, help="the study's name (params.yaml: study)")
    ap.add_argument("--root", default=str(REPO), help="the directory holding data/<study> and logs/<study>")
    ap.add_argument("--state", default="finished", choices=["finished", "running", "failed"],
                    help="what became of the study (recorded; running/failed = the finished runs only)")
    ap.add_argument("--source", help="where the records came from, for the header (default: --root)")
    ap.add_argument("--out", default=str(REPO / "reports" / "bench"))
    ap.add_argument("--name", help="report name (default study_<study>_throughput)")
    args = ap.parse_args()
    root, name = Path(args.root), args.name or f"study_{args.study}_throughput"
    runs = read_runs(root, args.study)
    if not runs:
        sys.exit(f"error: no finished training run (train_metrics.json) under {root / 'data' / args.study / 'runs'}")

    cells, tasks = {}, {}
    for r in runs:
        cells.setdefault((r["task"], r["cell"]), []).append(r)
        tasks.setdefault(r["task"], []).append(r)
    cell_rows = []
    for (task, cell), rs in cells.items():
        cell_rows.append([task, cell, len(rs), _mean([r["steps"] for r in rs]), _mean([r["tokens_per_s"] for r in rs]),
                          _pct(_mean([r["mfu"] for r in rs])), _pct(_mean([r["pad_fraction"] for r in rs])),
                          _mean([r["batch_shapes"] for r in rs]), _mean([r["warmup_s"] for r in rs]),
                          _mean([r["wall_s"] for r in rs]), _mean([r["evaluate_s"] for r in rs]),
                          _mean([r["peak_mem_mb"] for r in rs])])
    together = {task: aggregate(rs) for task, rs in tasks.items()}
    together["all"] = aggregate(runs)
    task_rows = [[task, a["runs"], a["window_s"], a["runs_at_once"], a["target_tok_s"], _pct(a["mfu"])]
                 for task, a in together.items()]
    devices = sorted({f"{r['device_name']} ({r['precision']})" for r in runs})
    compiled = sorted({f"compile {r['compiled']}, CUDA graphs {r['cuda_graphs']}" for r in runs})
    util = gpu_utilisation(root, args.study)
    state = {"finished": "the study finished", "running": "the study was STILL RUNNING: finished runs only",
             "failed": "the study FAILED: finished runs only"}[args.state]
    body = "\n".join([
        f"# Throughput of study `{args.study}`'s training runs ({state})", "",
        f"Runs as recorded by the train stage on {', '.join(devices)}; {', '.join(compiled)}. "
        f"Records: {args.source or root}; summarised by `python bench/{Path(sys.argv[0]).name}`.", "",
        "## Each cell (means over its finished seeds; tok/s and MFU of one run's timed steps)", "",
        md_table(["task", "cell", "runs", "steps", "target tok/s", "MFU", "padding", "batch shapes", "warm-up s",
                  "train wall s", "evaluate s", "peak MB"], cell_rows), "",
        "## Together: the runs sharing the device over each task's training window", "",
        md_table(["task", "runs", "window s", "runs at once", "target tok/s", "MFU"], task_rows), "",
        f"GPU utilisation (nvidia-smi, mean over the study): {'–' if util is None else f'{util:.1f} %'}", ""])
    record = {"benchmark": name, "study": args.study, "state": args.state, "source": args.source or str(root),
              "devices": devices,
              "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
              "together": together, "gpu_utilisation_pct": util,
              "runs": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in runs]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(body)
    print(body)
    print(f"wrote {out / (name + '.md')} and {name}.json")


if __name__ == "__main__":
    main()
