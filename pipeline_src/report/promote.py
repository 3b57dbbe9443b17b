"""Stage `promote`: a screening's stage-one families ranked, and which of them stage two runs
(the rule: pipeline_src/study/screening.py); and, for the tables stage, whether stage one's
conclusions held on stage two's full data.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..common import StageError, atomic_write_json
from ..study.paths import promotion_path
from . import PRIMARY
from .aggregate import RunOutputs, paired_test


def screening_metric(study, task: str) -> str:
    return PRIMARY[study.task(task).kind]


def _tests(study, task: str, cells, metric: str) -> dict[str, dict]:
    """Pooled paired test of each cell against the task's baseline on `metric`."""
    t = study.task(task)
    out = RunOutputs(study)
    n = study.cell(task, t.baseline_cell).eval.bootstrap
    return {c: paired_test(out, task, t.kind, t.baseline_cell, c, list(study.seeds), metric, n, {})
            for c in cells if c != t.baseline_cell}


def rank_families(study, screen_name: str, tests: dict[str, dict]) -> list[dict]:
    """Families of a screening, ranked and marked promoted (deterministic; see module doc)."""
    screen = study.screens[screen_name]
    fams: dict[str, list[str]] = {}
    for c in screen.cells[1:]:
        fams.setdefault(study.cells[c]["family"], []).append(c)
    rows = []
    for fam, cells in fams.items():
        best = min(cells, key=lambda c: (_p_or_one(tests[c]), -abs(tests[c]["delta"]), c))
        r = tests[best]
        rows.append({"family": fam, "cells": cells, "cell": best, "delta": r["delta"], "p_value": r["p_value"],
                     "base": r["base"], "cell_score": r["cell_score"]})
    rows.sort(key=lambda r: (_p_or_one(r), -abs(r["delta"]), r["family"]))
    n_promoted = 0
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
        ok = screen.max_p is None or _p_or_one(r) < screen.max_p
        ok = ok and (screen.top_k is None or n_promoted < screen.top_k)
        r["promoted"] = bool(ok)
        n_promoted += ok
    return rows


def _p_or_one(r) -> float:
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
            sig1, sig2 = _p_or_one(f) < alpha, _p_or_one(t2) < alpha
            r["held"] = sig1 == sig2 and (not sig1 or (f["delta"] > 0) == (t2["delta"] > 0))
        else:
            r["held"] = None
        rows.append(r)
    return rows
