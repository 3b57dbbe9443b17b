"""Claims stage: the study's claims tested on its results, and its results set beside published ones.

reports/<study>/claims.csv      one row per comparison of every claim (params `claims:`), with
                                 the evidence and a verdict; the claim's overall verdict repeated.
reports/<study>/references.csv  one row per published number (params `references:`) with ours
                                 beside it and the difference.

Evidence for a comparison "cell against versus on metric" (effect = cell minus versus):

* metrics with per-example test outputs (BLEU, ROUGE, test perplexity): the effect is the
  difference of the statistic on all seeds' test outputs pooled (corpus BLEU from summed
  sacrebleu sufficient statistics, corpus perplexity from summed NLL and token counts, mean
  ROUGE). Its 95 % interval comes from a two-level paired bootstrap: each resample draws the
  seeds with replacement, then the test examples of each drawn seed with replacement, the same
  draws for both cells; so the interval covers variation over seeds *and* over examples. The
  p-value is the aggregate stage's paired bootstrap test with seeds pooled (read from
  significance.csv when versus is the task's baseline, recomputed by the same code otherwise).
* metrics measured once per run (throughput, wall time, best validation loss): seeds are the
  only unit. Effect = mean over seeds of the per-seed difference (paired by seed), 95 % interval
  and two-sided p from the paired t distribution with n_seeds - 1 degrees of freedom.

Verdict (alpha 0.05): expect higher/lower -> supported when p < alpha and the whole interval lies
on the expected side of 0, contradicted when p < alpha and it lies on the other side, otherwise
inconclusive. Expect equal (within a margin m) -> supported when the whole interval lies in
[-m, m] (an equivalence test), contradicted when it lies entirely outside, otherwise
inconclusive. A claim is contradicted if any comparison is, supported if all are, otherwise
inconclusive. "Inconclusive" means "not settled at this scale", not "false".
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..common import StageError, atomic_write_text
from ..stages import output_path
from . import (ALPHA, BOOTSTRAP_SEED, display_name, fmt_num, latex_escape as esc, metric_digits, read_csv,
               report_paths)

CLAIM_COLUMNS = ["claim", "statement", "source", "claim_verdict", "task", "metric", "cell", "cell_label", "versus",
                 "versus_label", "expect", "margin", "versus_value", "cell_value", "delta", "rel_delta_pct", "ci_lo",
                 "ci_hi", "p_value", "test", "unit", "n_seeds", "n_examples", "seeds_agree", "verdict", "reason"]
REFERENCE_COLUMNS = ["task", "cell", "cell_label", "versus", "versus_label", "metric", "ours", "ours_std",
                     "n_seeds", "published", "difference", "same_sign", "approximate", "matches_setting", "setting",
                     "citation", "note"]
VERDICTS = ("supported", "contradicted", "inconclusive")
# Display names of the per-run metrics a claim may use (the evaluation metrics have theirs in METRICS).
RUN_METRIC_NAMES = {"wall_s": "Training time (s)", "tokens_per_s": "Tokens/s", "best_val_loss": "Best val loss",
                    "final_val_loss": "Final val loss", "final_train_loss": "Final train loss", "val_ppl": "Val PPL",
                    "steps": "Steps", "mfu": "MFU", "peak_mem_mb": "Peak memory (MB)"}


# --- statistics ----------------------------------------------------------------------------------


def student_t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer df >= 1 (Abramowitz & Stegun 26.7.3-4: finite
    sums in theta = atan(t / sqrt(df)); exact, no special functions needed)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd
        total, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):  # c + (2/3) c^3 + (2*4)/(3*5) c^5 + ...
            total += term
            term *= c * c * (2 * k) / (2 * k + 1)
        a = (2 / math.pi) * (theta + (s * total if df > 1 else 0.0))
    else:
        total, term = 0.0, 1.0
        for k in range(1, df // 2 + 1):  # 1 + (1/2) c^2 + (1*3)/(2*4) c^4 + ...
            total += term
            term *= c * c * (2 * k - 1) / (2 * k)
        a = s * total
    return float(min(1.0, max(0.0, 1.0 - a)))


def student_t_quantile(q: float, df: int) -> float:
    """The q-quantile (q > 0.5) of Student's t, by bisection on the two-sided tail."""
    target = 2 * (1 - q)
    lo, hi = 0.0, 1.0
    while student_t_two_sided_p(hi, df) > target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if student_t_two_sided_p(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def two_level_bootstrap(base: list[np.ndarray], cell: list[np.ndarray], stat, n: int, seed: int = BOOTSTRAP_SEED):
    """Paired two-level bootstrap of stat(sum of cell rows) - stat(sum of base rows).

    base[s], cell[s]: per-example feature rows (examples x features) of seed s, row i of both
    being the same test example. stat maps a feature sum to the statistic (e.g. nll, tokens ->
    perplexity). Returns (delta on all data, [2.5 %, 97.5 %] percentile interval)."""
    if len(base) != len(cell) or not base:
        raise ValueError("two_level_bootstrap: need the same non-zero number of seeds for both cells")
    for b, c in zip(base, cell):
        if b.shape != c.shape:
            raise ValueError(f"two_level_bootstrap: unpaired arrays {b.shape} vs {c.shape}")
    delta = stat(sum(c.sum(axis=0) for c in cell)) - stat(sum(b.sum(axis=0) for b in base))
    rng = np.random.default_rng(seed)
    k = len(base)
    diffs = np.empty(n)
    for r in range(n):
        sb, sc = 0.0, 0.0
        for s in rng.integers(0, k, size=k):
            m = len(base[s])
            w = np.bincount(rng.integers(0, m, size=m), minlength=m).astype(np.float64)
            sb = sb + w @ base[s]
            sc = sc + w @ cell[s]
        diffs[r] = stat(sc) - stat(sb)
    return float(delta), [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]


def verdict(expect: str, lo: float, hi: float, p: float, margin: float | None = None,
            alpha: float = ALPHA) -> tuple[str, str]:
    """(verdict, reason) for one comparison from its effect interval [lo, hi] and p-value."""
    if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in (lo, hi)):
        return "inconclusive", "no interval (a single seed of a per-run metric)"
    if expect == "equal":
        if margin is None:
            raise ValueError("expect equal needs a margin")
        if -margin <= lo and hi <= margin:
            return "supported", f"the 95 % interval lies within +-{margin:.3g}"
        if lo > margin or hi < -margin:
            return "contradicted", f"the 95 % interval lies outside +-{margin:.3g}"
        return "inconclusive", f"the 95 % interval crosses +-{margin:.3g}"
    sign = 1.0 if expect == "higher" else -1.0
    significant = p is not None and not math.isnan(p) and p < alpha
    if significant and sign * lo > 0 and sign * hi > 0:
        return "supported", f"p < {alpha} and the interval excludes 0 on the expected side"
    if significant and sign * lo < 0 and sign * hi < 0:
        return "contradicted", f"p < {alpha} and the interval excludes 0 on the opposite side"
    if not significant:
        return "inconclusive", f"p >= {alpha}"
    return "inconclusive", "p < alpha but the interval (which also resamples seeds) includes 0"


