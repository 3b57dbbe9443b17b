"""Claims and published references: the statistics, the verdict rules, and the claims stage on a
faked study (tests/fixtures/report/), where `pe_none` is much worse than the baseline and
`same_as_base` has exactly the baseline's outputs, so the right verdicts are known."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline_src.config import load_study
from pipeline_src.report import claims as C

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "report"
_spec = importlib.util.spec_from_file_location("fake_study_claims", FIXTURES / "fake_study.py")
fake_study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_study)


# --- statistics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("t, df", [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4), (2.228, 10), (1.962, 1000)])
def test_student_t_matches_tabulated_two_sided_5_percent_points(t, df):
    assert C.student_t_two_sided_p(t, df) == pytest.approx(0.05, abs=5e-4)
    assert C.student_t_quantile(0.975, df) == pytest.approx(t, rel=2e-3)


def test_student_t_edge_values():
    assert C.student_t_two_sided_p(0.0, 3) == pytest.approx(1.0)
    assert C.student_t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| >= 1) = 1/2
    assert C.student_t_two_sided_p(1e9, 2) < 1e-12


def test_two_level_bootstrap_sees_a_clear_effect_and_none_between_identical_systems():
    rng = np.random.default_rng(0)
    mean = lambda s: s[0] / s[1]  # noqa: E731
    base = [np.stack([rng.normal(10, 2, 200), np.ones(200)], axis=1) for _ in range(3)]
    better = [b + np.array([3.0, 0.0]) for b in base]
    delta, (lo, hi) = C.two_level_bootstrap(base, better, mean, n=300)
    assert delta == pytest.approx(3.0) and lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    noisy = [b + np.stack([rng.normal(1.0, 2.0, 200), np.zeros(200)], axis=1) for b in base]
    delta, (lo, hi) = C.two_level_bootstrap(base, noisy, mean, n=300)
    assert 0 < lo < delta < hi
    delta, (lo, hi) = C.two_level_bootstrap(base, [b.copy() for b in base], mean, n=100)
    assert delta == 0.0 and lo == 0.0 and hi == 0.0
    # Seeds that disagree widen the interval: one seed with the opposite effect.
    mixed = [base[0] + [2.0, 0.0], base[1] + [2.0, 0.0], base[2] - [4.0, 0.0]]
    delta, (lo, hi) = C.two_level_bootstrap(base, mixed, mean, n=300)
    assert lo < 0 < hi
    with pytest.raises(ValueError):
        C.two_level_bootstrap(base, better[:2], mean, n=10)


# --- verdict rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("expect, lo, hi, p, margin, want", [
    ("higher", 0.5, 2.0, 0.001, None, "supported"),
    ("higher", -2.0, -0.5, 0.001, None, "contradicted"),
    ("higher", -0.5, 2.0, 0.20, None, "inconclusive"),
    ("higher", 0.5, 2.0, 0.20, None, "inconclusive"),      # interval clear, test not significant
    ("higher", -0.1, 2.0, 0.01, None, "inconclusive"),     # significant pooled, seeds disagree
    ("lower", -3.0, -1.0, 0.001, None, "supported"),
    ("lower", 1.0, 3.0, 0.001, None, "contradicted"),
    ("equal", -0.3, 0.4, 0.6, 0.5, "supported"),
    ("equal", 0.6, 1.5, 0.001, 0.5, "contradicted"),
    ("equal", -1.5, -0.6, 0.001, 0.5, "contradicted"),
    ("equal", 0.2, 0.9, 0.04, 0.5, "inconclusive"),
    ("higher", float("nan"), float("nan"), float("nan"), None, "inconclusive"),
])
def test_verdict_rules(expect, lo, hi, p, margin, want):
    got, reason = C.verdict(expect, lo, hi, p, margin)
    assert got == want, reason
    assert reason


def test_a_claim_is_as_strong_as_its_weakest_comparison():
    assert C.combine(["supported", "supported"]) == "supported"
    assert C.combine(["supported", "inconclusive"]) == "inconclusive"
    assert C.combine(["supported", "contradicted", "inconclusive"]) == "contradicted"


# --- the stage on a faked study ------------------------------------------------------------------

CLAIMS = {
    "pe_hurts": {"statement": "Removing positional encoding hurts", "source": "seeds 000, 002",
                 "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "bleu", "expect": "lower"},
                             {"task": "sum_task", "cell": "pe_none", "metric": "rouge1", "expect": "lower"}]},
    "pe_helps": {"statement": "Removing positional encoding helps (false)", "source": "made up",
                 "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "test_ppl", "expect": "lower"}]},
    "same_equal": {"statement": "A copy of the baseline is equal to it", "source": "test",
                   "compare": [{"task": "tr_task", "cell": "same_as_base", "metric": "bleu", "expect": "equal",
                                "margin": 0.5}]},
    "same_better": {"statement": "A copy of the baseline beats it (cannot be shown)", "source": "test",
                    "compare": [{"task": "tr_task", "cell": "same_as_base", "metric": "bleu", "expect": "higher"}]},
    "versus_other": {"statement": "pe_none is worse than the copy of the baseline", "source": "test",
                     "compare": [{"task": "tr_task", "cell": "pe_none", "versus": "same_as_base",
                                  "metric": "test_ppl", "expect": "higher"}]},
    "per_run": {"statement": "Per-run metric over seeds", "source": "test",
                "compare": [{"task": "tr_task", "cell": "pe_none", "metric": "best_val_loss", "expect": "higher"}]},
}
REFERENCES = [
    {"task": "tr_task", "metric": "bleu", "value": 30.0, "citation": "Somebody et al. 2020", "setting": "WMT, 4.5M pairs",
     "matches_setting": False, "approximate": True},
    {"task": "tr_task", "cell": "pe_none", "versus": "baseline", "metric": "bleu", "value": -5.0,
     "citation": "Vaswani et al. 2017, Table 3", "setting": "newstest2013", "matches_setting": False},
    {"task": "lm_task", "metric": "test_ppl_word", "value": 57.3, "citation": "Merity et al. 2018",
     "setting": "same data", "matches_setting": True, "note": "AWD-LSTM"},
]


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        params = yaml.safe_load((FIXTURES / "params.yaml").read_text())
        params["claims"], params["references"] = CLAIMS, REFERENCES
        Path("params_claims.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        study = fake_study.build("params_claims.yaml", ".", n_test=30)
        fake_study.copy_baseline_eval(study, "tr_task", "same_as_base")
        from pipeline_src.report import aggregate

        aggregate.run(study)
        C.run(study)
        reports = Path("reports") / study.name
        yield {"root": root, "study": study, "claims": pd.read_csv(reports / "claims.csv"),
               "refs": pd.read_csv(reports / "references.csv"), "results": pd.read_csv(reports / "results.csv")}


def _row(frame, claim, i=0):
    return frame[frame["claim"] == claim].iloc[i]


def test_claims_get_the_verdicts_the_fake_data_imply(stage):
    claims = stage["claims"]
    per_claim = claims.drop_duplicates("claim").set_index("claim")["claim_verdict"]
    assert per_claim["pe_hurts"] == "supported"
    assert per_claim["pe_helps"] == "contradicted"
    assert per_claim["same_equal"] == "supported"
    assert per_claim["same_better"] == "inconclusive"
    assert per_claim["versus_other"] == "supported"
    same = _row(claims, "same_equal")
    assert same["delta"] == 0 and same["ci_lo"] == 0 and same["ci_hi"] == 0 and same["p_value"] == 1.0
    assert same["seeds_agree"] == "2/2"


def test_claim_evidence_matches_the_aggregate_tables(stage):
    claims, study = stage["claims"], stage["study"]
    sig = pd.read_csv(Path(stage["root"]) / "reports" / study.name / "significance.csv")
    row = _row(claims, "pe_hurts")
    pooled = sig[(sig.task == "tr_task") & (sig.cell == "pe_none") & (sig.metric == "bleu") & (sig.seed == "pooled")]
    # Same pooled statistic and p-value as the significance table (seeds pooled, paired).
    assert row["delta"] == pytest.approx(float(pooled["delta"].iloc[0]), rel=1e-4)
    assert row["p_value"] == pytest.approx(float(pooled["p_value"].iloc[0]))
    assert row["ci_lo"] <= row["delta"] <= row["ci_hi"] < 0
    assert row["n_examples"] == 30 * len(study.seeds) and row["unit"] == "seed x test example"
    # Against a non-baseline cell the p-value is computed by the same paired test.
    other = _row(claims, "versus_other")
    assert other["versus"] == "same_as_base" and other["p_value"] < 0.05 and other["delta"] > 0


def test_per_run_metric_uses_a_paired_t_over_seeds(stage):
    row, res = _row(stage["claims"], "per_run"), stage["results"]
    by = res[res.task == "tr_task"].set_index(["cell", "seed"])["best_val_loss"]
    d = np.array([by[("pe_none", s)] - by[("baseline", s)] for s in stage["study"].seeds])
    assert row["delta"] == pytest.approx(d.mean(), rel=1e-5)
    half = C.student_t_quantile(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    assert row["ci_hi"] - row["ci_lo"] == pytest.approx(2 * half, rel=1e-4)
    assert row["unit"] == "seed" and "paired t" in row["test"]


def test_references_table_sets_ours_beside_published(stage):
    refs, res = stage["refs"], stage["results"]
    base = res[(res.task == "tr_task") & (res.cell == "baseline")]["bleu"]
    r0 = refs.iloc[0]
    assert r0["cell"] == "baseline"  # defaults to the task's baseline cell
    assert r0["ours"] == pytest.approx(base.mean(), rel=1e-5)
    assert r0["ours_std"] == pytest.approx(base.std(ddof=1), rel=1e-4)
    assert r0["difference"] == pytest.approx(base.mean() - 30.0, rel=1e-5)
    r1 = refs.iloc[1]  # a published difference: ours is the mean per-seed difference
    by = res[res.task == "tr_task"].set_index(["cell", "seed"])["bleu"]
    d = np.mean([by[("pe_none", s)] - by[("baseline", s)] for s in stage["study"].seeds])
    assert r1["ours"] == pytest.approx(d, rel=1e-5) and bool(r1["same_sign"]) == (d < 0)
    tex = C.references_latex(pd.read_csv(Path(stage["root"]) / "reports" / stage["study"].name / "references.csv"))
    assert tex.count(r"\item[") == 3  # two settings differ, one note
    assert "Settings differ" in tex and r"$\approx$" in tex and "newstest2013" in tex
    assert tex.count("differs$^") == 2 and "matches" in tex


def test_report_contains_the_claims_and_references_sections(stage, monkeypatch):
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
    assert r"\section{Published results and claims}" in tex
    assert "Removing positional encoding hurts" in tex and "tab:references" in tex
    assert "Of 6 claims, 4 are supported, 1 contradicted and 1 inconclusive at this scale." in tex
    assert (Path("reports") / study.name / "report.pdf").stat().st_size > 10_000


def test_a_study_without_claims_writes_empty_tables_and_no_section(tmp_path, monkeypatch):
    study = load_study(ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml")
    assert study.claims == () and study.references == ()
    empty = C.evaluate_claims(study, pd.DataFrame(), pd.DataFrame())
    assert list(empty.columns) == C.CLAIM_COLUMNS and empty.empty
    assert C.claims_latex(empty) == "" and C.references_latex(pd.DataFrame(columns=C.REFERENCE_COLUMNS)) == ""


def test_shipped_studies_declare_claims_and_references():
    for p in ("workflow/studies/demo/params.yaml", "workflow/studies/mirror/params.yaml",
              "workflow/studies/gpu/params.yaml", "workflow/studies/cpu/params.yaml"):
        study = load_study(ROOT / p)
        assert study.claims and study.references, p


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
