"""Claims stage: the study's claims tested on its runs, and its results set beside published ones.

reports/<study>/claims.csv      one row per comparison of every claim (params `claims:`): its
                                 kind (claim, or check: the study's own test of the pipeline),
                                 origin (seed, literature, test) and the source sentences it
                                 rests on (quote: the original and where it stands; quote_en:
                                 the English, which the report prints), the
                                 evidence (ci_lo/ci_hi: the 95 % interval beside the unadjusted
                                 p_value; sim_ci_lo/sim_ci_hi: the simultaneous interval at
                                 confidence sim_ci_level = 1 - alpha/m beside the Holm-adjusted
                                 p_adjusted; seeds_agree: "k/n" of the per-seed differences on
                                 the predicted side, within the margin for "equal"; p_permutation:
                                 the exact sign-flip permutation p of a zero mean difference, from
                                 6 runs, unadjusted, deciding nothing), the verdict and why, the
                                 runs that would settle it, and the claim's verdict in that
                                 comparison's task.
reports/<study>/references.csv  one row per published number (params `references:`) with ours
                                 beside it and the difference (relative where scales differ).

A comparison "cell against versus on metric" (effect = cell minus versus) is judged on training
runs: run s of the cell against run s of versus, one number each (results.csv: the run's corpus
BLEU, test perplexity, ROUGE, wall time ...), the per-seed differences tested with a paired
t-test (directional claims) or two one-sided tests (claims of equality within a margin, against
the one-sided test of a difference beyond it, each at half the level), and
the p-values corrected with Holm's method over all the study's claim comparisons (and for
adaptive seeds, Bonferroni over the two looks); report/stats.py says why each choice. Checks
(`check: true`) are corrected over the checks alone: a check that cannot fail would otherwise
be a free rejection that eases Holm's later steps for the real claims, and a check's outcome
(passed / failed) is no verdict on anyone's claim.

Before any test, a comparison is set aside, with the reason as its verdict, when
  * its runs are outside the claim's regime (`regime: {min_epochs | min_steps}`):
    "not tested in the claim's regime";
  * a run of either cell failed to train (aggregate stage: validation loss near the unigram
    level, non-finite, or diverged) - unless the claim says that the cell's failure is the
    effect it predicts (`failure_is_effect`): "not tested: run failed to train";
  * the two cells saw different numbers of target tokens (more than 5 % apart) and the metric
    is not a rate: "not tested: unequal training budgets";
  * fewer than stats.MIN_RUNS runs pair up: "too few runs".
Otherwise: expect higher/lower -> supported (adjusted p < alpha, effect on the expected side),
contradicted (adjusted p < alpha, the other side) or inconclusive; expect equal -> supported
(equivalent within the margin), contradicted (different beyond it) or inconclusive. An
inconclusive comparison gets the runs a paired test would need for 80 % power at the observed
effect and spread. A verdict whose runs include some that had not converged (validation still
improving at their end; results.csv `converged`) says it holds "at this budget", and how many. A claim's verdict is given per task; no task overrides another.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..common import StageError, atomic_write_text
from ..study.claims_config import BUDGET_FREE_METRICS
from ..study.paths import output_path, tune_record
from . import (FAILED_FRACTION, display_name, fmt_num, latex_escape as esc, metric_digits, read_csv, read_json,
               report_paths)
from . import stats
from .stats import ALPHA, MIN_RUNS

CLAIM_COLUMNS = ["claim", "kind", "origin", "statement", "source", "quote", "quote_en", "caveat", "regime", "task",
                 "task_verdict", "task_reason", "metric",
                 "cell", "cell_label", "versus", "versus_label", "expect", "margin", "n_runs", "seeds",
                 "versus_value", "cell_value", "delta", "rel_delta_pct", "sd", "ci_lo", "ci_hi", "p_value", "looks",
                 "p_adjusted", "sim_ci_level", "sim_ci_lo", "sim_ci_hi", "test", "seeds_agree", "p_permutation",
                 "runs_needed", "verdict", "reason"]
REFERENCE_COLUMNS = ["task", "cell", "cell_label", "versus", "versus_label", "metric", "ours", "ours_std",
                     "n_seeds", "published", "difference", "ours_rel_pct", "published_rel_pct", "same_sign",
                     "approximate", "matches_setting", "setting", "citation", "note"]
TESTED = ("supported", "contradicted", "inconclusive")
NOT_IN_REGIME = "not tested in the claim's regime"
RUN_FAILED = "not tested: run failed to train"
UNEQUAL_BUDGET = "not tested: unequal training budgets"
FAILED_AT_ONE_LR = "not tested: failure not shown at every lr"
TOO_FEW = "too few runs"
VERDICTS = TESTED + (TOO_FEW, RUN_FAILED, FAILED_AT_ONE_LR, UNEQUAL_BUDGET, NOT_IN_REGIME)
# A check's outcome in place of a claim's verdict (inconclusive and the set-aside reasons stay).
CHECK_OUTCOME = {"supported": "passed", "contradicted": "failed"}
CHECK_OUTCOMES = ("passed", "failed", "inconclusive") + VERDICTS[len(TESTED):]
QUOTE_SEPARATOR = " || "  # not " | ", which a quoted table row uses between its cells
BUDGET_TOLERANCE = 0.05  # target tokens of two cells further apart than this are unequal budgets
# Display names of the per-run metrics a claim may use (the evaluation metrics have theirs in METRICS).
RUN_METRIC_NAMES = {"wall_s": "Training time (s)", "tokens_per_s": "Target tokens/s", "best_val_loss": "Best val loss",
                    "final_val_loss": "Final val loss", "final_train_loss": "Final train loss", "val_ppl": "Val PPL",
                    "steps": "Steps", "mfu": "MFU", "peak_mem_mb": "Peak memory (MB)",
                    "s_per_mtok": "s per M target tokens", "train_flops_per_tgt_token": "Training FLOPs per target token",
                    "processed_tokens_per_step": "Tokens processed per step"}


def looks(study) -> int:
    """How many times a comparison may be looked at: twice with adaptive seeds (after the first
    round and after the last), else once."""
    return 2 if study.adaptive_seeds else 1


# --- one comparison ------------------------------------------------------------------------------


def _paired(results: pd.DataFrame, comp) -> pd.DataFrame:
    """The seeds both cells have a run for, one row each: <col>_c and <col>_v of the metric and of
    the columns the checks read (failure flag, budget, epochs, steps)."""
    rows = results[results["task"] == comp.task]
    if comp.metric not in rows or rows[comp.metric].isna().all():
        raise StageError(f"results.csv: column {comp.metric} missing for task {comp.task}")
    cols = list(dict.fromkeys(c for c in (comp.metric, "failed", "failure", "train_tokens", "epochs_seen", "steps",
                                          "converged") if c in rows))
    cell = rows[rows["cell"] == comp.cell].set_index("seed")[cols]
    versus = rows[rows["cell"] == comp.versus].set_index("seed")[cols]
    return pd.merge(cell, versus, left_index=True, right_index=True, suffixes=("_c", "_v")).sort_index()


def _flag(both: pd.DataFrame, side: str, col: str, default=None):
    key = f"{col}_{side}"
    return both[key] if key in both else pd.Series(default, index=both.index)


def _trains_at_another_lr(study, task: str, cell: str) -> str:
    """Why a failed cell's failure is not shown at every learning rate ('' when it is): it has no
    lr grid, or one of its tune trials trained (best validation loss under the failure level)."""
    grid = study.cell(task, cell).train.lr_grid
    if not grid:
        return (f"{cell} failed at its one learning rate ({study.cell(task, cell).train.lr:g}); give it a "
                f"train.lr_grid so that a failure at every lr can count as the predicted effect")
    record = read_json(tune_record(study, task, cell))
    trained = [t for t in record["trials"]
               if t["best_val_loss"] < FAILED_FRACTION * t["unigram_val_loss"]]
    if trained:
        return (f"{cell} trained in its tune trial at lr {trained[0]['lr']:g} (validation loss "
                f"{trained[0]['best_val_loss']:.2f}, unigram {trained[0]['unigram_val_loss']:.2f}), so its runs' "
                f"failure is not the predicted effect")
    return ""


def _at_this_budget(both: pd.DataFrame) -> str:
    """What a verdict adds when some of its runs were still improving at their end (study/convergence.py)."""
    flags = [str(v).lower() for side in ("c", "v") for v in _flag(both, side, "converged", None)]
    n_not = flags.count("false")
    return (f"; at this budget: {n_not} of the {len(flags)} runs compared had not converged (validation still "
            f"improving when they ended)") if n_not else ""


def _set_aside(study, claim, comp, both: pd.DataFrame) -> tuple[str, str] | None:
    """(verdict, reason) when the comparison is not tested, else None (see module doc)."""
    regime = claim.regime
    if regime is not None:
        for what, col, need in (("epochs", "epochs_seen", regime.min_epochs), ("steps", "steps", regime.min_steps)):
            if need is None:
                continue
            seen = pd.to_numeric(pd.concat([_flag(both, "c", col), _flag(both, "v", col)]), errors="coerce")
            if seen.isna().all() or seen.min() < need:
                got = "unknown" if seen.isna().all() else f"{seen.min():.3g}"
                return NOT_IN_REGIME, (f"the claim is about {regime.description} (>= {need:g} {what}); these runs "
                                       f"saw {got}")
    failed = []
    for side, cell in (("c", comp.cell), ("v", comp.versus)):
        if side == "c" and claim.failure_is_effect:
            if _flag(both, side, "failed", False).map(_is_true).any():
                why = _trains_at_another_lr(study, comp.task, cell)
                if why:
                    return FAILED_AT_ONE_LR, why
            continue
        flags = _flag(both, side, "failed", False).map(_is_true)
        reasons = _flag(both, side, "failure", "")
        failed += [f"{cell}/seed{s} ({reasons[s]})" for s in both.index[flags.to_numpy()]]
    if failed:
        return RUN_FAILED, "failed to train: " + "; ".join(failed)
    if comp.metric not in BUDGET_FREE_METRICS and "train_tokens_c" in both:
        tokens_cell = pd.to_numeric(both["train_tokens_c"], errors="coerce").mean()
        tokens_versus = pd.to_numeric(both["train_tokens_v"], errors="coerce").mean()
        if (tokens_cell > 0 and tokens_versus > 0
                and abs(tokens_cell - tokens_versus) / max(tokens_cell, tokens_versus) > BUDGET_TOLERANCE):
            return UNEQUAL_BUDGET, (f"{comp.cell} saw {tokens_cell / 1e6:.3g}M target tokens, "
                                    f"{comp.versus} {tokens_versus / 1e6:.3g}M "
                                    "(give both the same train.max_target_tokens, or compare a rate such as "
                                    "s_per_mtok)")
    if len(both) < MIN_RUNS:
        return TOO_FEW, (f"{len(both)} paired run(s); a verdict needs >= {MIN_RUNS} (a paired t over runs; "
                         "report/stats.py)")
    return None


def _evidence(expect: str, c: np.ndarray, v: np.ndarray, margin) -> dict:
    """The test of one comparison from the paired runs' values (c[i] and v[i]: the same seed)."""
    d = c - v
    t = stats.paired_t(d)
    ev = {"n_runs": len(d), "versus_value": float(v.mean()) if len(v) else np.nan,
          "cell_value": float(c.mean()) if len(c) else np.nan, "delta": t["mean"], "sd": t["sd"], "ci_lo": t["ci_lo"],
          "ci_hi": t["ci_hi"], "p_value": t["p"], "per_seed": d, "p_permutation": stats.sign_flip_p(d),
          "test": f"paired t over {len(d)} runs (df {len(d) - 1}), two-sided"}
    if expect == "equal":
        eq = stats.equivalence(c, v, margin)
        ev["p_inside"], ev["p_outside"], ev["side"] = eq["p_inside"], eq["p_outside"], eq["side"]
        ev["p_value"] = eq["p"]
        ev["test"] = (f"two one-sided paired t-tests (TOST) over {len(d)} runs for |delta| < {margin:.3g}, "
                      f"and the one-sided test of |delta| > {margin:.3g}, each at alpha/2 (p: twice the smaller)")
    return ev


