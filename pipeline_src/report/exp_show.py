"""`python -m pipeline_src exp-show --params FILE [dvc exp show options]`: DVC's experiments table
cut down to what compares the cells of one study.

`dvc exp show` has a column for every params value and every dependency of every stage of every
dvc.yaml in the repository (over a thousand here) and no setting that hides columns; its
`--keep`, `--drop` and `--only-changed` options choose them. This command passes them for one
study:

  kept always   Experiment and Created (with --csv also rev, typ and parent), and each cell's
                headline metric: reports/<study>/metrics/<task>/<cell>.json:<metric>
  kept if they  the settings that define the study's cells: cells.<cell>.<section>.<setting>,
  differ        sweeps.<sweep>.<section>.<setting>, and the tasks' base sections
                tasks.<task>.<section>.<setting> (sections: model, train, eval, filter, bpe; a
                value the same in every row says nothing about the comparison, and is in the
                params file)
  dropped       everything else: dependencies' hashes, the other params, the other studies,
                the headline's std, test PPL and wall-clock columns (`dvc metrics show` has them)

DVC names a column by its key alone where only one file has that key, and `<file>:<key>`
otherwise, so each column is matched in both spellings; a key alone that another study's params
file has (`cells.pe_none.model.dropout` of the demo, seen from the mirror) is that study's. Further options (`--csv`, `--md`, `-A`,
`-n`, `--sort-by` ...) go to `dvc exp show` as they are.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..study.config import Study
from ..study.paths import METRICS, output_path
from .views import headline_metric, metrics_file

ROWS = ("Experiment", "Created")
SECTIONS = ("model", "train", "eval", "filter", "bpe")  # a cell's settings (not its family or label)
CSV_ROWS = ("Experiment", "rev", "typ", "Created", "parent")


def headline_columns(study: Study) -> list[tuple[str, str]]:
    """(metrics file, key) of each cell's headline metric."""
    metrics_dir = output_path(*next(iter(METRICS)), study=study.name)
    return [(metrics_file(metrics_dir, task.name, cell).as_posix(), headline_metric(task.kind))
            for task in study.tasks.values() for cell in task.cells]


def cell_entries(study: Study) -> list[str]:
    """Where the settings of the study's cells are written: the tasks' base sections
    (tasks.<task>), and cells.<cell> or sweeps.<sweep>."""
    return [f"tasks.{t}" for t in study.tasks] + list(dict.fromkeys(
        study.cell_key(c) for task in study.tasks.values() for c in task.cells))


def _either(path: str, keys: str, theirs: list[str] = ()) -> str:
    """A regex for these keys (a regex) of one file, named either way DVC names a column; a key
    alone in `theirs` is another file's."""
    alone = rf"(?!(?:{'|'.join(map(re.escape, theirs))})$)" if theirs else ""
    return rf"(?:{re.escape(path)}:|{alone})(?:{keys})$"


def _flat(tree, prefix: str = "") -> list[str]:
    """The dotted keys of a params file's values, as DVC names them."""
    if not isinstance(tree, dict):
        return [prefix]
    return [k for key, v in tree.items() for k in _flat(v, f"{prefix}.{key}" if prefix else str(key))]


def _other_studies_keys(params_file: str, pattern: str) -> list[str]:
    """The keys matching `pattern` that the other studies' params files have (as they are here)."""
    import yaml

    keys = set()
    for path in sorted({Path("params.yaml"), *Path("workflow/studies").glob("*/params.yaml")}):
        if path.as_posix() != params_file and path.is_file():
            try:
                raw = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError):
                continue
            keys.update(k for k in _flat(raw) if re.fullmatch(pattern, k))
    return sorted(keys)


def options(study: Study, csv: bool = False) -> list[str]:
    """The `dvc exp show` options of the compact view."""
    metrics: dict[str, list[str]] = {}
    for path, key in headline_columns(study):
        metrics.setdefault(path, []).append(key)
    keep = [rf"(?:{'|'.join(CSV_ROWS if csv else ROWS)})$"]
    keep += [_either(p, "|".join(map(re.escape, k))) for p, k in metrics.items()]
    # Any setting of a cell's sections, also one an experiment added (-S ++cells.<cell>.model.<key>=...).
    settings = rf"(?:{'|'.join(map(re.escape, cell_entries(study)))})\.(?:{'|'.join(SECTIONS)})\.[a-z0-9_]+"
    params_file = Path(os.path.relpath(study.path)).as_posix()  # as DVC names it, from the repository root
    ours = set(_flat(study.raw))
    theirs = [k for k in _other_studies_keys(params_file, settings) if k not in ours]
    return ["--only-changed", "--keep", "|".join(keep), "--drop",
            rf"(?!{_either(params_file, settings, theirs)}).*"]


def run(study: Study, dvc_args: list[str]) -> int:
    dvc = Path(sys.executable).parent / "dvc"
    cmd = [str(dvc) if dvc.exists() else (shutil.which("dvc") or "dvc"), "exp", "show", *dvc_args,
           *options(study, csv="--csv" in dvc_args)]
    return subprocess.call(cmd)
