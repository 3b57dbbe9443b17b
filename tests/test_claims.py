"""Claims and published references: the seed-level statistics, the rules that set a comparison
aside (failed runs, unequal budgets, regimes, too few runs), verdicts per task, and the claims
stage on a faked study (tests/fixtures/report/), where `pe_none` is much worse than the baseline
and `same_as_base` has exactly the baseline's outputs, so the right verdicts are known.
(Calibration and power on real training runs: tests/test_calibration.py.)"""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline_src.study.paths import tune_record
from scipy import stats as sps

from pipeline_src.study.config import load_study
from pipeline_src.report import claims as C
from pipeline_src.report import stats as S
from pipeline_src.study.stages import output_path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "report"
_spec = importlib.util.spec_from_file_location("fake_study_claims", FIXTURES / "fake_study.py")
fake_study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_study)


# --- statistics ----------------------------------------------------------------------------------


def test_paired_t_is_the_textbook_one_sample_t_on_the_differences():
    d = np.array([-12.1, -4.7, -8.0])
    t = S.paired_t(d)
    se = d.std(ddof=1) / math.sqrt(3)
    assert t["mean"] == pytest.approx(d.mean()) and t["se"] == pytest.approx(se)
    assert t["p"] == pytest.approx(2 * sps.t.sf(abs(d.mean() / se), 2))
    q = sps.t.ppf(0.975, 2)
    assert (t["ci_lo"], t["ci_hi"]) == pytest.approx((d.mean() - q * se, d.mean() + q * se))
    # Two runs, the PTB one-head case: -12.1 and -4.7 perplexity is p ~ 0.26, not significant.
    assert S.paired_t([-12.1, -4.7])["p"] == pytest.approx(0.264, abs=1e-3)
    assert math.isnan(S.paired_t([1.0])["p"])
    assert S.paired_t([0.5, 0.5, 0.5])["p"] == 0.0 and S.paired_t([0.0, 0.0, 0.0])["p"] == 1.0


def _eq(deltas, margin):
    d = np.asarray(deltas, dtype=float)
    return S.equivalence(d + 10.0, np.full(len(d), 10.0), margin)  # paired runs whose differences are d


def test_equivalence_tests_inside_and_outside_the_margin():
    inside = _eq([0.1, -0.1, 0.05, 0.0, -0.05], margin=1.0)
    assert inside["p_inside"] < 0.001 and inside["p_outside"] == pytest.approx(1.0) and inside["side"] == "inside"
    outside = _eq([3.1, 2.9, 3.0, 3.2], margin=1.0)
    assert outside["p_outside"] < 0.01 and outside["p_inside"] > 0.5 and outside["side"] == "outside"
    straddle = _eq([1.5, -0.4, 0.9], margin=1.0)
    assert straddle["p_inside"] > 0.05 and straddle["p_outside"] > 0.05


def test_tost_needs_both_one_sided_tests_and_each_verdict_gets_half_the_level():
    from statsmodels.stats.weightstats import ttost_paired

    c, v = np.array([10.6, 11.4, 10.2, 11.0]), np.full(4, 10.0)  # d: mean 0.8, near the margin 1
    d = c - v
    above_low = sps.ttest_1samp(d, -1.0, alternative="greater").pvalue
    below_high = sps.ttest_1samp(d, 1.0, alternative="less").pvalue
    assert above_low < 0.01 and below_high > 0.2  # the smaller one-sided p would call it equivalent
    eq = S.equivalence(c, v, 1.0)
    assert eq["p_inside"] == pytest.approx(below_high) == pytest.approx(ttost_paired(c, v, -1.0, 1.0)[0])
    assert C.judge_alone("equal", c, v, margin=1.0, runs_needed=False)["verdict"] == "inconclusive"
    # TOST p 0.037: equivalent at alpha, but a comparison that may also end "different" tests
    # each verdict at alpha / 2, so p = 0.074 and no verdict.
    d = np.array([0.3, -0.5, 0.9, 0.2])
    eq = _eq(d, 1.0)
    assert eq["p_inside"] == pytest.approx(0.0368, abs=1e-4) and eq["p"] == pytest.approx(2 * eq["p_inside"])
    judged = C.judge_alone("equal", d, np.zeros(4), margin=1.0, runs_needed=False)
    assert judged["verdict"] == "inconclusive" and judged["p_adjusted"] == pytest.approx(0.0737, abs=1e-4)
    # The same rule as an interval: equivalent exactly when the 95 % interval lies inside +-margin.
    t = S.paired_t(d)
    assert t["ci_hi"] > 1.0 and (_eq(d, t["ci_hi"] + 1e-6)["p"] < 0.05) and (_eq(d, t["ci_hi"] - 1e-6)["p"] > 0.05)