def _simultaneous(deltas, alpha_family: float) -> dict:
    """The interval that goes beside a Holm-adjusted p: Student-t at confidence 1 - alpha/m over the
    m comparisons x looks of the family (Bonferroni), so that the intervals of all comparisons
    hold together with probability >= 1 - alpha, as the verdicts do. A comparison whose interval
    excludes a value is rejected there by Holm too (Holm's first step is Bonferroni's; later steps
    are less strict)."""
    level = 1 - alpha_family
    t = stats.paired_t(deltas, confidence=level)
    return {"sim_ci_level": level, "sim_ci_lo": t["ci_lo"], "sim_ci_hi": t["ci_hi"]}


def _decide(expect: str, ev: dict, p_adj: float, margin, alpha_runs: float | None) -> tuple[str, str, float]:
    """(verdict, reason, runs needed) of a tested comparison; alpha_runs None: runs needed not computed."""
    if expect == "equal":
        if p_adj < ALPHA:
            inside = ev["side"] == "inside"
            return (("supported", f"equivalent within +-{margin:.3g} (adjusted p {p_adj:.2g})", np.nan) if inside else
                    ("contradicted", f"different by more than {margin:.3g} (adjusted p {p_adj:.2g})", np.nan))
        need = np.nan if alpha_runs is None else stats.runs_needed_equivalence(ev["delta"], ev["sd"], margin, alpha_runs)
    else:
        if p_adj < ALPHA:
            on_side = (ev["delta"] > 0) == (expect == "higher")
            where = "the expected" if on_side else "the opposite"
            return ("supported" if on_side else "contradicted",
                    f"adjusted p {p_adj:.2g} < {ALPHA}, effect on {where} side", np.nan)
        need = np.nan if alpha_runs is None else stats.runs_needed(ev["delta"], ev["sd"], alpha_runs)
    if math.isnan(need):
        return "inconclusive", f"adjusted p {p_adj:.2g} >= {ALPHA}", need
    if math.isinf(need):
        if expect == "equal" and abs(ev["delta"]) >= margin:
            why = "the observed difference is at or beyond the margin: more runs would not show equivalence"
        elif expect != "equal" and abs(ev["delta"]) < 1e-12:
            why = "no difference was seen: more runs would not settle it"
        else:
            why = f"more than {stats.MAX_RUNS_REPORTED} runs per cell would be needed at this effect and spread"
        return "inconclusive", f"adjusted p {p_adj:.2g} >= {ALPHA}; {why}", need
    return "inconclusive", (f"adjusted p {p_adj:.2g} >= {ALPHA}; ~{stats.fmt_runs(need)} runs per cell would settle "
                            "it at 80 % power"), need


