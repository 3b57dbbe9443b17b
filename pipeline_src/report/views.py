"""What DVC shows of a study: headline metrics and plot data, written by the aggregate stage.

reports/<study>/metrics/<task>/<cell>.json   one small file per task x cell, declared as DVC
    metrics (top level of dvc.yaml), so `dvc metrics show` is a table with one row per cell:
    the task's headline metric (mean and std over seeds), test PPL per BPE token and training
    wall-clock seconds (mean). Numbers only, rounded for reading.
reports/<study>/plots/<task>/<train_loss|val_loss>/<cell>.tsv   loss curves, mean over seeds;
    dvc.yaml overlays the cells of a task in one plot per curve.
reports/<study>/plots/<task>/headline.tsv   headline metric per cell (a bar per cell).

DVC draws one table row per metrics file and one line per plot data file, so the files are laid
out the way the views should look. Paths come from here for both the writer and dvc_yaml.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ..common import StageError, atomic_dir
from ..seed_plan import run_seeds
from . import PRIMARY, read_csv, run_paths

CURVES = ("train_loss", "val_loss")


def headline_metric(kind: str) -> str:
    return PRIMARY[kind]


def metrics_file(metrics_dir: str | Path, task: str, cell: str) -> Path:
    return Path(metrics_dir) / task / f"{cell}.json"


def curve_path(plots_dir: str | Path, task: str, column: str, cell: str) -> Path:
    return Path(plots_dir) / task / column / f"{cell}.tsv"


def headline_plot_path(plots_dir: str | Path, task: str) -> Path:
    return Path(plots_dir) / task / "headline.tsv"


def _num(value, digits: int):
    """A JSON number rounded for reading; None (JSON null) for missing or NaN."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else round(value, digits)


def headline_rows(study, summary: pd.DataFrame) -> dict[tuple[str, str], dict]:
    """{(task, cell): {metric: mean, metric_std: std, test_ppl: mean, wall_s: mean}}."""
    out = {}
    by_cell = summary.set_index(["task", "cell"])
    for task in study.tasks.values():
        metric = headline_metric(task.kind)
        for cell in task.cells:
            row = by_cell.loc[(task.name, cell)]
            values = {metric: _num(row.get(f"{metric}_mean"), 4), f"{metric}_std": _num(row.get(f"{metric}_std"), 4)}
            if metric != "test_ppl":
                values["test_ppl"] = _num(row.get("test_ppl_mean"), 4)
            values["wall_s"] = _num(row.get("wall_s_mean"), 1)
            out[(task.name, cell)] = values
    return out


def _read_log(path: Path) -> pd.DataFrame:
    frame = read_csv(path, sep="\t")
    for col in ("step",) + CURVES:
        if col not in frame:
            raise StageError(f"{path}: column {col} missing")
    return frame


def _curve(study, task: str, cell: str, column: str) -> pd.DataFrame:
    both = pd.concat([_read_log(run_paths(study, task, cell, seed)["log"]) for seed in run_seeds(study, task, cell)])
    both[column] = pd.to_numeric(both[column], errors="coerce")
    curve = both.dropna(subset=[column]).groupby("step", sort=True)[column].mean()
    return curve.reset_index()


def build(study, summary: pd.DataFrame) -> dict:
    """Everything the two directories will hold, computed before anything is written."""
    return {"headline": headline_rows(study, summary),
            "curves": {(t.name, c, col): _curve(study, t.name, c, col)
                       for t in study.tasks.values() for c in t.cells for col in CURVES}}


def write(study, views: dict, metrics_dir: Path, plots_dir: Path) -> None:
    headline, curves = views["headline"], views["curves"]
    with atomic_dir(metrics_dir) as tmp:
        for (task, cell), values in headline.items():
            path = metrics_file(tmp, task, cell)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")
    with atomic_dir(plots_dir) as tmp:
        for (task, cell, column), frame in curves.items():
            path = curve_path(tmp, task, column, cell)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(frame.to_csv(sep="\t", index=False, float_format="%.6g", lineterminator="\n"),
                            encoding="utf-8")
        for task in study.tasks.values():
            metric = headline_metric(task.kind)
            frame = pd.DataFrame([{"cell": cell, metric: headline[(task.name, cell)][metric],
                                   f"{metric}_std": headline[(task.name, cell)][f"{metric}_std"]}
                                  for cell in task.cells])
            headline_plot_path(tmp, task.name).write_text(
                frame.to_csv(sep="\t", index=False, lineterminator="\n"), encoding="utf-8")


# --- Snakemake's HTML report ---------------------------------------------------------------------

STUDY_CATEGORY = "Study"
FAMILY_CATEGORY = "Ablation families"


def report_group(study, what: str, name: str) -> tuple[str, str]:
    """(category, subcategory) of one file in Snakemake's HTML report: a task's figures and
    tables under the task, per-family tables under their family, the rest under the study.
    `what` is "figures", "tables" or "headline" (name: <task>/<cell>); figures and tables are
    looked up in the index.json their stage writes."""
    if what == "headline":
        task, cell = name.split("/", 1)
        return task, f"Headline metrics: {study.cell(task, cell).family}"
    from . import report_paths

    index_path = report_paths(study)[what] / "index.json"
    entry = next((e for e in json.loads(index_path.read_text(encoding="utf-8")) if e.get("name") == name), {})
    sub = f"{'Figure' if what == 'figures' else 'Table'}s: {entry.get('kind', name)}"
    if entry.get("task"):
        return entry["task"], sub
    if entry.get("family"):
        return FAMILY_CATEGORY, entry["family"]
    return STUDY_CATEGORY, sub
