"""Adaptive seeds (params `seeds: {min, max}`): more runs only where a claim needs them.

Every cell runs seeds 0..min-1. The `plan` stage then judges the study's claims on those runs
(report/claims.py, with the error rate of two looks: each look at alpha/2) and gives seeds
min..max-1 to both cells of every comparison that is

  * tested (not set aside for a failed run, an unequal budget or the claim's regime),
  * not settled (inconclusive after Holm's correction), and
  * within reach: a paired test at the observed effect and spread would need at most `max`
    runs per cell for 80 % power (a comparison that would need more gets none: extra runs
    would be spent without settling it).

The second look always has exactly `max` runs, whatever the first look saw, so testing each
look at alpha/2 bounds the chance of a wrong verdict by alpha (Bonferroni over looks) for any
rule that decides to continue; tests/test_calibration.py measures it on an A/A design.

The DAG is static for both drivers (DVC has no dynamic stages): every seed's jobs exist, the
jobs of seeds >= min depend on the plan, and a job the plan did not ask for writes an explicit
"not needed" record in place of its outputs (as the stage-two jobs of a screening do).

data/<study>/plan/seeds.json   the first round's comparisons, the decision for each, and the
                               cells given the extra seeds (written by report/plan.py).
This module reads the seed plan that the `plan` stage writes: which seeds a cell has runs for,
and the jobs the plan did not ask for.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from ..common import StageError
from .paths import output_path, write_skipped_eval, write_skipped_train

NOT_NEEDED = "NOT_NEEDED.json"


def plan_path(study) -> Path:
    return Path(output_path("plan", "plan", study=study.name))


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int) -> dict:
    return json.loads(Path(path).read_text())


def load_plan(study) -> dict:
    path = plan_path(study)
    if not path.is_file():
        raise StageError(f"{path}: missing; run `python -m pipeline_src plan --params {study.path}` after the "
                         f"first {len(study.first_seeds)} seeds of every cell (adaptive seeds)")
    return _read(str(path), path.stat().st_mtime_ns)


def run_seeds(study, task: str, cell: str) -> tuple[int, ...]:
    """The seeds `task`/`cell` has runs for: every seed, or with adaptive seeds the first round
    plus those the plan gave it (the plan must exist)."""
    if not study.adaptive_seeds:
        return study.seeds
    extended = {(e["task"], e["cell"]) for e in load_plan(study)["extend"]}
    return study.seeds if (task, cell) in extended else study.first_seeds


def needed(study, task: str, cell: str, seed: int) -> bool:
    """Whether the job of task/cell/seed trains (always, but for an adaptive seed beyond the first
    round that the plan did not give this cell)."""
    return seed in study.first_seeds or seed in run_seeds(study, task, cell)


def _record(study, task, cell, seed) -> dict:
    return {"task": task, "cell": cell, "seed": seed, "needed": False,
            "reason": f"adaptive seeds: the plan ({plan_path(study)}) gave {task}/{cell} no seeds beyond "
                      f"{len(study.first_seeds)}"}


def write_not_needed_train(study, task: str, cell: str, seed: int) -> None:
    """The training job's declared outputs, holding a 'not needed' record instead of a model."""
    write_skipped_train(study, task, cell, seed, NOT_NEEDED, _record(study, task, cell, seed),
                        "not needed by the seed plan")


def write_not_needed_eval(study, task: str, cell: str, seed: int) -> bool:
    """When the checkpoint is a 'not needed' record, pass it on as the evaluation's outputs."""
    return write_skipped_eval(study, task, cell, seed, NOT_NEEDED, "not needed by the seed plan")