def test_sign_consistency_and_the_exact_sign_flip_permutation_p():
    assert S.sign_consistency([-1.0, -2.0, 0.5], "lower") == (2, 3)
    assert S.sign_consistency([-1.0, -2.0, 0.5], "higher") == (1, 3)
    assert S.sign_consistency([-1.0, 0.2, 0.5, 0.0], "equal", margin=0.5) == (3, 4)
    # Six differences of one sign: only "all +" and "all -" reach |mean|, 2 of 64 assignments.
    assert S.sign_flip_p([0.3, 1.2, 0.7, 2.0, 0.1, 0.9]) == pytest.approx(2 / 64)
    assert S.sign_flip_p([-0.3, -1.2, -0.7, -2.0, -0.1, -0.9]) == pytest.approx(0.03125)
    # Against every sign assignment enumerated here: two-sided on the mean.
    d = np.random.default_rng(4).normal(0.4, 1.0, 9)
    means = np.array([np.mean(np.array(s) * d) for s in itertools.product((1, -1), repeat=9)])
    assert S.sign_flip_p(d) == pytest.approx(np.mean(np.abs(means) >= abs(d.mean()) * (1 - 1e-12)))
    # Below 6 runs it could not reach 0.05 (2/32 with five), so there is none; nor beyond 16.
    assert math.isnan(S.sign_flip_p([1.0] * 5)) and math.isnan(S.sign_flip_p(np.ones(17)))
    # Beside the paired t of a comparison, and in its row of the claims table.
    ev = C._evidence("lower", np.full(6, 10.0), np.array([10.3, 11.2, 10.7, 12.0, 10.1, 10.9]), None)
    assert ev["p_permutation"] == pytest.approx(0.03125) and ev["p_value"] < 0.05
    row = pd.Series({"seeds_agree": "6/6", "p_permutation": ev["p_permutation"]})
    assert C._signs(row) == r"6/6\newline{\scriptsize $p_\pm$\,0.031}"


def test_holm_and_benjamini_hochberg_match_their_definitions():
    p = [0.01, 0.04, 0.03, 0.005, float("nan")]
    holm = S.holm(p)
    # Holm: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1, made monotone.
    assert list(holm[:4]) == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(holm[4])
    bh = S.benjamini_hochberg(p)
    assert list(bh[:4]) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(0)
    many = rng.uniform(0, 0.2, 40) ** 2
    assert S.holm(many) == pytest.approx(multipletests(many, method="holm")[1])
    assert S.holm([0.3]) == pytest.approx([0.3]) and math.isnan(S.holm([float("nan"), 0.2])[0])
    assert S.holm([float("nan"), 0.2, 0.01])[1:] == pytest.approx([0.2, 0.02])  # NaN is not a test
    assert S.benjamini_hochberg(many) == pytest.approx(multipletests(many, method="fdr_bh")[1])