def combine(verdicts: list[str]) -> str:
    if "contradicted" in verdicts:
        return "contradicted"
    if verdicts and all(v == "supported" for v in verdicts):
        return "supported"
    return "inconclusive"


# --- per-example features ------------------------------------------------------------------------


def _bleu_stat():
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    return metric, lambda s: float(metric._compute_score_from_stats(list(np.asarray(s, dtype=np.float64))).score)


def _features(out, task: str, cell: str, seed: int, metric: str, kind: str):
    """Per-example feature rows whose column sums determine the statistic, and that statistic."""
    if metric == "bleu":
        bleu, stat = _bleu_stat()
        hyps, refs = out.lines(task, cell, seed, "hyps.txt"), out.lines(task, cell, seed, "refs.txt")
        if len(hyps) != len(refs):
            raise StageError(f"{task}/{cell}/seed{seed}: {len(hyps)} hypotheses but {len(refs)} references")
        rows = np.asarray(bleu._extract_corpus_statistics(hyps, [refs]), dtype=np.float64)
        return rows, stat, tuple(refs)
    if metric.startswith("rouge"):
        scores = out.scores(task, cell, seed, metric, None)
        return np.stack([scores, np.ones_like(scores)], axis=1), lambda s: float(s[0] / s[1]), len(scores)
    if metric in ("test_ppl", "test_ppl_word"):
        frame = out.per_example(task, cell, seed)
        denom = "tokens" if metric == "test_ppl" else "words"
        if denom not in frame or frame[denom].isna().all():
            raise StageError(f"{task}/{cell}/seed{seed}: per_example.tsv column {denom} empty")
        rows = frame[["nll", denom]].to_numpy(np.float64)
        return rows, lambda s: float(math.exp(s[0] / max(s[1], 1e-12))), tuple(frame["index"])
    raise StageError(f"claims: metric {metric} has no per-example outputs")