def _task_verdict(verdicts: list[str]) -> tuple[str, str]:
    """A claim's verdict in one task from its comparisons there (all must hold)."""
    if "contradicted" in verdicts:
        return "contradicted", f"{verdicts.count('contradicted')} of {len(verdicts)} comparisons contradicted"
    if all(v == "supported" for v in verdicts):
        return "supported", f"all {len(verdicts)} comparison(s) supported"
    if len(set(verdicts)) == 1:
        return verdicts[0], ""
    return "inconclusive", (f"{verdicts.count('supported')} of {len(verdicts)} comparisons supported, the rest: "
                            + ", ".join(sorted(set(v for v in verdicts if v != "supported"))))


def evaluate_claims(study, results: pd.DataFrame) -> pd.DataFrame:
    """Every claim comparison of the study judged on the runs in `results` (results.csv rows)."""
    labels = {(r["task"], r["cell"]): r["label"] for r in results.to_dict("records")}
    n_looks = looks(study)
    rows, evidence = [], []
    for claim in study.claims:
        for comp in claim.comparisons:
            both = _paired(results, comp)
            v_mean = pd.to_numeric(_flag(both, "v", comp.metric), errors="coerce").mean() if len(both) else np.nan
            margin = comp.margin if comp.margin is not None else (
                None if comp.margin_pct is None else comp.margin_pct / 100 * abs(v_mean))
            row = {"claim": claim.name, "kind": "check" if claim.check else "claim", "origin": claim.origin,
                   "quote": QUOTE_SEPARATOR.join(f'{q.where}: "{q.text}"' for q in claim.quotes),
                   "quote_en": QUOTE_SEPARATOR.join(f'{q.where}: "{q.english}"' for q in claim.quotes),
                   "statement": claim.statement, "source": claim.source, "caveat": claim.caveat,
                   "regime": claim.regime.description if claim.regime else "", "task": comp.task,
                   "metric": comp.metric, "cell": comp.cell, "cell_label": labels.get((comp.task, comp.cell), comp.cell),
                   "versus": comp.versus, "versus_label": labels.get((comp.task, comp.versus), comp.versus),
                   "expect": comp.expect, "margin": margin, "looks": n_looks}
            ev = (_evidence(comp.expect, both[f"{comp.metric}_c"].astype(float).to_numpy(),
                            both[f"{comp.metric}_v"].astype(float).to_numpy(), margin)
                  if len(both) else {"n_runs": 0, "per_seed": []})
            ev["seeds"] = ",".join(str(int(s)) for s in both.index)
            row.update({k: v for k, v in ev.items() if k in CLAIM_COLUMNS})
            row["seeds_agree"] = "{}/{}".format(*stats.sign_consistency(ev["per_seed"], comp.expect, margin))
            aside = _set_aside(study, claim, comp, both)
            if aside:
                row["verdict"], row["reason"] = aside
            rows.append(row)
            evidence.append((comp, ev, margin, both))
    for kind in ("claim", "check"):  # two Holm families: the claims, and apart from them the checks
        tested = [i for i, r in enumerate(rows) if "verdict" not in r and r["kind"] == kind]
        raw = [min(1.0, rows[i]["p_value"] * n_looks) for i in tested]
        adjusted = stats.holm(raw) if tested else []
        alpha_runs = ALPHA / max(1, len(tested)) / n_looks  # Holm's strictest step
        for i, p_adj in zip(tested, adjusted):
            comp, ev, margin, both = evidence[i]
            rows[i]["p_adjusted"] = float(p_adj)
            rows[i].update(_simultaneous(ev["per_seed"], alpha_runs))
            rows[i]["verdict"], rows[i]["reason"], rows[i]["runs_needed"] = _decide(comp.expect, ev, float(p_adj),
                                                                                    margin, alpha_runs)
            rows[i]["reason"] += _at_this_budget(both)
    frame = pd.DataFrame(rows, columns=CLAIM_COLUMNS)
    frame[["task_verdict", "task_reason"]] = frame[["task_verdict", "task_reason"]].astype(object)
    for (claim, task), group in frame.groupby(["claim", "task"], sort=False):
        frame.loc[group.index, ["task_verdict", "task_reason"]] = _task_verdict(list(group["verdict"]))
    checks = frame["kind"] == "check"
    for col in ("verdict", "task_verdict", "task_reason"):
        frame.loc[checks, col] = frame.loc[checks, col].replace(CHECK_OUTCOME, regex=col == "task_reason")
    frame["rel_delta_pct"] = 100 * frame["delta"] / frame["versus_value"].abs()
    return frame