def test_runs_needed_grows_as_the_effect_shrinks_and_reaches_80_percent_power():
    n_big, n_small = S.runs_needed(1.0, 1.0, 0.05), S.runs_needed(0.3, 1.0, 0.05)
    assert S.MIN_RUNS <= n_big < n_small < 200
    assert math.isinf(S.runs_needed(0.0, 1.0, 0.05))
    # At the computed n the noncentral t gives >= 80 % power of a significant result on the
    # effect's side; one run fewer gives less.
    def power(n, d, alpha=0.05):
        return sps.nct.sf(sps.t.ppf(1 - alpha / 2, n - 1), n - 1, d * math.sqrt(n))
    n = int(n_small)
    assert power(n, 0.3) >= 0.8 > power(n - 1, 0.3)
    # Large effects at Holm's strictest level over 24 comparisons, where statsmodels' solver fails
    # (d = 8, 11, 12 came back as "more than 1,000 runs") or lands on a wrong n (d = 10: 3): finite,
    # never more runs for a larger effect, each the smallest n with 80 % power.
    alpha = 0.05 / 24
    effects = [1, 3, 8, 10, 11, 12]
    need = [S.runs_needed(d, 1.0, alpha) for d in effects]
    assert all(math.isfinite(x) for x in need) and need == sorted(need, reverse=True), need
    for d, n in zip(effects, map(int, need)):
        assert power(n, d, alpha) >= 0.8 and (n == S.MIN_RUNS or power(n - 1, d, alpha) < 0.8), (d, n)
    assert need[2:] == [4.0] * 4  # with 3 runs even d = 12 has 59 % power at this level
    grid = [S.runs_needed(d, 1.0, alpha) for d in np.linspace(0.2, 30, 300)]
    assert all(a >= b for a, b in itertools.pairwise(grid))
    from pipeline_src.report.plan import extends

    assert extends("inconclusive", S.runs_needed(11.0, 1.0, alpha), 5)  # a near miss the seed plan extends
    eq = S.runs_needed_equivalence(0.1, 1.0, 1.0, 0.05)  # the comparison at 0.05: TOST at 0.025
    assert S.tost_power(int(eq), 0.1, 1.0, 1.0, 0.025) >= 0.8 > S.tost_power(int(eq) - 1, 0.1, 1.0, 1.0, 0.025)
    assert math.isinf(S.runs_needed_equivalence(1.2, 1.0, 1.0, 0.05))


def test_a_claim_is_judged_per_task_and_as_strong_as_its_weakest_comparison():
    assert C._task_verdict(["supported", "supported"])[0] == "supported"
    assert C._task_verdict(["supported", "inconclusive"])[0] == "inconclusive"
    assert C._task_verdict(["supported", "contradicted"])[0] == "contradicted"
    assert C._task_verdict([C.RUN_FAILED, C.RUN_FAILED])[0] == C.RUN_FAILED


# --- the stage on a faked study ------------------------------------------------------------------

