"""Seed-level statistics: the training run is the unit of evidence.

Two cells of a task are compared on the runs they share a seed with: run s of the cell against
run s of the other cell (same initialisation seed, same data order, same test set), one number
per run (the run's corpus BLEU, test perplexity, ROUGE, wall time ...). The evidence is the
list of per-seed differences d_1..d_n, and every interval and p-value here is about the mean of
that population of *training runs* — a new seed would draw a new d. Test-set noise is inside
each d (each run is scored on the finite test set); the per-sentence bootstrap of one pair of
runs (aggregate stage, significance.csv) says whether those two trained models differ on this
test set, which is a different and weaker question.

Tests (scipy.stats / statsmodels, nothing hand-written):

* directional ("higher" / "lower"): paired t-test of mean(d) = 0, two-sided, with its
  Student-t interval;
* equivalence ("equal within +-m"): two one-sided t-tests (TOST) for "inside +-m", and the
  one-sided test of "outside +-m" (the smaller of the two sides, doubled) for the opposite;
* multiplicity: Holm's step-down over the claim comparisons of a study (family-wise error,
  valid under any dependence between comparisons, which share baselines), Benjamini-Hochberg
  over the marks of the tables (false discovery rate: many exploratory marks, a few wrong ones
  acceptable, a verdict never rests on them);
* sequential seeds (params `seeds: {min, max}`): a comparison may be looked at twice, after
  `min` runs and after `max`; each look is tested at alpha / looks (Bonferroni over looks),
  which bounds the error rate whatever rule decides to continue, because the second look's
  sample size is fixed at `max`;
* power: the runs a paired t-test (or TOST) needs for 80 % power at the observed mean and
  standard deviation of d, at the Bonferroni level alpha / (comparisons x looks) (Holm's
  strictest step).

Below MIN_RUNS paired runs there is no verdict ("too few runs"): a paired t-test exists from
n = 2, but with one degree of freedom its 95 % interval is +-12.7 standard errors and its
p-value rests on the normality of two numbers.
"""
from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05
MIN_RUNS = 3
POWER = 0.8
MAX_RUNS_REPORTED = 1000  # "more than this" beyond it


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x)) and math.isfinite(float(x))


def paired_t(deltas, confidence: float = 0.95) -> dict:
    """Mean of the per-seed differences, its Student-t interval and the two-sided p of mean = 0.
    n < 2: no interval and no p (NaN)."""
    from scipy import stats

    d = np.asarray(deltas, dtype=np.float64)
    n = len(d)
    out = {"n": n, "mean": float(d.mean()) if n else float("nan"), "sd": float("nan"), "se": float("nan"),
           "df": n - 1, "ci_lo": float("nan"), "ci_hi": float("nan"), "p": float("nan")}
    if n < 2:
        return out
    sd = float(d.std(ddof=1))
    out.update(sd=sd, se=sd / math.sqrt(n))
    if sd == 0.0:  # every run moved by exactly the same amount
        out.update(ci_lo=out["mean"], ci_hi=out["mean"], p=1.0 if out["mean"] == 0 else 0.0)
        return out
    res = stats.ttest_1samp(d, 0.0)
    lo, hi = res.confidence_interval(confidence)
    out.update(ci_lo=float(lo), ci_hi=float(hi), p=float(res.pvalue))
    return out


def equivalence(deltas, margin: float) -> dict:
    """TOST for |mean(d)| < margin ("p_inside") and the test of |mean(d)| > margin ("p_outside":
    the more extreme one-sided test beyond +-margin, doubled)."""
    from scipy import stats

    d = np.asarray(deltas, dtype=np.float64)
    if len(d) < 2:
        return {"p_inside": float("nan"), "p_outside": float("nan")}
    if float(d.std(ddof=1)) == 0.0:
        inside = abs(float(d.mean())) < margin
        return {"p_inside": 0.0 if inside else 1.0, "p_outside": 1.0 if inside or abs(d.mean()) == margin else 0.0}
    above_low = stats.ttest_1samp(d, -margin, alternative="greater").pvalue   # mean > -m
    below_high = stats.ttest_1samp(d, margin, alternative="less").pvalue      # mean < +m
    beyond_high = stats.ttest_1samp(d, margin, alternative="greater").pvalue  # mean > +m
    beyond_low = stats.ttest_1samp(d, -margin, alternative="less").pvalue     # mean < -m
    return {"p_inside": float(max(above_low, below_high)),
            "p_outside": float(min(1.0, 2 * min(beyond_high, beyond_low)))}


