"""Two-stage screening (params `screening.<name>`, the design of seed study 003).

Stage one trains every cell of the screening on a subset of the data (task `<name>-s1`: the
screened task with `stage_one`'s filter/bpe overrides). The `promote` stage then tests every
stage-one cell against the stage-one baseline on the task's headline metric (the aggregate
stage's paired bootstrap, seeds pooled) and ranks the families: a family's effect is that of its
cell with the smallest p-value (ties: the larger |delta|); families are ordered by p-value, then
|delta| (larger first), then name. Promoted: the families with p < `max_p` (when given), at most
`top_k` of them (when given). The rule and every number go to
data/<study>/screening/<name>/promotion.json.

Stage two (task `<name>-s2`) is the screened task's full data at its own settings: it reads that
task's filtered set and tokenizer, and a cell the task's own grid already trains is read from
those runs (config.Study.run_task) rather than trained twice. The DAG must stay static for both
drivers (DVC has no dynamic stages), so every other stage-two job exists: each non-baseline
cell's training job depends on promotion.json and, when its family was not promoted, writes an
explicit "not promoted" record in place of a model (same declared outputs, nothing trained);
its evaluation does the same. A change of promotion reruns exactly the gated stage-two jobs
(under DVC only those whose record changes). The tables stage shows, per family, whether the stage-one conclusion held.

This module gates the stage-two jobs (train and evaluate read it); the promote stage itself and
the test of whether stage one's conclusions held are in pipeline_src/report/promote.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..common import StageError
from .paths import promotion_path, write_skipped_eval, write_skipped_train

NOT_PROMOTED = "NOT_PROMOTED.json"


# --- stage two: jobs of families that were not promoted -------------------------------------------


def require_own_run(study, stage: str, task: str, cell: str) -> None:
    """Refuse a stage-two job that does not exist: the screened task's own run of the cell is it."""
    owner = study.run_task(task, cell)
    if owner != task:
        raise StageError(f"{stage} {task}/{cell}: stage two reads {owner}/{cell}'s runs (same data and settings), "
                         f"so it has no job of its own; run `{stage} --task {owner} --cell {cell}`")


def promoted(study, task: str, cell: str) -> bool:
    """Whether a job of `task`/`cell` trains: always, except a stage-two cell whose family stage
    one did not promote."""
    t = study.task(task)
    if t.stage != 2 or cell == t.baseline_cell:
        return True
    path = Path(promotion_path(study, t.screen))
    if not path.is_file():
        raise StageError(f"{path}: missing; run `python -m pipeline_src promote --params {study.path} "
                         f"--screen {t.screen}` first")
    record = json.loads(path.read_text())
    return study.cells[cell]["family"] in record["promoted"]


def _record(study, task, cell, seed) -> dict:
    return {"task": task, "cell": cell, "seed": seed, "promoted": False,
            "reason": f"family {study.cells[cell]['family']} was not promoted by stage one "
                      f"({promotion_path(study, study.task(task).screen)})"}


def write_not_promoted_train(study, task: str, cell: str, seed: int) -> None:
    """The training job's declared outputs, holding a 'not promoted' record instead of a model."""
    write_skipped_train(study, task, cell, seed, NOT_PROMOTED, _record(study, task, cell, seed), "not promoted")


def write_not_promoted_eval(study, task: str, cell: str, seed: int) -> bool:
    """When the checkpoint is a 'not promoted' record, pass it on as the evaluation's outputs."""
    return write_skipped_eval(study, task, cell, seed, NOT_PROMOTED, "not promoted")
