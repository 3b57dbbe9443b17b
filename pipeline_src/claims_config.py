"""The `claims:` and `references:` sections of a params file, validated and frozen.

A *claim* is a testable statement taken from a paper or report ("removing positional encoding
hurts sharply"), written as one or more comparisons of two cells of one task on one metric with
the expected relation of the cell's value to the other cell's: `higher`, `lower`, or `equal`
within a margin. The claims stage (pipeline_src/report/claims.py) computes the evidence and a
verdict for each.

A *reference* is a published number to set beside ours: a metric value (or, with `versus`, a
difference between two settings, as in Vaswani et al.'s Table 3), its citation, the setting it
was measured in and whether that setting matches ours.

Kept apart from config.py so that the study loader only calls `parse_claims` and
`parse_references`; every error is a one-line ConfigError naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import ConfigError

# Every claim metric is one number per training run (results.csv), compared run against run
# (report/stats.py). Evaluation metrics of each task kind:
EXAMPLE_METRICS = {
    "translation": ("bleu", "test_ppl"),
    "summarization": ("rouge1", "rouge2", "rougeLsum", "test_ppl"),
    "lm": ("test_ppl_word", "test_ppl"),
}
# ... and the training outcome and cost of a run. s_per_mtok: wall seconds per million target
# tokens, the speed of cells whose budgets or batches differ.
RUN_METRICS = ("val_ppl", "best_val_loss", "final_val_loss", "final_train_loss", "tokens_per_s", "wall_s",
               "s_per_mtok", "steps", "mfu", "peak_mem_mb")
# Metrics that are rates, comparable between runs of different lengths; any other metric is
# compared only between cells that saw the same number of target tokens.
BUDGET_FREE_METRICS = ("tokens_per_s", "s_per_mtok", "mfu", "peak_mem_mb")
# Metrics a reference may quote: any evaluation metric of the task kind.
REFERENCE_METRICS = {
    "translation": ("bleu", "chrf", "test_ppl", "val_ppl", "test_loss", "val_loss"),
    # (lead3_*: the Lead-3 baseline scored on the same test rows, for a published Lead-3)
    "summarization": ("rouge1", "rouge2", "rougeLsum", "lead3_rouge1", "lead3_rouge2", "lead3_rougeLsum", "test_ppl",
                      "val_ppl", "test_loss", "val_loss"),
    "lm": ("test_ppl_word", "val_ppl_word", "test_ppl", "val_ppl", "test_loss", "val_loss"),
}
EXPECTATIONS = ("higher", "lower", "equal")


@dataclass(frozen=True)
class Comparison:
    task: str
    cell: str
    versus: str
    metric: str
    expect: str                       # higher | lower | equal: the cell's value against versus's
    margin: float | None = None       # for equal: |difference| allowed, in metric units ...
    margin_pct: float | None = None   # ... or in percent of versus's value


@dataclass(frozen=True)
class Regime:
    """Where a claim is about (e.g. "overfitting regime: >= 20 epochs"); runs outside it do not test it."""
    description: str
    min_epochs: float | None = None
    min_steps: int | None = None


@dataclass(frozen=True)
class Claim:
    name: str
    statement: str
    source: str
    comparisons: tuple[Comparison, ...]
    caveat: str = ""
    regime: Regime | None = None
    failure_is_effect: bool = False


@dataclass(frozen=True)
class Reference:
    task: str
    cell: str
    metric: str
    value: float
    citation: str
    setting: str
    matches_setting: bool
    versus: str | None = None   # value is cell minus versus (a published difference)
    versus_value: float | None = None  # the published value of versus (for a relative difference)
    approximate: bool = False
    note: str = ""


def _task_and_cells(entry: dict, key: str, raw: dict, enabled: dict, where: str, cells_keys: tuple) -> str:

    task = entry["task"]
    if task not in raw["tasks"]:
        raise ConfigError(f"{where}: {key}.task: unknown task {task!r}")
    if task not in enabled:
        raise ConfigError(f"{where}: {key}.task: task {task!r} is disabled (enabled: false); drop the entry")
    for k in cells_keys:
        cell = entry.get(k)
        if cell is not None and cell not in enabled[task].cells:
            raise ConfigError(f"{where}: {key}.{k}: cell {cell!r} is not among task {task}'s cells")
    return task


def parse_claims(raw: dict, tasks: dict, where: str) -> tuple[Claim, ...]:
    """raw: the schema-checked params file; tasks: the enabled TaskConfigs by name."""

    out = []
    for name, c in (raw.get("claims") or {}).items():
        comparisons = []
        for i, comp in enumerate(c["compare"]):
            key = f"claims.{name}.compare.{i}"
            task = _task_and_cells(comp, key, raw, tasks, where, ("cell", "versus"))
            versus = comp.get("versus", tasks[task].baseline_cell)
            if versus == comp["cell"]:
                raise ConfigError(f"{where}: {key}.versus: compares cell {versus!r} with itself")
            kind = tasks[task].kind
            metric = comp["metric"]
            if metric not in EXAMPLE_METRICS[kind] + RUN_METRICS:
                raise ConfigError(f"{where}: {key}.metric: {metric!r} cannot be tested on a {kind} task "
                                  f"(allowed: {', '.join(EXAMPLE_METRICS[kind] + RUN_METRICS)})")
            margin, margin_pct = comp.get("margin"), comp.get("margin_pct")
            if comp["expect"] == "equal" and (margin is None) == (margin_pct is None):
                raise ConfigError(f"{where}: {key}: expect equal needs exactly one of margin, margin_pct")
            if comp["expect"] != "equal" and (margin is not None or margin_pct is not None):
                raise ConfigError(f"{where}: {key}: margin/margin_pct only apply to expect: equal")
            comparisons.append(Comparison(task=task, cell=comp["cell"], versus=versus, metric=metric,
                                          expect=comp["expect"], margin=margin, margin_pct=margin_pct))
        regime = Regime(**c["regime"]) if c.get("regime") else None
        if regime is not None and regime.min_epochs is None and regime.min_steps is None:
            raise ConfigError(f"{where}: claims.{name}.regime: give min_epochs or min_steps (what the study's runs "
                              "must reach to be in the regime)")
        out.append(Claim(name=name, statement=c["statement"], source=c["source"], comparisons=tuple(comparisons),
                         caveat=c.get("caveat", ""), regime=regime,
                         failure_is_effect=bool(c.get("failure_is_effect", False))))
    return tuple(out)


def parse_references(raw: dict, tasks: dict, where: str) -> tuple[Reference, ...]:

    out = []
    for i, r in enumerate(raw.get("references") or []):
        key = f"references.{i}"
        task = _task_and_cells(r, key, raw, tasks, where, ("cell", "versus"))
        kind = tasks[task].kind
        if r["metric"] not in REFERENCE_METRICS[kind]:
            raise ConfigError(f"{where}: {key}.metric: {r['metric']!r} is not a {kind} metric "
                              f"(allowed: {', '.join(REFERENCE_METRICS[kind])})")
        cell = r.get("cell", tasks[task].baseline_cell)
        if r.get("versus") == cell:
            raise ConfigError(f"{where}: {key}.versus: compares cell {cell!r} with itself")
        if r.get("versus_value") is not None and r.get("versus") is None:
            raise ConfigError(f"{where}: {key}.versus_value: only applies to a published difference (give versus)")
        fields: dict[str, Any] = {k: r[k] for k in ("metric", "citation", "setting", "matches_setting")}
        out.append(Reference(task=task, cell=cell, value=float(r["value"]), versus=r.get("versus"),
                             versus_value=None if r.get("versus_value") is None else float(r["versus_value"]),
                             approximate=bool(r.get("approximate", False)), note=r.get("note", ""), **fields))
    return tuple(out)
