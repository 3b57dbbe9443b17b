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
* equivalence ("equal within +-m"): two verdicts are possible, so each is tested at alpha / 2
  and the comparison's p-value is twice the smaller of
    - the TOST p of "inside +-m" (statsmodels' ttost_paired: both one-sided tests, mean > -m and
      mean < +m, must reject, so its p is the larger of the two), and
    - the one-sided p of "beyond +-m" (mean > +m or mean < -m, whichever side the data are on).
  In interval terms: "equivalent" when the (1 - alpha) Student-t interval lies inside +-m,
  "different" when it lies entirely beyond +m or -m. At a true difference of exactly +-m both
  verdicts are wrong, and together they happen at most alpha of the time; testing each at alpha
  (the usual TOST level) would allow up to 1.5 alpha there;
* multiplicity: Holm's step-down (statsmodels' multipletests) over the claim comparisons of a
  study (family-wise error, valid under any dependence between comparisons, which share
  baselines), beside simultaneous intervals (report/claims.py: Student-t at confidence
  1 - alpha/m over the same family, Bonferroni, so that they hold together as the verdicts do;
  an interval that excludes a value is a rejection at Holm's strictest step),
  Benjamini-Hochberg over the marks of the tables (false discovery rate: many exploratory
  marks, a few wrong ones acceptable, a verdict never rests on them), counting each distinct
  comparison once (aggregate stage: a word perplexity repeats its token perplexity's test);
* beside a paired t-test, two checks that do not assume normal differences and decide nothing:
  the sign consistency (how many of the n differences lie on the predicted side) and, from
  MIN_PERMUTATION_RUNS to MAX_PERMUTATION_RUNS runs, the exact sign-flip permutation p-value
  (all 2^n sign assignments of the differences, two-sided on their mean; below 6 runs its
  smallest possible value, 2/2^n, is above 0.05);
* sequential seeds (params `seeds: {min, max}`): a comparison may be looked at twice, after
  `min` runs and after `max`; each look is tested at alpha / looks (Bonferroni over looks),
  which bounds the error rate whatever rule decides to continue, because the second look's
  sample size is fixed at `max`;
* power: the runs a paired t-test (or TOST) needs for 80 % power at the observed mean and
  standard deviation of d, at the Bonferroni level alpha / (comparisons x looks) (Holm's
  strictest step): the smallest n whose power, evaluated at every n up to MAX_RUNS_REPORTED,
  reaches 80 %.

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
_RUN_RANGES = ((2, 16), (17, 64), (65, 256), (257, MAX_RUNS_REPORTED))  # runs_needed's search, in turn
MIN_PERMUTATION_RUNS = 6  # 2/2^6 = 0.031: the first n at which the permutation test can reject at 0.05
MAX_PERMUTATION_RUNS = 16  # 65,536 sign assignments (~0.3 s); 20 runs would take seconds per comparison


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x)) and math.isfinite(float(x))


def paired_t(deltas, confidence: float = 0.95) -> dict:
    """Mean of the per-seed differences, its Student-t interval and the two-sided p of mean = 0.
    n < 2: no interval and no p (NaN)."""
    from scipy import special

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
    # Student's t from its ufuncs: what stats.ttest_1samp computes (equal to ~1e-12, relative),
    # without its ~0.8 ms of argument handling per call (a calibration test makes 15,000 calls).
    t = out["mean"] / out["se"]
    quantile = float(special.stdtrit(n - 1, 0.5 + confidence / 2))
    out.update(ci_lo=out["mean"] - quantile * out["se"], ci_hi=out["mean"] + quantile * out["se"],
               p=float(2 * special.stdtr(n - 1, -abs(t))))
    return out


def equivalence(cell, versus, margin: float) -> dict:
    """"Equal within +-margin" on paired runs (cell[i], versus[i]: the same seed), see the module
    doc: p_inside, the TOST p of |mean(d)| < margin (statsmodels' ttost_paired, the larger of
    its two one-sided p-values); p_outside, the one-sided p of |mean(d)| > margin on the side
    the data are on, doubled; p, the comparison's p-value (each verdict at alpha / 2): twice the
    smaller of p_inside and the undoubled p_outside, capped at 1; side, the verdict p is about
    ("inside" or "outside")."""
    from scipy import stats
    from statsmodels.stats.weightstats import ttost_paired

    c, v = np.asarray(cell, dtype=np.float64), np.asarray(versus, dtype=np.float64)
    d = c - v
    if len(d) < 2:
        return {"p_inside": float("nan"), "p_outside": float("nan"), "p": float("nan"), "side": ""}
    if float(d.std(ddof=1)) == 0.0:  # no spread: the mean is known exactly
        mean = abs(float(d.mean()))
        p_in, p_beyond = (0.0, 1.0) if mean < margin else (1.0, 1.0) if mean == margin else (1.0, 0.0)
    else:
        p_in = float(ttost_paired(c, v, -margin, margin)[0])
        p_beyond = float(min(stats.ttest_1samp(d, margin, alternative="greater").pvalue,   # mean > +m
                             stats.ttest_1samp(d, -margin, alternative="less").pvalue))  # mean < -m
    return {"p_inside": p_in, "p_outside": min(1.0, 2 * p_beyond), "p": min(1.0, 2 * min(p_in, p_beyond)),
            "side": "inside" if p_in <= p_beyond else "outside"}


