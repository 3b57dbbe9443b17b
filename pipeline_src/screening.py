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
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .common import StageError, atomic_write_json
from .stages import output_path, promotion_path, write_records

NOT_PROMOTED = "NOT_PROMOTED.json"


def screening_metric(study, task: str) -> str:
    from .report import PRIMARY

    return PRIMARY[study.task(task).kind]


def _tests(study, task: str, cells, metric: str) -> dict[str, dict]:
    """Pooled paired test of each cell against the task's baseline on `metric`."""
    from .report.aggregate import _Outputs, _test_one

    t = study.task(task)
    out = _Outputs(study)
    n = study.cell(task, t.baseline_cell).eval.bootstrap
    return {c: _test_one(out, task, t.kind, t.baseline_cell, c, list(study.seeds), metric, n, {})
            for c in cells if c != t.baseline_cell}


def rank_families(study, screen_name: str, tests: dict[str, dict]) -> list[dict]:
    """Families of a screening, ranked and marked promoted (deterministic; see module doc)."""
    screen = study.screens[screen_name]
    fams: dict[str, list[str]] = {}
    for c in screen.cells[1:]:
        fams.setdefault(study.cells[c]["family"], []).append(c)
    rows = []
    for fam, cells in fams.items():
        best = min(cells, key=lambda c: (_p(tests[c]), -abs(tests[c]["delta"]), c))
        r = tests[best]
        rows.append({"family": fam, "cells": cells, "cell": best, "delta": r["delta"], "p_value": r["p_value"],
                     "base": r["base"], "cell_score": r["cell_score"]})
    rows.sort(key=lambda r: (_p(r), -abs(r["delta"]), r["family"]))
    n_promoted = 0
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
        ok = screen.max_p is None or _p(r) < screen.max_p
        ok = ok and (screen.top_k is None or n_promoted < screen.top_k)
        r["promoted"] = bool(ok)
        n_promoted += ok
    return rows


def _p(r) -> float:
    p = r["p_value"]
    return 1.0 if p is None or (isinstance(p, float) and math.isnan(p)) else float(p)


def run_promote(study, screen_name: str) -> None:
    if screen_name not in study.screens:
        raise StageError(f"{study.path}: screening.{screen_name}: unknown screening")
    screen = study.screens[screen_name]
    s1 = screen.stage_tasks[0]
    metric = screening_metric(study, s1)
    families = rank_families(study, screen_name, _tests(study, s1, screen.cells, metric))
    record = {"screen": screen_name, "task": screen.task, "stage_one_task": s1, "stage_two_task": screen.stage_tasks[1],
              "metric": metric, "rule": {"top_k": screen.top_k, "max_p": screen.max_p,
                                         "order": "p-value, then |delta| (larger first), then family name"},
              "families": families, "promoted": [f["family"] for f in families if f["promoted"]]}
    path = Path(promotion_path(study, screen_name))
    atomic_write_json(path, record)
    print(f"[promote] {screen_name}: {metric} on {s1}; promoted {record['promoted'] or 'nothing'} of "
          f"{[f['family'] for f in families]} -> {path}", flush=True)


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
    write_records("train", _record(study, task, cell, seed), NOT_PROMOTED, study=study.name, task=task, cell=cell,
                  seed=seed)
    print(f"[train] {task}/{cell}/seed{seed}: not promoted, nothing trained", flush=True)


def write_not_promoted_eval(study, task: str, cell: str, seed: int) -> bool:
    """When the checkpoint is a 'not promoted' record, pass it on as the evaluation's outputs."""
    wc = dict(study=study.name, task=task, cell=cell, seed=seed)
    marker = Path(output_path("train", "ckpt", **wc)) / NOT_PROMOTED
    if not marker.is_file():
        return False
    write_records("evaluate", json.loads(marker.read_text()), NOT_PROMOTED, **wc)
    print(f"[evaluate] {task}/{cell}/seed{seed}: not promoted, nothing evaluated", flush=True)
    return True


# --- report: did stage one's conclusions hold? --------------------------------------------------


def held(study, screen_name: str, alpha: float) -> list[dict]:
    """Per family: the stage-one test and rank, promoted or not, and for promoted families the
    stage-two test of the same cell on the full data and whether the stage-one conclusion held
    (same significance at `alpha` and, when significant, the same direction)."""
    screen = study.screens[screen_name]
    path = Path(promotion_path(study, screen_name))
    if not path.is_file():
        raise StageError(f"{path}: missing (run the promote stage for screening {screen_name})")
    record = json.loads(path.read_text())
    s2 = screen.stage_tasks[1]
    cells = [f["cell"] for f in record["families"] if f["promoted"]]
    tests2 = _tests(study, s2, cells, record["metric"]) if cells else {}
    rows = []
    for f in record["families"]:
        r = dict(f, metric=record["metric"])
        t2 = tests2.get(f["cell"])
        r["delta2"] = t2["delta"] if t2 else None
        r["p_value2"] = t2["p_value"] if t2 else None
        if t2:
            sig1, sig2 = _p(f) < alpha, _p(t2) < alpha
            r["held"] = sig1 == sig2 and (not sig1 or (f["delta"] > 0) == (t2["delta"] > 0))
        else:
            r["held"] = None
        rows.append(r)
    return rows
