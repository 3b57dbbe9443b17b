"""The `claims:` and `references:` sections of a params file, validated and frozen.

A *claim* is a testable statement taken from a paper or report ("removing positional encoding
hurts sharply"), written as one or more comparisons of two cells of one task on one metric with
the expected relation of the cell's value to the other cell's: `higher`, `lower`, or `equal`
within a margin. The claims stage (pipeline_src/report/claims.py) computes the evidence and a
verdict for each. A claim names its `origin` (a seed report, the literature, or a test) and a
claim of a seed report or of the literature quotes the sentence(s) it rests on, whole, so that
a reader can check that the statement says no more than its source. A *check* (`check: true`)
is the study's own test of the pipeline, attributed to no source and judged apart from the
claims.

A *reference* is a published number to set beside ours: a metric value (or, with `versus`, a
difference between two settings, as in Vaswani et al.'s Table 3), its citation, the setting it
was measured in and whether that setting matches ours.

Kept apart from config.py so that the study loader only calls `parse_claims` and
`parse_references`; every error is a one-line ConfigError naming the key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..common import ConfigError

# Every claim metric is one number per training run (results.csv), compared run against run
# (report/stats.py). Evaluation metrics of each task kind:
EXAMPLE_METRICS = {
    "translation": ("bleu", "test_ppl"),
    "summarization": ("rouge1", "rouge2", "rougeLsum", "test_ppl"),
    "lm": ("test_ppl_word", "test_ppl"),
}
# ... and the training outcome and cost of a run. s_per_mtok: wall seconds per million target
# tokens, the speed of cells whose budgets or batches differ.
# train_flops_per_tgt_token: the training FLOPs of the run's real batches per target token, and
# processed_tokens_per_step: source and target tokens a step put through the model (both counted
# by the trainer, so a busy machine does not move them as it moves wall time).
RUN_METRICS = ("val_ppl", "best_val_loss", "final_val_loss", "final_train_loss", "tokens_per_s", "wall_s",
               "s_per_mtok", "steps", "mfu", "peak_mem_mb", "train_flops_per_tgt_token", "processed_tokens_per_step")
# Metrics that are rates, comparable between runs of different lengths; any other metric is
# compared only between cells that saw the same number of target tokens.
BUDGET_FREE_METRICS = ("tokens_per_s", "s_per_mtok", "mfu", "peak_mem_mb", "train_flops_per_tgt_token",
                       "processed_tokens_per_step")
# Metrics a reference may quote: any evaluation metric of the task kind.
REFERENCE_METRICS = {
    "translation": ("bleu", "chrf", "test_ppl", "val_ppl", "test_loss", "val_loss"),
    # (lead3_*: the Lead-3 baseline scored on the same test rows, for a published Lead-3)
    "summarization": ("rouge1", "rouge2", "rougeLsum", "lead3_rouge1", "lead3_rouge2", "lead3_rougeLsum", "test_ppl",
                      "val_ppl", "test_loss", "val_loss"),
    "lm": ("test_ppl_word", "val_ppl_word", "test_ppl", "val_ppl", "test_loss", "val_loss"),
}
EXPECTATIONS = ("higher", "lower", "equal")
ORIGINS = ("seed", "literature", "test")
QUOTED_ORIGINS = ("seed", "literature")
# A seed report is cited as "seed NNN, section X" or "seed NNN, ... Table N": the report and the
# place in it, so that the sentence can be found.
_SEED_WHERE = re.compile(r"^seed \d{3}\b")
_SEED_PLACE = re.compile(r"\b(section|table)\b", re.IGNORECASE)
# CJK ideographs and punctuation, full-width forms: a quote with any needs its English translation.
_NOT_ENGLISH = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]")


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
class Quote:
    """A source's sentence, whole: the original, its English translation ('' when the original is
    English) and where it stands ("seed 003, section 6.4.1, Table 7")."""
    text: str
    where: str
    translation: str = ""

    @property
    def english(self) -> str:
        return self.translation or self.text


@dataclass(frozen=True)
class Claim:
    name: str
    statement: str
    source: str
    comparisons: tuple[Comparison, ...]
    caveat: str = ""
    regime: Regime | None = None
    failure_is_effect: bool = False
    origin: str = ""                  # seed | literature | test; '' for a check
    quotes: tuple[Quote, ...] = ()
    check: bool = False


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
        check = bool(c.get("check", False))
        origin, quotes = _origin_and_quotes(c, f"claims.{name}", where, check)
        out.append(Claim(name=name, statement=c["statement"], source=c["source"], comparisons=tuple(comparisons),
                         caveat=c.get("caveat", ""), regime=regime,
                         failure_is_effect=bool(c.get("failure_is_effect", False)),
                         origin=origin, quotes=quotes, check=check))
    return tuple(out)


def _origin_and_quotes(c: dict, key: str, where: str, check: bool) -> tuple[str, tuple[Quote, ...]]:
    """The claim's origin and quotes, with the rules the schema cannot state: a claim of a seed
    report quotes a seed report (by report and section or table), one of the literature quotes
    no seed report, and a quote in another language than English carries its translation."""
    origin = c.get("origin", "")
    if check and origin:
        raise ConfigError(f"{where}: {key}.origin: a check (check: true) tests this pipeline and is no source's "
                          "claim; drop origin")
    if not check and origin not in ORIGINS:
        raise ConfigError(f"{where}: {key}.origin: give one of {', '.join(ORIGINS)}")
    raw = c.get("quote")
    if raw is None and origin in QUOTED_ORIGINS:
        raise ConfigError(f"{where}: {key}.quote: a claim of origin {origin} quotes its source sentence whole "
                          "({text, translation, where})")
    items = [] if raw is None else ([(f"{key}.quote", raw)] if isinstance(raw, dict) else
                                    [(f"{key}.quote.{i}", q) for i, q in enumerate(raw)])
    quotes = []
    for qkey, q in items:
        text, place = q["text"].strip(), q["where"].strip()
        if _NOT_ENGLISH.search(text) and not q.get("translation", "").strip():
            raise ConfigError(f"{where}: {qkey}.translation: the quote is not in English; give its English "
                              "translation")
        from_seed = bool(_SEED_WHERE.match(place))
        if from_seed and not _SEED_PLACE.search(place):
            raise ConfigError(f"{where}: {qkey}.where: {place!r}: name the section or table of the seed report "
                              "('seed 003, section 6.4.1, Table 7')")
        if origin == "literature" and from_seed:
            raise ConfigError(f"{where}: {qkey}.where: {place!r}: a claim of origin literature is not a seed "
                              "report's; quote the paper, or make the origin seed")
        quotes.append(Quote(text=text, where=place, translation=q.get("translation", "").strip()))
    if origin == "seed" and not any(_SEED_WHERE.match(q.where) for q in quotes):
        raise ConfigError(f"{where}: {key}.quote: a claim of origin seed quotes a seed report (where: "
                          "'seed NNN, section ...')")
    return origin, tuple(quotes)


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