# --- evidence ------------------------------------------------------------------------------------


def _pooled_p(study, sig: pd.DataFrame, out, comp, kind: str, means: dict) -> tuple[float, str]:
    """The pooled paired-bootstrap p-value of the aggregate stage for this comparison."""
    from .aggregate import _test_one

    baseline = study.tasks[comp.task].baseline_cell
    if comp.versus == baseline and len(sig):
        row = sig[(sig["task"] == comp.task) & (sig["cell"] == comp.cell) & (sig["metric"] == comp.metric)
                  & (sig["seed"].astype(str) == "pooled")]
        if len(row):
            return float(row["p_value"].iloc[0]), str(row["test"].iloc[0])
    n = study.cell(comp.task, comp.versus).eval.bootstrap
    res = _test_one(out, comp.task, kind, comp.versus, comp.cell, list(study.seeds), comp.metric, n, means)
    return float(res["p_value"]), str(res["test"])


def _example_evidence(study, comp, kind: str, out, sig, means) -> dict:
    base, cell, per_seed = [], [], []
    stat = None
    for s in study.seeds:
        b, stat, b_key = _features(out, comp.task, comp.versus, s, comp.metric, kind)
        c, _, c_key = _features(out, comp.task, comp.cell, s, comp.metric, kind)
        if b_key != c_key:
            raise StageError(f"{comp.task}/{comp.cell}/seed{s}: test examples differ from {comp.versus}'s; "
                             "cannot pair them")
        base.append(b)
        cell.append(c)
        per_seed.append(stat(c.sum(axis=0)) - stat(b.sum(axis=0)))
    n = study.cell(comp.task, comp.versus).eval.bootstrap
    delta, (lo, hi) = two_level_bootstrap(base, cell, stat, n)
    p, test = _pooled_p(study, sig, out, comp, kind, means)
    return {"versus_value": stat(sum(b.sum(axis=0) for b in base)), "cell_value": stat(sum(c.sum(axis=0) for c in cell)),
            "delta": delta, "ci_lo": lo, "ci_hi": hi, "p_value": p, "per_seed": per_seed,
            "test": f"{test}; interval: two-level paired bootstrap over seeds and examples ({n} resamples)",
            "unit": "seed x test example", "n_examples": int(sum(len(b) for b in base))}


def _run_evidence(study, comp, results: pd.DataFrame) -> dict:
    paths = report_paths(study)
    rows = results[results["task"] == comp.task]
    if comp.metric not in rows or rows[comp.metric].isna().all():
        raise StageError(f"{paths['results']}: column {comp.metric} missing for task {comp.task}")
    by = rows.set_index(["cell", "seed"])[comp.metric].astype(float)
    c = np.array([by[(comp.cell, s)] for s in study.seeds])
    v = np.array([by[(comp.versus, s)] for s in study.seeds])
    d = c - v
    k = len(d)
    delta = float(d.mean())
    if k < 2:
        lo = hi = p = float("nan")
    else:
        se = float(d.std(ddof=1)) / math.sqrt(k)
        if se == 0:
            lo = hi = delta
            p = 1.0 if delta == 0 else 0.0
        else:
            q = student_t_quantile(0.975, k - 1)
            lo, hi = delta - q * se, delta + q * se
            p = student_t_two_sided_p(delta / se, k - 1)
    return {"versus_value": float(v.mean()), "cell_value": float(c.mean()), "delta": delta, "ci_lo": lo,
            "ci_hi": hi, "p_value": p, "per_seed": list(d), "unit": "seed",
            "test": f"paired t over {k} seed(s) (df {k - 1})", "n_examples": np.nan}


def _agrees(expect: str, d: float, margin: float | None) -> bool:
    if expect == "equal":
        return abs(d) <= margin
    return d > 0 if expect == "higher" else d < 0