def sign_consistency(deltas, expect: str, margin: float | None = None) -> tuple[int, int]:
    """(k, n): how many of the n per-seed differences lie on the predicted side (above 0 for
    "higher", below 0 for "lower", within +-margin for "equal")."""
    d = np.asarray(deltas, dtype=np.float64)
    if expect == "equal":
        k = int((np.abs(d) <= margin).sum())
    else:
        k = int((d > 0).sum() if expect == "higher" else (d < 0).sum())
    return k, len(d)


def sign_flip_p(deltas) -> float:
    """Exact sign-flip permutation p-value of mean(d) = 0, two-sided (scipy's permutation_test
    over all 2^n sign assignments of the differences): valid without normality when the
    differences are symmetric about 0 under the null. NaN below MIN_PERMUTATION_RUNS runs (it
    could not reject at 0.05) and above MAX_PERMUTATION_RUNS (too many assignments to enumerate)."""
    from scipy import stats

    d = np.asarray(deltas, dtype=np.float64)
    if not MIN_PERMUTATION_RUNS <= len(d) <= MAX_PERMUTATION_RUNS or not np.isfinite(d).all():
        return float("nan")
    res = stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=np.inf,
                                 alternative="two-sided", vectorized=True, axis=-1)
    return float(res.pvalue)


def holm(pvalues) -> np.ndarray:
    """Holm-adjusted p-values (statsmodels' multipletests, method "holm"); NaN entries stay NaN
    and do not count as tests."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = ~np.isnan(p)
    if ok.sum() == 1:
        # One test: nothing to adjust. multipletests' Holm branch also runs a full garbage
        # collection on every call (~0.1 s in a process holding torch), which the calibration
        # test's thousands of one-comparison studies would pay for nothing.
        out[ok] = p[ok]
    elif ok.any():
        out[ok] = multipletests(p[ok], method="holm")[1]
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
    """Paired runs for a two-sided paired t-test at `alpha` to reach `power` of a significant
    result on the observed effect's side, when the true mean difference and its run-to-run
    standard deviation are the observed ones. inf when no difference was seen or more than
    MAX_RUNS_REPORTED runs would be needed; MIN_RUNS at least.

    The power is evaluated at every n from 2 (statsmodels' TTestPower, the rejection region on
    the effect's side: alternative "larger" at alpha / 2) and the smallest n that reaches
    `power` is returned, rather than asking TTestPower's root finder: scipy's non-central t
    returns NaN for the far tail on the other side at large effects, which makes the solver
    fail (or converge to a wrong n) for some effects and not for larger ones. That tail is a
    significant result of the wrong sign - not the effect found - and is below alpha / 2 anyway.
    Power grows with the effect at every n, so the answer never grows with the effect."""
    from statsmodels.stats.power import TTestPower

    if not (_finite(mean) and _finite(sd)):
        return float("nan")
    if sd == 0.0:
        return float(MIN_RUNS) if mean != 0 else math.inf
    effect = abs(mean) / sd
    if effect < 1e-6:
        return math.inf
    # In widening ranges of n, stopping at the first that reaches `power`: the same smallest n as
    # one pass over 2..MAX_RUNS_REPORTED, and most comparisons are settled in the first range.
    for first, last in _RUN_RANGES:
        n = np.arange(first, last + 1)
        reached = np.flatnonzero(TTestPower().power(effect_size=effect, nobs=n, alpha=alpha / 2,
                                                    alternative="larger") >= power)
        if len(reached):
            return float(max(MIN_RUNS, n[reached[0]]))
    return math.inf


def tost_power(n, mean: float, sd: float, margin: float, alpha: float):
    """Power of TOST at `alpha` (each one-sided test at alpha) with n paired runs (a number or an
    array), true mean difference `mean`, sd `sd`."""
    from scipy import stats

    n = np.asarray(n, dtype=np.float64)
    df, se = np.maximum(n - 1, 1), sd / np.sqrt(np.maximum(n, 1))
    crit = stats.t.ppf(1 - alpha, df)
    # Both one-sided tests must reject; the usual approximation adds the two rejection
    # probabilities of the non-central t and subtracts one.
    p1 = stats.nct.sf(crit, df, (margin + mean) / se)
    p2 = stats.nct.sf(crit, df, (margin - mean) / se)
    out = np.where(n < 2, 0.0, np.maximum(0.0, p1 + p2 - 1))
    return float(out) if out.ndim == 0 else out


def runs_needed_equivalence(mean: float, sd: float, margin: float, alpha: float, power: float = POWER) -> float:
    """Paired runs for an "equal within +-margin" comparison's p-value (equivalence(): twice the
    TOST p) to fall below `alpha` with `power`, i.e. TOST at alpha / 2, at the observed mean and
    sd. inf when the observed mean is at or beyond the margin."""
    if not (_finite(mean) and _finite(sd)):
        return float("nan")
    if abs(mean) >= margin:
        return math.inf
    if sd == 0.0:
        return float(MIN_RUNS)
    n = np.arange(MIN_RUNS, MAX_RUNS_REPORTED + 1)
    reached = np.flatnonzero(tost_power(n, mean, sd, margin, alpha / 2) >= power)
    return float(n[reached[0]]) if len(reached) else math.inf


def fmt_runs(n: float) -> str:
    if not _finite(n) and not (isinstance(n, float) and math.isinf(n)):
        return "--"
    if math.isinf(n):
        return f"> {MAX_RUNS_REPORTED}"
    return str(int(n))