def holm(pvalues) -> np.ndarray:
    """Holm-adjusted p-values (Holm 1979: the i-th smallest of m times m - i + 1, made monotone,
    capped at 1); NaN entries stay NaN and do not count as tests. (statsmodels' multipletests
    gives the same numbers but runs a full garbage collection on every call.)"""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    if len(ok):
        order = ok[np.argsort(p[ok], kind="stable")]
        m = len(order)
        out[order] = np.minimum(1.0, np.maximum.accumulate(p[order] * np.arange(m, 0, -1)))
    return out


def benjamini_hochberg(pvalues) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values; scipy.stats.false_discovery_control);
    NaN entries stay NaN and do not count as tests."""
    from scipy.stats import false_discovery_control

    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = ~np.isnan(p)
    if ok.any():
        out[ok] = false_discovery_control(p[ok], method="bh")
    return out


def runs_needed(mean: float, sd: float, alpha: float, power: float = POWER) -> float:
    """Paired runs for a two-sided paired t-test at `alpha` to reach `power` when the true mean
    difference and its run-to-run standard deviation are the observed ones. inf when no
    difference was seen; MIN_RUNS at least."""
    from statsmodels.stats.power import TTestPower

    if not (_finite(mean) and _finite(sd)):
        return float("nan")
    if sd == 0.0:
        return float(MIN_RUNS) if mean != 0 else math.inf
    effect = abs(mean) / sd
    if effect < 1e-6:
        return math.inf
    try:
        n = TTestPower().solve_power(effect_size=effect, alpha=alpha, power=power, alternative="two-sided")
    except Exception:  # the solver fails far outside the range where a study could help
        return math.inf
    n = float(np.atleast_1d(n)[0])
    if not math.isfinite(n) or n > MAX_RUNS_REPORTED:
        return math.inf
    return float(max(MIN_RUNS, math.ceil(n)))


def tost_power(n: int, mean: float, sd: float, margin: float, alpha: float) -> float:
    """Power of TOST at `alpha` with n paired runs, true mean difference `mean`, sd `sd`."""
    from scipy import stats

    if n < 2:
        return 0.0
    df, se = n - 1, sd / math.sqrt(n)
    crit = stats.t.ppf(1 - alpha, df)
    # Both one-sided tests must reject; the usual approximation adds the two rejection
    # probabilities of the non-central t and subtracts one.
    p1 = stats.nct.sf(crit, df, (margin + mean) / se)
    p2 = stats.nct.sf(crit, df, (margin - mean) / se)
    return float(max(0.0, p1 + p2 - 1))


def runs_needed_equivalence(mean: float, sd: float, margin: float, alpha: float, power: float = POWER) -> float:
    """Paired runs for TOST to show |difference| < margin with `power`, at the observed mean and
    sd. inf when the observed mean is at or beyond the margin."""
    if not (_finite(mean) and _finite(sd)):
        return float("nan")
    if abs(mean) >= margin:
        return math.inf
    if sd == 0.0:
        return float(MIN_RUNS)
    for n in range(MIN_RUNS, MAX_RUNS_REPORTED + 1):
        if tost_power(n, mean, sd, margin, alpha) >= power:
            return float(n)
    return math.inf


def fmt_runs(n: float) -> str:
    if not _finite(n) and not (isinstance(n, float) and math.isinf(n)):
        return "--"
    if math.isinf(n):
        return f"> {MAX_RUNS_REPORTED}"
    return str(int(n))