CLAIMS = {
    "pe_hurts": {"statement": "Removing positional encoding hurts", "source": "seeds 000, 002", "origin": "seed",
                 "quote": [{"text": "移除位置编码会导致性能显著下降。", "where": "seed 000, section 6.3",
                            "translation": "Removing the positional encoding makes performance drop significantly."},
                           {"text": "Positions matter.", "where": "Somebody et al. 2020, section 2"}],
                 "caveat": "Two tasks, each judged on its own.",
                 "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "bleu", "expect": "lower"},
                             {"task": "sum_task", "cell": "pe_none", "metric": "rouge1", "expect": "lower"}]},
    "pe_helps": {"statement": "Removing positional encoding helps (false)", "source": "made up", "origin": "test",
                 "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "test_ppl", "expect": "lower"}]},
    "same_equal": {"statement": "A copy of the baseline is equal to it", "source": "test", "origin": "test",
                   "compare": [{"task": "tr_task", "cell": "same_as_base", "metric": "bleu", "expect": "equal",
                                "margin": 0.5}]},
    "same_better": {"statement": "A copy of the baseline beats it (cannot be shown)", "source": "test", "origin": "test",
                    "compare": [{"task": "tr_task", "cell": "same_as_base", "metric": "bleu", "expect": "higher"}]},
    "versus_other": {"statement": "pe_none is worse than the copy of the baseline", "source": "test", "origin": "test",
                     "compare": [{"task": "tr_task", "cell": "pe_none", "versus": "same_as_base",
                                  "metric": "test_ppl", "expect": "higher"}]},
    "mixed": {"statement": "PE none hurts translation and helps summaries (half false)", "source": "test", "origin": "test",
              "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "bleu", "expect": "lower"},
                          {"task": "sum_task", "cell": "pe_none", "metric": "rouge1", "expect": "higher"}]},
    "per_run": {"statement": "Per-run metric over seeds", "source": "test", "origin": "test",
                "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "best_val_loss", "expect": "higher"}]},
    "overfit": {"statement": "Dropout helps", "source": "test", "origin": "test",
                "regime": {"description": "an overfitting regime", "min_epochs": 20},
                "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "bleu", "expect": "lower"}]},
}
# A check of the pipeline, not anyone's claim: judged apart, outside the claims' Holm family. Its
# comparison is the clearest effect of the fake data, so that in the claims' family it would move
# every other adjusted p.
CHECK = {"pe_check": {"statement": "The no-positions cell is worse (a check)", "source": "this pipeline", "check": True,
                      "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "bleu", "expect": "lower"}]}}
REFERENCES = [
    {"task": "tr_task", "metric": "bleu", "value": 30.0, "citation": "Somebody et al. 2020", "setting": "WMT, 4.5M pairs",
     "matches_setting": False, "approximate": True},
    {"task": "tr_task", "cell": "pe_none", "versus": "baseline", "metric": "bleu", "value": -5.0,
     "versus_value": 25.0, "citation": "Vaswani et al. 2017, Table 3", "setting": "newstest2013",
     "matches_setting": False},
    {"task": "lm_task", "metric": "test_ppl_word", "value": 58.8, "citation": "Merity et al. 2018",
     "setting": "same data", "matches_setting": True, "note": "AWD-LSTM without fine-tuning"},
]


def _build(root: Path, claims=CLAIMS | CHECK, seeds=(0, 1, 2, 3), name="params_claims.yaml"):
    params = yaml.safe_load((FIXTURES / "params.yaml").read_text())
    params["claims"], params["references"], params["seeds"] = claims, REFERENCES, list(seeds)
    Path(name).write_text(yaml.safe_dump(params, sort_keys=False))
    study = fake_study.build(name, ".", n_test=30)
    fake_study.copy_baseline_eval(study, "tr_task", "same_as_base")
    for cell in ("baseline", "pe_none", "same_as_base"):  # a regime the runs did reach: 5 epochs
        for seed in seeds:
            path = Path(output_path("train", "metrics", study=study.name, task="tr_task", cell=cell, seed=seed))
            tm = json.loads(path.read_text())
            path.write_text(json.dumps(dict(tm, epochs_seen=5.0)))
    return study


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        study = _build(root)
        from pipeline_src.report import aggregate

        aggregate.run(study)
        C.run(study)
        reports = Path("reports") / study.name
        yield {"root": root, "study": study, "claims": pd.read_csv(reports / "claims.csv"),
               "refs": pd.read_csv(reports / "references.csv"), "results": pd.read_csv(reports / "results.csv")}


def _row(frame, claim, i=0):
    return frame[frame["claim"] == claim].iloc[i]


def _task_verdicts(claims) -> dict:
    return {(r.claim, r.task): r.task_verdict for r in claims.drop_duplicates(["claim", "task"]).itertuples()}


def test_claims_get_the_verdicts_the_fake_data_imply_per_task(stage):
    v = _task_verdicts(stage["claims"])
    assert v[("pe_hurts", "tr_task")] == "supported" and v[("pe_hurts", "sum_task")] == "supported"
    assert v[("pe_helps", "tr_task")] == "contradicted"
    assert v[("same_equal", "tr_task")] == "supported"
    assert v[("same_better", "tr_task")] == "inconclusive"
    assert v[("versus_other", "tr_task")] == "supported"
    # One task contradicts, the other supports: each task keeps its own verdict.
    assert v[("mixed", "tr_task")] == "supported" and v[("mixed", "sum_task")] == "contradicted"
    assert v[("overfit", "tr_task")] == C.NOT_IN_REGIME
    assert "20 epochs" in _row(stage["claims"], "overfit")["reason"]
    same = _row(stage["claims"], "same_equal")
    assert same["delta"] == 0 and same["ci_lo"] == 0 and same["ci_hi"] == 0 and same["seeds_agree"] == "4/4"
    hurts = _row(stage["claims"], "pe_hurts")
    assert hurts["seeds_agree"] == "4/4" and math.isnan(hurts["p_permutation"])  # 4 runs: no permutation p
    nothing = _row(stage["claims"], "same_better")
    assert "no difference was seen" in nothing["reason"] and math.isinf(float(nothing["runs_needed"]))


def test_claim_evidence_is_a_paired_t_over_runs_corrected_by_holm(stage):
    claims, res = stage["claims"], stage["results"]
    row = _row(claims, "pe_hurts")
    by = res[res.task == "tr_task"].set_index(["cell", "seed"])["bleu"]
    d = np.array([by[("pe_none", s)] - by[("baseline", s)] for s in range(4)])
    t = sps.ttest_1samp(d, 0.0)
    assert row["delta"] == pytest.approx(d.mean(), rel=1e-5) and row["p_value"] == pytest.approx(t.pvalue, rel=1e-4)
    lo, hi = t.confidence_interval(0.95)
    assert (row["ci_lo"], row["ci_hi"]) == pytest.approx((lo, hi), rel=1e-4)
    assert row["n_runs"] == 4 and row["seeds"] == "0,1,2,3" and "paired t over 4 runs" in row["test"]
    tested = claims[claims["verdict"].isin(C.TESTED) & (claims["kind"] == "claim")]
    expect = S.holm(tested["p_value"].to_numpy())
    assert tested["p_adjusted"].to_numpy() == pytest.approx(expect, rel=1e-4)
    assert (claims["looks"] == 1).all()  # a list of seeds: one look
    # Beside the adjusted p: the simultaneous interval, Bonferroni over the tested comparisons.
    level = 1 - 0.05 / len(tested)
    assert len(tested) > 1 and tested["sim_ci_level"].to_numpy() == pytest.approx([level] * len(tested), rel=1e-5)
    row = _row(claims, "pe_hurts")
    assert (row["sim_ci_lo"], row["sim_ci_hi"]) == pytest.approx(t.confidence_interval(level), rel=1e-4)
    assert row["sim_ci_lo"] < row["ci_lo"] and row["sim_ci_hi"] > row["ci_hi"]
    aside = claims[~claims["verdict"].isin(C.TESTED + tuple(C.CHECK_OUTCOME.values()))]
    assert len(aside) and aside[["sim_ci_level", "sim_ci_lo", "sim_ci_hi"]].isna().all().all()


def test_a_check_is_judged_apart_and_not_counted_in_the_claims_holm_family(stage, monkeypatch):
    from pipeline_src.report import aggregate

    monkeypatch.chdir(stage["root"])
    study = stage["study"]
    res = aggregate.collect_results(study)
    with_check = C.evaluate_claims(study, res)
    params = yaml.safe_load(Path(study.path).read_text())
    params["claims"] = CLAIMS
    Path("params_no_check.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))
    without = C.evaluate_claims(load_study("params_no_check.yaml"), res)
    claims = with_check[with_check["kind"] == "claim"].reset_index(drop=True)
    assert list(claims["claim"]) == list(without["claim"])
    for col in ("p_adjusted", "sim_ci_level", "sim_ci_lo", "runs_needed"):
        assert claims[col].to_numpy(dtype=float) == pytest.approx(without[col].to_numpy(dtype=float), nan_ok=True), col
    assert list(claims["verdict"]) == list(without["verdict"])
    check = _row(with_check, "pe_check")
    assert check["kind"] == "check" and check["origin"] == "" and check["quote"] == ""
    assert check["verdict"] == "passed" and check["task_verdict"] == "passed" and "passed" in check["task_reason"]
    assert check["p_adjusted"] == pytest.approx(check["p_value"])  # a family of one
    # In the claims' family the check would have moved their adjusted p: this test can tell.
    tested = with_check[with_check["p_value"].notna() & with_check["p_adjusted"].notna()]
    pooled = S.holm(tested["p_value"].to_numpy())[(tested["kind"] == "claim").to_numpy()]
    assert not np.allclose(pooled, tested.loc[tested["kind"] == "claim", "p_adjusted"].to_numpy())
    summary = C.claims_summary(with_check, latex=False)
    assert summary.startswith("8 claims give 10 verdicts") and "1 check of the pipeline, judged apart: 1 passed." in summary


def test_claims_csv_carries_kind_origin_and_the_quoted_sources(stage):
    claims = stage["claims"]
    assert {"kind", "origin", "quote", "quote_en"} <= set(claims.columns)
    row = _row(claims, "pe_hurts")
    assert row["kind"] == "claim" and row["origin"] == "seed"
    assert row["quote"] == ('seed 000, section 6.3: "移除位置编码会导致性能显著下降。" || '
                            'Somebody et al. 2020, section 2: "Positions matter."')
    assert row["quote_en"] == ('seed 000, section 6.3: "Removing the positional encoding makes performance drop '
                               'significantly." || Somebody et al. 2020, section 2: "Positions matter."')
    untested = _row(claims, "pe_helps")
    assert untested["origin"] == "test" and untested["kind"] == "claim" and pd.isna(untested["quote"])
    assert _row(claims, "pe_check")["kind"] == "check" and pd.isna(_row(claims, "pe_check")["origin"])


def test_too_few_runs_give_no_verdict(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    study = _build(tmp_path, seeds=(0, 1))
    from pipeline_src.report import aggregate

    claims = C.evaluate_claims(study, aggregate.collect_results(study))
    in_regime = claims[claims["claim"] != "overfit"]
    assert (in_regime["verdict"] == C.TOO_FEW).all() and (in_regime["task_verdict"] == C.TOO_FEW).all()
    assert in_regime["p_adjusted"].isna().all()


def _with_runs(study, results: pd.DataFrame, task, cell, **values) -> pd.DataFrame:
    out = results.copy()
    mask = (out["task"] == task) & (out["cell"] == cell)
    for k, v in values.items():
        out.loc[mask, k] = v
    return out


def test_a_failed_run_is_not_evidence_unless_the_claim_predicts_failure(stage, monkeypatch):
    from pipeline_src.report import aggregate

    monkeypatch.chdir(stage["root"])
    study = stage["study"]
    res = aggregate.collect_results(study)
    tm = {"best_val_loss": 6.4, "final_val_loss": 6.4, "unigram_val_loss": 6.5}
    assert "unigram" in aggregate.failure(tm, {})
    assert aggregate.failure(dict(tm, best_val_loss=5.0, final_val_loss=5.1), {}) == ""
    assert aggregate.failure(dict(tm, best_val_loss=5.0, final_val_loss=6.3), {}).startswith("diverged")
    assert aggregate.failure(dict(tm, best_val_loss=float("nan")), {}).startswith("non-finite")
    broken = _with_runs(study, res, "tr_task", "pe_none", failed=True, failure="best val loss 6.40 vs 6.50")
    claims = C.evaluate_claims(study, broken)
    row = _row(claims, "pe_hurts")
    assert row["verdict"] == C.RUN_FAILED and "pe_none/seed0" in row["reason"]
    assert _row(claims, "pe_hurts", 1)["verdict"] == "supported"  # the other task's runs trained
    expected = {n: dict(c, failure_is_effect=True) if n == "pe_hurts" else c for n, c in CLAIMS.items()}
    params = yaml.safe_load(Path(study.path).read_text())
    params["claims"] = expected
    Path("params_effect.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # a failure at the one lr the cell had is not the effect: the lr may not suit it
    row = _row(C.evaluate_claims(load_study("params_effect.yaml"), broken), "pe_hurts")
    assert row["verdict"] == C.FAILED_AT_ONE_LR and "give it a train.lr_grid" in row["reason"]
    # with an lr grid whose every trial failed, the failure is the effect it predicts
    params["cells"]["pe_none"].setdefault("train", {})["lr_grid"] = [1.0e-3, 3.0e-3]
    Path("params_effect.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    effect_study = load_study("params_effect.yaml")
    record = tune_record(effect_study, "tr_task", "pe_none")
    record.parent.mkdir(parents=True, exist_ok=True)
    trials = [{"lr": 1.0e-3, "best_val_loss": 6.45, "unigram_val_loss": 6.5},
              {"lr": 3.0e-3, "best_val_loss": 6.48, "unigram_val_loss": 6.5}]
    record.write_text(json.dumps({"trials": trials, "chosen_lr": 1.0e-3}))
    assert _row(C.evaluate_claims(effect_study, broken), "pe_hurts")["verdict"] == "supported"
    # one trial that trained: the runs' failure is not the predicted effect
    trials[1]["best_val_loss"] = 4.0
    record.write_text(json.dumps({"trials": trials, "chosen_lr": 3.0e-3}))
    row = _row(C.evaluate_claims(effect_study, broken), "pe_hurts")
    assert row["verdict"] == C.FAILED_AT_ONE_LR and "trained in its tune trial at lr 0.003" in row["reason"]
    base_failed = _with_runs(study, res, "tr_task", "baseline", failed=True, failure="x")
    assert _row(C.evaluate_claims(effect_study, base_failed), "pe_hurts")["verdict"] == C.RUN_FAILED


def test_unequal_budgets_are_not_compared_except_as_rates(stage, monkeypatch):
    from pipeline_src.report import aggregate

    monkeypatch.chdir(stage["root"])
    study = stage["study"]
    res = aggregate.collect_results(study)
    half = _with_runs(study, res, "tr_task", "pe_none", train_tokens=res["train_tokens"].max() / 2)
    claims = C.evaluate_claims(study, half)
    row = _row(claims, "pe_hurts")
    assert row["verdict"] == C.UNEQUAL_BUDGET and "max_target_tokens" in row["reason"]
    params = yaml.safe_load(Path(study.path).read_text())
    params["claims"] = {"faster": {"statement": "s", "source": "s", "origin": "test", "compare": [
        {"task": "tr_task", "cell": "pe_none", "metric": "s_per_mtok", "expect": "lower"}]}}
    Path("params_rate.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rate = C.evaluate_claims(load_study("params_rate.yaml"), half)
    assert rate["verdict"].iloc[0] in C.TESTED


def test_references_table_sets_ours_beside_published_in_percent_where_scales_differ(stage):
    refs, res = stage["refs"], stage["results"]
    base = res[(res.task == "tr_task") & (res.cell == "baseline")]["bleu"]
    r0 = refs.iloc[0]
    assert r0["cell"] == "baseline"  # defaults to the task's baseline cell
    assert r0["ours"] == pytest.approx(base.mean(), rel=1e-5)
    assert r0["ours_std"] == pytest.approx(base.std(ddof=1), rel=1e-4)
    r1 = refs.iloc[1]  # a published difference: ours is the mean per-seed difference
    by = res[res.task == "tr_task"].set_index(["cell", "seed"])["bleu"]
    d = np.mean([by[("pe_none", s)] - by[("baseline", s)] for s in range(4)])
    assert r1["ours"] == pytest.approx(d, rel=1e-5) and bool(r1["same_sign"]) == (d < 0)
    assert r1["ours_rel_pct"] == pytest.approx(100 * d / base.mean(), rel=1e-4)
    assert r1["published_rel_pct"] == pytest.approx(-20.0)
    tex = C.references_latex(pd.read_csv(Path(stage["root"]) / "reports" / stage["study"].name / "references.csv"))
    assert tex.count(r"\item[") == 3 and "pp" in tex and r"$-$20.0\,\%" in tex
    assert tex.count("differs$^") == 2 and "matches" in tex


def test_report_has_the_claims_per_task_caveats_and_the_method(stage, monkeypatch):
    import torch

    from pipeline_src.model import ModelConfig, Transformer
    from pipeline_src.report import build, figures, tables

    monkeypatch.chdir(stage["root"])
    study = stage["study"]

    def loader(ckpt_dir):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=150, d_model=32, n_heads=2, enc_layers=1, dec_layers=1, d_ff=64))
        return model.eval(), {"config": study.cell("tr_task", "baseline").to_dict()}

    figures.run(study, model_loader=loader)
    tables.run(study)
    build.run(study)
    tex = (Path("reports") / study.name / "report.tex").read_text()
    assert r"\section{Published results and claims}" in tex and r"\label{sec:method}" in tex
    assert "Two tasks, each judged on its own." in tex  # the caveat beside its claim
    assert "Holm" in tex and "Benjamini" in tex and "unigram" in tex
    m = int((stage["claims"]["verdict"].isin(C.TESTED) & (stage["claims"]["kind"] == "claim")).sum())
    assert r"$\Delta$ [simult.\ CI]" in tex and f"confidence $1-0.05/{m}$" in tex
    assert r"$p_\mathrm{adj}$ & Signs & Runs & Verdict" in tex and "sign-flip" in tex
    assert "8 claims give 10 verdicts (one per claim and task)" in tex
    # Each claim shows its origin and its sources in English; the Chinese original stays in claims.csv
    # (pdflatex with the template's packages has no CJK fonts).
    assert r"\textit{(seed report: seeds 000, 002)}" in tex and r"\textit{(test: made up)}" in tex
    assert ('seed 000, section 6.3: "Removing the positional encoding makes performance drop significantly."'
            in tex) and "移除" not in tex
    # The check is shown apart, as a check with its outcome, after every claim.
    checks_at = tex.index(r"\textbf{Checks: tests of this pipeline, not claims of any report")
    assert tex.index("The no-positions cell is worse (a check)") > checks_at > tex.index("Dropout helps")
    assert "1 check of the pipeline, judged apart: 1 passed." in tex
    assert r"tr\_task: \textbf{\textcolor{green!45!black}{supported}}; sum\_task: \textbf{\textcolor{red!70!black}{contradicted}}" in tex
    assert (Path("reports") / study.name / "report.pdf").stat().st_size > 10_000


def test_a_study_without_claims_writes_empty_tables_and_no_section():
    study = load_study(ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml")
    assert study.claims == () and study.references == ()
    empty = C.evaluate_claims(study, pd.DataFrame())
    assert list(empty.columns) == C.CLAIM_COLUMNS and empty.empty
    assert C.claims_latex(empty) == "" and C.references_latex(pd.DataFrame(columns=C.REFERENCE_COLUMNS)) == ""


def test_shipped_studies_declare_claims_and_references():
    for p in ("workflow/studies/demo/params.yaml", "workflow/studies/mirror/params.yaml",
              "workflow/studies/gpu/params.yaml", "workflow/studies/cpu/params.yaml",
              "workflow/studies/cnndm/params.yaml"):
        study = load_study(ROOT / p)
        assert study.claims and study.references, p


@pytest.mark.parametrize("study_dir, task, max_examples", [("cnndm", "cnndm", 100), ("cpu", "ptb", None)])
def test_each_check_run_is_its_study_baseline_shortened(study_dir, task, max_examples):
    """CI re-makes a shortened baseline of each committed CPU study (check.yaml): its data recipe,
    tokenizer, model and evaluation must stay the study's, or the check would test something else."""
    study = load_study(ROOT / f"workflow/studies/{study_dir}/params.yaml")
    check = load_study(ROOT / f"workflow/studies/{study_dir}/check.yaml")
    a, b = study.cell(task, "baseline"), check.cell(task, "baseline")
    assert {task: study.datasets[study.tasks[task].dataset]} == {task: check.datasets[check.tasks[task].dataset]}
    assert study.tasks[task].filter == check.tasks[task].filter
    assert study.tasks[task].bpe == check.tasks[task].bpe and a.model == b.model
    assert b.train.max_steps < a.train.max_steps
    assert b.train.lr == a.train.lr or a.train.lr_grid  # a tuned study's check trains at its chosen lr
    if max_examples is None:
        assert b.eval == a.eval
    else:
        assert b.eval.max_examples == max_examples


def test_gpu_study_runner_refuses_cleanly_without_a_gpu(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the runner would start the real study")
    marker = ROOT / "data" / "gpu" / ".runner_test_marker"
    made = not marker.parent.exists()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("must survive")
    try:
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
        proc = subprocess.run(["bash", "workflow/studies/gpu/run.sh"], cwd=ROOT, capture_output=True, text=True,
                              env=env, timeout=120)
        assert proc.returncode != 0
        assert "sees no CUDA device" in proc.stderr
        assert marker.exists()  # checked before anything is deleted
    finally:
        marker.unlink(missing_ok=True)
        if made:
            marker.parent.rmdir()


def test_a_verdict_on_runs_that_had_not_converged_holds_at_this_budget(stage, monkeypatch):
    from pipeline_src.report import aggregate

    monkeypatch.chdir(stage["root"])
    study = stage["study"]
    res = aggregate.collect_results(study)
    converged = _with_runs(study, res.assign(converged=True), "tr_task", "pe_none", converged=True)
    row = _row(C.evaluate_claims(study, converged), "pe_hurts")
    assert row["verdict"] in C.TESTED and "at this budget" not in row["reason"]
    still_improving = _with_runs(study, res.assign(converged=True), "tr_task", "pe_none", converged=False)
    row = _row(C.evaluate_claims(study, still_improving), "pe_hurts")
    n = int(row["n_runs"])
    assert row["reason"].endswith(f"; at this budget: {n} of the {2 * n} runs compared had not converged (validation "
                                  f"still improving when they ended)"), row["reason"]