def evaluate_claims(study, results: pd.DataFrame, sig: pd.DataFrame) -> pd.DataFrame:
    from .aggregate import _Outputs

    out = _Outputs(study)
    means = {(r["task"], r["cell"], r["seed"], m): r[m] for r in results.to_dict("records")
             for m in ("rouge1", "rouge2", "rougeLsum") if m in r}
    labels = {(r["task"], r["cell"]): r["label"] for r in results.to_dict("records")}
    rows = []
    for claim in study.claims:
        claim_rows = []
        for comp in claim.comparisons:
            kind = study.tasks[comp.task].kind
            task_means = {k[1:]: v for k, v in means.items() if k[0] == comp.task}
            ev = (_example_evidence(study, comp, kind, out, sig, task_means) if comp.per_example
                  else _run_evidence(study, comp, results))
            margin = comp.margin if comp.margin is not None else (
                None if comp.margin_pct is None else comp.margin_pct / 100 * abs(ev["versus_value"]))
            v, reason = verdict(comp.expect, ev["ci_lo"], ev["ci_hi"], ev["p_value"], margin)
            agree = sum(_agrees(comp.expect, d, margin) for d in ev["per_seed"])
            claim_rows.append({
                "claim": claim.name, "statement": claim.statement, "source": claim.source, "task": comp.task,
                "metric": comp.metric, "cell": comp.cell, "cell_label": labels.get((comp.task, comp.cell), comp.cell),
                "versus": comp.versus, "versus_label": labels.get((comp.task, comp.versus), comp.versus),
                "expect": comp.expect, "margin": margin, "versus_value": ev["versus_value"],
                "cell_value": ev["cell_value"], "delta": ev["delta"],
                "rel_delta_pct": 100 * ev["delta"] / abs(ev["versus_value"]) if ev["versus_value"] else np.nan,
                "ci_lo": ev["ci_lo"], "ci_hi": ev["ci_hi"], "p_value": ev["p_value"], "test": ev["test"],
                "unit": ev["unit"], "n_seeds": len(study.seeds), "n_examples": ev["n_examples"],
                "seeds_agree": f"{agree}/{len(ev['per_seed'])}", "verdict": v, "reason": reason})
        overall = combine([r["verdict"] for r in claim_rows])
        rows += [dict(r, claim_verdict=overall) for r in claim_rows]
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def compare_references(study, results: pd.DataFrame) -> pd.DataFrame:
    paths = report_paths(study)
    rows = []
    for ref in study.references:
        task_rows = results[results["task"] == ref.task]
        if ref.metric not in task_rows or task_rows[ref.metric].isna().all():
            raise StageError(f"{paths['results']}: column {ref.metric} missing for task {ref.task} "
                             f"(named by a reference to {ref.citation!r})")
        by = task_rows.set_index(["cell", "seed"])[ref.metric].astype(float)
        label = dict(zip(task_rows["cell"], task_rows["label"]))
        values = np.array([by[(ref.cell, s)] for s in study.seeds])
        if ref.versus is not None:
            values = values - np.array([by[(ref.versus, s)] for s in study.seeds])
        ours = float(values.mean())
        same_sign = (None if ref.versus is None else
                     bool(np.sign(round(ours, 9)) == np.sign(round(ref.value, 9))))
        rows.append({"task": ref.task, "cell": ref.cell, "cell_label": label.get(ref.cell, ref.cell),
                     "versus": ref.versus, "versus_label": label.get(ref.versus, ref.versus) if ref.versus else None,
                     "metric": ref.metric, "ours": ours,
                     "ours_std": float(values.std(ddof=1)) if len(values) > 1 else np.nan,
                     "n_seeds": len(values), "published": ref.value, "difference": ours - ref.value,
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
    results, sig = read_csv(paths["results"]), read_csv(paths["significance"])
    claims = evaluate_claims(study, results, sig)
    refs = compare_references(study, results)
    claims_path, refs_path = _paths(study)
    # Both computed before either is written: a failure leaves the old outputs intact.
    atomic_write_text(claims_path, _csv(claims))
    atomic_write_text(refs_path, _csv(refs))
    per_claim = claims.drop_duplicates("claim")["claim_verdict"].value_counts() if len(claims) else {}
    print(f"[claims] {len(study.claims)} claims ("
          + ", ".join(f"{per_claim.get(v, 0)} {v}" for v in VERDICTS)
          + f"), {len(refs)} published references: {claims_path.parent}", flush=True)


# --- LaTeX (used by the report stage) ------------------------------------------------------------


def _p(p) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "--"
    return "$<$0.001" if p < 0.001 else f"{p:.3f}"


def _signed(x, digits: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "--"
    return ("$+$" if x >= 0 else "$-$") + fmt_num(abs(x), digits)


_VERDICT_TEX = {"supported": r"\textcolor{green!45!black}{supported}",
                "contradicted": r"\textcolor{red!70!black}{contradicted}",
                "inconclusive": r"\textcolor{black!60}{inconclusive}"}


def claims_latex(frame: pd.DataFrame) -> str:
    """The claims table: one header row per claim (statement, source, overall verdict), then one
    row per comparison with the evidence."""
    if frame.empty:
        return ""
    lines = [r"{\footnotesize", r"\begin{longtable}{@{}p{4.1cm}p{1.9cm}lrp{3.3cm}rcl@{}}",
             r"\caption{Claims of the seed reports and of Vaswani et al.\ (2017), tested on this study's runs. "
             r"$v\to c$: the metric for the compared-against cell and for the cell (seeds pooled); "
             r"$\Delta=c-v$ with its 95\,\% interval; $p$: paired test; seeds: how many seeds show the expected "
             r"relation.}\label{tab:claims}\\",
             r"\toprule", r"Comparison ($c$ vs $v$) & Metric & Expect & $v\to c$ & $\Delta$ [95\,\% CI] & $p$ & Seeds "
             r"& Verdict \\", r"\midrule", r"\endhead", r"\bottomrule", r"\endfoot"]
    for name, group in frame.groupby("claim", sort=False):
        first = group.iloc[0]
        lines.append(r"\multicolumn{8}{@{}p{\linewidth}@{}}{\rule{0pt}{2.6ex}\textbf{" + esc(first["statement"])
                     + r"} \textit{(" + esc(first["source"]) + r")} --- claim: \textbf{"
                     + _VERDICT_TEX.get(first["claim_verdict"], esc(first["claim_verdict"])) + r"}}\\*")
        for _, r in group.iterrows():
            d = metric_digits(r["metric"], r["versus_value"])
            expect = {"higher": "higher", "lower": "lower"}.get(r["expect"])
            if expect is None:
                expect = r"$\approx$ ($\pm$" + fmt_num(r["margin"], d) + ")"
            lines.append(
                f"{esc(r['task'])}: {esc(r['cell_label'])} vs {esc(r['versus_label'])} & "
                f"{esc(RUN_METRIC_NAMES.get(r['metric']) or display_name(r['metric']))} & {expect} & "
                f"{fmt_num(r['versus_value'], d)}$\\to${fmt_num(r['cell_value'], d)} & "
                f"{_signed(r['delta'], d)} [{_signed(r['ci_lo'], d)}, {_signed(r['ci_hi'], d)}] & "
                f"{_p(r['p_value'])} & {esc(r['seeds_agree'])} & {_VERDICT_TEX.get(r['verdict'], esc(r['verdict']))} \\\\")
    lines += [r"\end{longtable}}"]
    return "\n".join(lines) + "\n"


def claims_summary(frame: pd.DataFrame) -> str:
    per_claim = frame.drop_duplicates("claim")
    counts = per_claim["claim_verdict"].value_counts()
    return (f"Of {len(per_claim)} claims, {counts.get('supported', 0)} are supported, "
            f"{counts.get('contradicted', 0)} contradicted and {counts.get('inconclusive', 0)} inconclusive at "
            "this scale.")


def references_latex(frame: pd.DataFrame) -> str:
    """Ours vs published: one row per reference, then a plain note for every setting that differs."""
    if frame.empty:
        return ""
    lines = [r"{\footnotesize", r"\begin{longtable}{@{}p{3.6cm}lrrrcp{5.2cm}@{}}",
             r"\caption{Our results beside published ones. Ours: mean $\pm$ standard deviation over seeds; a "
             r"difference between two settings ($c-v$) is compared with the published difference. "
             r"$\approx$: the published number is approximate. Setting: whether the published setting "
             r"matches ours (see the notes below).}\label{tab:references}\\",
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
        if _true(r["approximate"]):
            pub = r"$\approx$" + pub
        diff = _signed(r["difference"], d)
        if isinstance(r["versus"], str) and r["same_sign"] is not None and not _missing(r["same_sign"]):
            diff += " (same sign)" if _true(r["same_sign"]) else " (opposite sign)"
        matches = "matches" if _true(r["matches_setting"]) else f"differs$^{{{i}}}$"
        lines.append(f"{esc(r['task'])}: {what} & {esc(display_name(r['metric']))} & {ours} & {pub} & {diff} & "
                     f"{matches} & {esc(r['citation'])} \\\\")
        note = str(r["note"]) if isinstance(r["note"], str) and r["note"] else ""
        if not _true(r["matches_setting"]):
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


def _true(x) -> bool:
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