def judge_alone(expect: str, cell_values, versus_values, margin: float | None = None, n_looks: int = 1,
                runs_needed: bool = True) -> dict:
    """One comparison judged as if it were its study's only claim comparison (Holm over one test):
    the engine of evaluate_claims without the tables around it (tests/test_calibration.py)."""
    c, v = np.asarray(cell_values, dtype=np.float64), np.asarray(versus_values, dtype=np.float64)
    if len(c) < MIN_RUNS:
        return {"verdict": TOO_FEW, "runs_needed": np.nan, "p_adjusted": np.nan}
    ev = _evidence(expect, c, v, margin)
    p_adj = min(1.0, ev["p_value"] * n_looks)
    verdict, reason, need = _decide(expect, ev, p_adj, margin, ALPHA / n_looks if runs_needed else None)
    return {"verdict": verdict, "reason": reason, "runs_needed": need, "p_adjusted": p_adj,
            **_simultaneous(ev["per_seed"], ALPHA / n_looks)}


def compare_references(study, results: pd.DataFrame) -> pd.DataFrame:
    """Every published number beside ours: the mean over our runs (over the seeds both cells ran
    for a published difference), and where the published value of the compared-against setting is
    known, both differences in percent of their own scale."""
    paths = report_paths(study)
    rows = []
    for ref in study.references:
        task_rows = results[results["task"] == ref.task]
        if ref.metric not in task_rows or task_rows[ref.metric].isna().all():
            raise StageError(f"{paths['results']}: column {ref.metric} missing for task {ref.task} "
                             f"(named by a reference to {ref.citation!r})")
        by = task_rows.set_index(["cell", "seed"])[ref.metric].astype(float)
        label = dict(zip(task_rows["cell"], task_rows["label"]))
        seeds = sorted(task_rows.loc[task_rows["cell"] == ref.cell, "seed"])
        if ref.versus is not None:
            seeds = [s for s in seeds if (ref.versus, s) in by.index]
        values = np.array([by[(ref.cell, s)] for s in seeds])
        base = np.array([by[(ref.versus, s)] for s in seeds]) if ref.versus is not None else None
        if base is not None:
            values = values - base
        ours = float(values.mean()) if len(values) else np.nan
        same_sign = (None if ref.versus is None else
                     bool(np.sign(round(ours, 9)) == np.sign(round(ref.value, 9))))
        ours_rel = 100 * ours / abs(base.mean()) if base is not None and len(base) else np.nan
        pub_rel = 100 * ref.value / abs(ref.versus_value) if ref.versus_value else np.nan
        rows.append({"task": ref.task, "cell": ref.cell, "cell_label": label.get(ref.cell, ref.cell),
                     "versus": ref.versus, "versus_label": label.get(ref.versus, ref.versus) if ref.versus else None,
                     "metric": ref.metric, "ours": ours,
                     "ours_std": float(values.std(ddof=1)) if len(values) > 1 else np.nan,
                     "n_seeds": len(values), "published": ref.value, "difference": ours - ref.value,
                     "ours_rel_pct": ours_rel, "published_rel_pct": pub_rel,
                     "same_sign": same_sign, "approximate": ref.approximate, "matches_setting": ref.matches_setting,
                     "setting": ref.setting, "citation": ref.citation, "note": ref.note})
    return pd.DataFrame(rows, columns=REFERENCE_COLUMNS)


