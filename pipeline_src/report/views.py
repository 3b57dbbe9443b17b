"""What DVC shows of a study: headline metrics and plot data, written by the aggregate stage.

reports/<study>/metrics/<task>/<cell>.json   one small file per task x cell, declared as DVC
    metrics (top level of dvc.yaml), so `dvc metrics show` is a table with one row per cell:
    the task's headline metric (mean and std over seeds), test PPL per BPE token and training
    wall-clock seconds (mean). Numbers only, rounded for reading.
reports/<study>/plots/<task>/<train_loss|val_loss>/<cell>.tsv   loss curves, mean over seeds;
    dvc.yaml overlays the cells of a task in one plot per curve.
reports/<study>/plots/<task>/headline.tsv   headline metric per cell (a bar per cell).
reports/<study>/plots/<task>/learning_curve.tsv   tasks with data-size cells: the headline metric
    against the number of training rows (the baseline and each data-size cell).

DVC draws one table row per metrics file and one line per plot data file, so the files are laid
out the way the views should look. Paths come from here for both the writer and runtime/dvc_yaml.py.

Both folders are kept in git (uncached DVC outputs): DVC reads them at any commit for `dvc metrics
diff`, `dvc plots diff` and `dvc exp show`, and a study not yet run has them too, as placeholders
(`placeholders`: the metrics folder with only a .gitkeep, which .dvcignore hides, and each plot
file with its header only), so that DVC finds every file it is told to show, empty, instead of
warning that it failed to load them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..common import StageError, atomic_dir
from ..study.seed_plan import run_seeds
from . import PRIMARY, data_size_cells, read_csv, run_paths

# pandas is imported where frames are made: every DVC stage imports this module (through
# dvc_yaml.stale_message) and should not pay for pandas.
if TYPE_CHECKING:
    import pandas as pd

CURVES = ("train_loss", "val_loss")
KEEP = ".gitkeep"  # in the metrics folder, so that git keeps it before the study is run (.dvcignore hides it)


def headline_metric(kind: str) -> str:
    return PRIMARY[kind]


def metrics_file(metrics_dir: str | Path, task: str, cell: str) -> Path:
    return Path(metrics_dir) / task / f"{cell}.json"


def curve_path(plots_dir: str | Path, task: str, column: str, cell: str) -> Path:
    return Path(plots_dir) / task / column / f"{cell}.tsv"


def headline_plot_path(plots_dir: str | Path, task: str) -> Path:
    return Path(plots_dir) / task / "headline.tsv"


def learning_curve_path(plots_dir: str | Path, task: str) -> Path:
    return Path(plots_dir) / task / "learning_curve.tsv"


def learning_curve_cells(study, task) -> list[str]:
    """The cells of the task's learning curve (the baseline and its data-size cells, as in the
    report's figure); none when the task has no data-size cell."""
    cells = data_size_cells(study, task)
    return cells if len(cells) > 1 else []


def plot_files(study, plots_dir: str | Path) -> dict[Path, list[str]]:
    """Every plot data file the study's dvc.yaml names, with its columns (a header-only file
    holds these)."""
    out = {}
    for task in study.tasks.values():
        metric = headline_metric(task.kind)
        for column in CURVES:
            out.update({curve_path(plots_dir, task.name, column, cell): ["step", column] for cell in task.cells})
        out[headline_plot_path(plots_dir, task.name)] = ["cell", metric, f"{metric}_std"]
        if learning_curve_cells(study, task):
            out[learning_curve_path(plots_dir, task.name)] = ["cell", "train_rows", metric, f"{metric}_std"]
    return out


def placeholders(study, metrics_dir: str | Path, plots_dir: str | Path) -> list[Path]:
    """The views of a study not yet run, for git: the metrics folder's .gitkeep and each plot
    file's header. Files that exist (a study already run) are left alone. Returns those written."""
    written = []
    keep = Path(metrics_dir) / KEEP
    if not Path(metrics_dir).exists():
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text("", encoding="utf-8")
        written.append(keep)
    for path, columns in plot_files(study, plots_dir).items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\t".join(columns) + "\n", encoding="utf-8")
            written.append(path)
    return written


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
    import pandas as pd

    both = pd.concat([_read_log(run_paths(study, task, cell, seed)["log"]) for seed in run_seeds(study, task, cell)])
    both[column] = pd.to_numeric(both[column], errors="coerce")
    curve = both.dropna(subset=[column]).groupby("step", sort=True)[column].mean()
    return curve.reset_index()


def _learning_curve(study, task, headline: dict) -> pd.DataFrame:
    import pandas as pd

    from ..study.paths import data_paths
    from . import read_json

    metric = headline_metric(task.kind)
    rows = [{"cell": c, "train_rows": read_json(Path(data_paths(study, task.name, c)[0]) / "stats.json")["rows"]["train"],
             metric: headline[(task.name, c)][metric], f"{metric}_std": headline[(task.name, c)][f"{metric}_std"]}
            for c in learning_curve_cells(study, task)]
    return pd.DataFrame(rows).sort_values("train_rows", kind="stable")


def build(study, summary: pd.DataFrame) -> dict:
    """Everything the two directories will hold, computed before anything is written."""
    headline = headline_rows(study, summary)
    return {"headline": headline,
            "curves": {(t.name, c, col): _curve(study, t.name, c, col)
                       for t in study.tasks.values() for c in t.cells for col in CURVES},
            "learning": {t.name: _learning_curve(study, t, headline)
                         for t in study.tasks.values() if learning_curve_cells(study, t)}}


def write(study, views: dict, metrics_dir: Path, plots_dir: Path) -> None:
    import pandas as pd

    headline, curves = views["headline"], views["curves"]
    with atomic_dir(metrics_dir) as tmp:
        (tmp / KEEP).write_text("", encoding="utf-8")
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
        for task, frame in views.get("learning", {}).items():
            learning_curve_path(tmp, task).write_text(
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