# --- stage entry ---------------------------------------------------------------------------------


def _csv(frame: pd.DataFrame) -> str:
    return frame.to_csv(index=False, float_format="%.6g", lineterminator="\n")


def _paths(study):
    return (Path(output_path("claims", "claims", study=study.name)),
            Path(output_path("claims", "references", study=study.name)))


def run(study) -> None:
    paths = report_paths(study)
    results = read_csv(paths["results"])
    claims = evaluate_claims(study, results)
    refs = compare_references(study, results)
    claims_path, refs_path = _paths(study)
    # Both computed before either is written: a failure leaves the old outputs intact.
    atomic_write_text(claims_path, _csv(claims))
    atomic_write_text(refs_path, _csv(refs))
    print(f"[claims] {claims_summary(claims, latex=False)} {len(refs)} published "
          f"references: {claims_path.parent}", flush=True)


# --- LaTeX (used by the report stage) ------------------------------------------------------------


def _p_text(p) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "--"
    return "$<$0.001" if p < 0.001 else f"{p:.3f}"


def _signed(x, digits: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "--"
    return ("$+$" if x >= 0 else "$-$") + fmt_num(abs(x), digits)


_VERDICT_COLOUR = {"supported": "green!45!black", "contradicted": "red!70!black", "inconclusive": "black!60",
                   "passed": "green!45!black", "failed": "red!70!black"}


def verdict_tex(verdict: str) -> str:
    return rf"\textcolor{{{_VERDICT_COLOUR.get(verdict, 'black!60')}}}{{{esc(verdict)}}}"


def _runs_needed(x) -> str:
    if _missing(x) or str(x) == "":
        return "--"
    return esc(stats.fmt_runs(float(x)))


def _kind(frame: pd.DataFrame) -> pd.Series:
    """Each row's kind; claims.csv written before checks existed has no column: all claims."""
    return frame["kind"] if "kind" in frame else pd.Series("claim", index=frame.index)


_ORIGIN_LABEL = {"seed": "seed report", "literature": "literature", "test": "test"}


def _header(first, per_task: str) -> str:
    """A claim's or check's header row: statement, origin and source, the sentences it rests on
    (in English: the template's pdflatex loads no CJK fonts, so a seed report's Chinese original
    stays in claims.csv, column quote), its verdict in each task, caveat and regime."""
    origin = first.get("origin") if isinstance(first.get("origin"), str) else ""
    label = _ORIGIN_LABEL.get(origin, origin)
    head = (r"\textbf{" + esc(first["statement"]) + r"} \textit{(" + (esc(label) + ": " if label else "")
            + esc(first["source"]) + r")} --- " + per_task)
    quotes = first.get("quote_en")
    if isinstance(quotes, str) and quotes:
        head += r". \emph{Source:} " + "; ".join(esc(q) for q in quotes.split(QUOTE_SEPARATOR))
    for key, word in (("regime", "Regime"), ("caveat", "Caveat")):
        if isinstance(first.get(key), str) and first[key]:
            head += rf". \emph{{{word}:}} {esc(first[key])}"
    return r"\multicolumn{9}{@{}p{\linewidth}@{}}{\rule{0pt}{2.6ex}" + head + r"}\\*"


def _rows(group: pd.DataFrame) -> list[str]:
    lines = []
    for _, r in group.iterrows():
        d = metric_digits(r["metric"], r["versus_value"]) if not _missing(r["versus_value"]) else 2
        expect = {"higher": "higher", "lower": "lower"}.get(r["expect"])
        if expect is None:
            expect = r"$\approx$ ($\pm$" + fmt_num(r["margin"], d) + ")"
        runs = str(int(r["n_runs"])) if not _missing(r["n_runs"]) else "0"
        if r["verdict"] == "inconclusive":
            runs += r"$\to$" + _runs_needed(r["runs_needed"])
        verdict = verdict_tex(r["verdict"])
        if r["verdict"] not in TESTED + tuple(CHECK_OUTCOME.values()) or r["verdict"] == "inconclusive":
            verdict += r"\newline{\scriptsize " + esc(str(r["reason"])) + "}"
        lines.append(
            f"{esc(r['task'])}: {esc(r['cell_label'])} vs {esc(r['versus_label'])} & "
            f"{esc(RUN_METRIC_NAMES.get(r['metric']) or display_name(r['metric']))} & {expect} & "
            f"{fmt_num(r['versus_value'], d)}$\\to${fmt_num(r['cell_value'], d)} & "
            f"{_signed(r['delta'], d)}{_interval(r, d)} & "
            f"{_p_text(r['p_adjusted'])} & {_signs(r)} & {runs} & {verdict} \\\\")
    return lines


def claims_latex(frame: pd.DataFrame) -> str:
    """The claims table: per claim a header (statement, origin and source, the quoted sentences it
    rests on, its verdict in each task, its caveat and regime), then one row per comparison with
    the evidence and the verdict's reason; then, apart, the checks with their outcomes."""
    if frame.empty:
        return ""
    n_looks = int(frame["looks"].iloc[0]) if "looks" in frame and len(frame) else 1
    looks_note = (r" $p_\mathrm{adj}$ and the intervals include the factor 2 of the two looks at adaptive seeds "
                  r"(Bonferroni)." if n_looks > 1 else "")
    kind = _kind(frame)
    claims, checks = frame[kind != "check"], frame[kind == "check"]
    m = int(claims["verdict"].isin(TESTED).sum())  # the claims' Holm family (claims.csv: sim_ci_level)
    level = 1 - ALPHA / max(1, m * n_looks)
    interval_note = (rf"with its simultaneous Student-$t$ interval over runs (confidence $1-{ALPHA:g}/{m * n_looks}$ = "
                     rf"{fmt_num(100 * level, 2 if level < 0.999 else 3)}\,\%: Bonferroni over the {m} tested "
                     "comparisons" + (" and two looks" if n_looks > 1 else "") + ", so that all the intervals hold "
                     "together, as the verdicts do; none for a comparison set aside)" if m else
                     "(no interval: every comparison was set aside)")
    checks_note = (r" Checks (last): tests of this pipeline, no one's claim, corrected over the checks alone and "
                   r"not counted in the claims' family; each \emph{passed}, \emph{failed} or is inconclusive."
                   if len(checks) else "")
    lines = [r"{\footnotesize\setlength{\tabcolsep}{3pt}",
             r"\begin{longtable}{@{}>{\raggedright}p{2.9cm}>{\raggedright}p{1.2cm}>{\raggedright}p{1.0cm}r"
             r">{\raggedright}p{2.5cm}r>{\raggedleft}p{1.1cm}c>{\raggedright\arraybackslash}p{2.2cm}@{}}",
             r"\caption{Claims tested on this study's training runs, each verdict per task; each claim's header "
             r"gives its origin (a seed report, the literature, or a test) and the source sentences it rests on, "
             r"in English (the originals: claims.csv). "
             r"$v\to c$: mean over the runs of the compared-against cell and of the cell; "
             r"$\Delta=c-v$: mean of the per-seed differences " + interval_note + "; "
             r"$p_\mathrm{adj}$: paired $t$-test over runs (TOST for $\approx$), Holm-corrected over all "
             r"claim comparisons of the study." + looks_note + r" Signs: how many of the paired runs' differences lie "
             r"on the predicted side (for $\approx$: within the margin), and from 6 runs $p_\pm$, the exact sign-flip "
             r"permutation $p$ of a zero mean difference (all $2^n$ sign assignments, two-sided, unadjusted): "
             r"checks without the normality the $t$-test assumes; no verdict rests on them."
             r" Runs: paired runs behind the comparison, and for an "
             r"unsettled one the runs per cell a paired test would need for 80\,\% power at the observed effect "
             r"and spread." + checks_note + r"}\label{tab:claims}\\",
             r"\toprule", r"Comparison ($c$ vs $v$) & Metric & Expect & $v\to c$ & $\Delta$ [simult.\ CI] & "
             r"$p_\mathrm{adj}$ & Signs & Runs & Verdict \\", r"\midrule", r"\endhead", r"\bottomrule", r"\endfoot"]
    checks_title = (r"Checks: tests of this pipeline, not claims of any report (Holm over the checks alone; "
                    r"outcome in place of a verdict)")
    for part, title in ((claims, ""), (checks, checks_title)):
        if part.empty:
            continue
        if title:
            lines += [r"\midrule", r"\multicolumn{9}{@{}l@{}}{\rule{0pt}{2.6ex}\textbf{" + title + r"}}\\*"]
        for name, group in part.groupby("claim", sort=False):
            per_task = "; ".join(f"{esc(t)}: \\textbf{{{verdict_tex(g['task_verdict'].iloc[0])}}}"
                                 for t, g in group.groupby("task", sort=False))
            lines.append(_header(group.iloc[0], per_task))
            lines += _rows(group)
    lines += [r"\end{longtable}}"]
    return "\n".join(lines) + "\n"


def _signs(r) -> str:
    """Sign consistency "k/n" and, where there is one, the permutation p under it."""
    agree = r.get("seeds_agree")
    text = esc(str(agree)) if isinstance(agree, str) and agree else "--"
    if not _missing(r.get("p_permutation")):
        text += r"\newline{\scriptsize $p_\pm$\," + _p_text(float(r["p_permutation"])) + "}"
    return text


def _interval(r, digits: int) -> str:
    """The simultaneous interval of a tested comparison (beside its adjusted p), else nothing."""
    if _missing(r.get("sim_ci_lo")) or _missing(r.get("sim_ci_hi")):
        return ""
    return f" [{_signed(r['sim_ci_lo'], digits)}, {_signed(r['sim_ci_hi'], digits)}]"


def claims_summary(frame: pd.DataFrame, latex: bool = True) -> str:
    """One sentence: how many claim x task verdicts of each kind (and one on the checks, if any)."""
    per_task = frame.drop_duplicates(["claim", "task"])
    kind = _kind(per_task)
    claims, checks = per_task[kind != "check"], per_task[kind == "check"]
    counts = claims["task_verdict"].value_counts()
    parts = [f"{counts[v]} {v}" for v in VERDICTS if counts.get(v, 0)]
    text = (f"{claims['claim'].nunique()} claims give {len(claims)} verdicts (one per claim and task): "
            + ", ".join(parts) + ".")
    if len(checks):
        counts = checks["task_verdict"].value_counts()
        n = checks["claim"].nunique()
        text += (f" {n} check{'s' if n != 1 else ''} of the pipeline, judged apart: "
                 + ", ".join(f"{counts[v]} {v}" for v in CHECK_OUTCOMES if counts.get(v, 0)) + ".")
    return esc(text) if latex else text


def references_latex(frame: pd.DataFrame) -> str:
    """Ours vs published: one row per reference, then a plain note for every setting that differs."""
    if frame.empty:
        return ""
    lines = [r"{\footnotesize\setlength{\tabcolsep}{3pt}",
             r"\begin{longtable}{@{}>{\raggedright}p{3.2cm}l>{\raggedleft}p{2.1cm}>{\raggedleft}p{1.8cm}"
             r">{\raggedleft}p{1.8cm}c>{\raggedright\arraybackslash}p{3.6cm}@{}}",
             r"\caption{Our results beside published ones. Ours: mean $\pm$ standard deviation over runs; a "
             r"difference between two settings ($c-v$) is compared with the published difference, and where both "
             r"scales are known also in percent of each one's own $v$ (absolute differences on different scales "
             r"are not comparable). $\approx$: the published number is approximate. Setting: whether the "
             r"published setting matches ours (see the notes below).}\label{tab:references}\\",
             r"\toprule", r"Ours (task: cell) & Metric & Ours & Published & Ours $-$ published & Setting & Source \\",
             r"\midrule", r"\endhead", r"\bottomrule", r"\endfoot"]
    notes = []
    for i, r in enumerate(frame.to_dict("records"), start=1):
        d = metric_digits(r["metric"], r["published"])
        what = esc(r["cell_label"]) if not isinstance(r["versus"], str) else \
            f"{esc(r['cell_label'])} $-$ {esc(r['versus_label'])}"
        ours = (_signed(r["ours"], d) if isinstance(r["versus"], str) else fmt_num(r["ours"], d))
        if not (isinstance(r["ours_std"], float) and math.isnan(r["ours_std"])):
            ours += r" $\pm$ " + fmt_num(r["ours_std"], d)
        pub = (_signed(r["published"], d) if isinstance(r["versus"], str) else fmt_num(r["published"], d))
        if _is_true(r["approximate"]):
            pub = r"$\approx$" + pub
        diff = _signed(r["difference"], d)
        if not _missing(r.get("ours_rel_pct")) and not _missing(r.get("published_rel_pct")):
            ours += rf"\newline ({_signed(r['ours_rel_pct'], 1)}\,\%)"
            pub += rf"\newline ({_signed(r['published_rel_pct'], 1)}\,\%)"
            diff = _signed(r["ours_rel_pct"] - r["published_rel_pct"], 1) + r"\,pp"
        if isinstance(r["versus"], str) and r["same_sign"] is not None and not _missing(r["same_sign"]):
            diff += " (same sign)" if _is_true(r["same_sign"]) else " (opposite sign)"
        matches = "matches" if _is_true(r["matches_setting"]) else f"differs$^{{{i}}}$"
        lines.append(f"{esc(r['task'])}: {what} & {esc(display_name(r['metric']))} & {ours} & {pub} & {diff} & "
                     f"{matches} & {esc(r['citation'])} \\\\")
        note = str(r["note"]) if isinstance(r["note"], str) and r["note"] else ""
        if not _is_true(r["matches_setting"]):
            notes.append(rf"\item[{i}] Settings differ, so the difference is not a like-for-like comparison. "
                         rf"Published setting: {esc(r['setting'])}." + (f" {esc(note)}" if note else ""))
        elif note:
            notes.append(rf"\item[{i}] {esc(note)}")
    lines.append(r"\end{longtable}}")
    if notes:
        lines += [r"{\footnotesize\begin{description}", *notes, r"\end{description}}"]
    return "\n".join(lines) + "\n"


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _is_true(x) -> bool:
    return str(x).strip().lower() in ("true", "1", "yes")


def report_context(study) -> dict:
    """Template variables of the report's claims and references sections ('' when none declared)."""
    if not study.claims and not study.references:  # nothing declared: no section (the stage wrote empty tables)
        return {"claims_table": "", "claims_summary": "", "references_table": ""}
    claims_path, refs_path = _paths(study)
    claims, refs = read_csv(claims_path), read_csv(refs_path)
    for col in ("versus", "versus_label", "note"):
        if col in refs:
            refs[col] = refs[col].where(refs[col].notna(), None)
    return {"claims_table": claims_latex(claims), "claims_summary": claims_summary(claims) if len(claims) else "",
            "references_table": references_latex(refs)}
