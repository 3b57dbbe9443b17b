"""Aggregate, figures, tables and report stages on a faked study (tests/fixtures/report/).

The fake runs are written by tests/fixtures/report/fake_study.py for the three-task study in
tests/fixtures/report/params.yaml. In it, `same_as_base` gets a copy of the baseline's
evaluation outputs (so every paired test must say p = 1) and `pe_none` is much worse (so every
paired test must say p < 0.05)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline_src.common import StageError
from pipeline_src.study.config import load_study
from pipeline_src.study.stages import data_paths, output_path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "report"
_spec = importlib.util.spec_from_file_location("fake_study", FIXTURES / "fake_study.py")
fake_study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_study)


def _tiny_model(vocab_size: int):
    import torch

    from pipeline_src.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab_size, d_model=32, n_heads=2, enc_layers=1, dec_layers=1, d_ff=64))
    return model.eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Fake study -> aggregate -> figures (tiny injected model) -> tables, in a temp dir."""
    root = tmp_path_factory.mktemp("study")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        shutil.copy(FIXTURES / "params.yaml", root / "params_test.yaml")
        study = fake_study.build("params_test.yaml", ".", n_test=30)
        fake_study.copy_baseline_eval(study, "tr_task", "same_as_base")
        from pipeline_src.report import aggregate, figures, tables

        aggregate.run(study)
        loaded = {}

        def loader(ckpt_dir):
            loaded["ckpt"] = str(ckpt_dir)
            return _tiny_model(150), {"config": study.cell("tr_task", "baseline").to_dict()}

        figures.run(study, model_loader=loader)
        tables.run(study)
        yield {"root": root, "study": study, "loaded": loaded}


@pytest.fixture
def in_root(built, monkeypatch):
    monkeypatch.chdir(built["root"])
    return built


def _reports(study) -> Path:
    return Path("reports") / study.name


# --- aggregate -------------------------------------------------------------------------------


def test_results_one_row_per_run_and_summary_mean_std(in_root):
    study = in_root["study"]
    results = pd.read_csv(_reports(study) / "results.csv")
    assert len(results) == sum(len(t.cells) for t in study.tasks.values()) * len(study.seeds)
    for col in ("task", "kind", "cell", "family", "label", "seed", "leaks_future", "test_ppl", "bleu", "rouge1",
                "test_ppl_word", "n_params", "steps", "best_val_loss", "wall_s", "tokens_per_s", "mfu", "peak_mem_mb"):
        assert col in results, col
    summary = pd.read_csv(_reports(study) / "summary.csv")
    row = summary[(summary.task == "tr_task") & (summary.cell == "pe_none")].iloc[0]
    values = []
    for seed in study.seeds:  # recomputed by hand from the evaluate stage's files
        ev = json.loads(Path(output_path("evaluate", "metrics", study=study.name, task="tr_task", cell="pe_none",
                                         seed=seed)).read_text())
        values.append(ev["metrics"]["bleu"])
    assert row["bleu_mean"] == pytest.approx(np.mean(values), rel=1e-5)
    assert row["bleu_std"] == pytest.approx(np.std(values, ddof=1), rel=1e-5)  # sample std
    assert row["n_seeds"] == 3 and row["n_failed"] == 0
    assert not results["failed"].any() and "s_per_mtok" in results
    # rates from the trainer's own counts (cost.json), per target token and per step
    assert results["train_flops_per_tgt_token"].to_numpy() == pytest.approx(18.0 * results["n_params"].to_numpy())
    assert results["processed_tokens_per_step"].to_numpy() == pytest.approx(2 * results["train_tokens"] / results["steps"])
    # an lm run's window, stride and mean context (lm_eval) are settings, not metrics: no column, no test
    assert not [c for c in results if c.startswith("lm_")] and "lm_eval" in _lm_eval_metrics(study)
    leaks = summary.set_index(["task", "cell"])["leaks_future"]
    assert bool(leaks[("lm_task", "encoder_only")]) and not bool(leaks[("lm_task", "baseline")])


def _lm_eval_metrics(study, cell="baseline") -> dict:
    return json.loads(Path(output_path("evaluate", "metrics", study=study.name, task="lm_task", cell=cell,
                                       seed=study.seeds[0])).read_text())


def test_report_states_how_perplexity_was_scored(in_root, tmp_path):
    import yaml

    from pipeline_src.report import build

    study = in_root["study"]
    lm_eval = _lm_eval_metrics(study)["lm_eval"]
    assert (lm_eval["lm_window"], lm_eval["lm_stride"]) == (128, 64)  # the default stride: half a window
    text = build._metrics_text(pd.read_csv(_reports(study) / "results.csv"), study)
    assert ("Perplexity on lm\\_task is scored with a sliding window of 128 tokens advanced by 64 (each window "
            "scores only the tokens no earlier window scored, so every token is scored once and, after the first "
            f"window, predicted from at least 65 preceding tokens; on the test set {lm_eval['lm_mean_context']:.1f} "
            "on average).") in text, text
    cpu_params = Path(__file__).resolve().parent.parent / "workflow/studies/cpu/params.yaml"
    cpu = load_study(cpu_params)
    assert build._lm_window_text(cpu, cpu.tasks["ptb"]).startswith(
        "Perplexity on ptb is scored with a sliding window of 128 tokens advanced by 64 (each window")
    # the same study with the stride at the window's length: non-overlapping windows, said so
    params = yaml.safe_load(cpu_params.read_text())
    params["tasks"]["ptb"].setdefault("eval", {})["lm_stride"] = 128
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    disjoint = load_study(tmp_path / "params.yaml")
    assert build._lm_window_text(disjoint, disjoint.tasks["ptb"]) == (
        "Perplexity on ptb is scored with a sliding window of 128 tokens advanced by 128 (non-overlapping windows: "
        "a token is predicted from 1 to 128 preceding tokens).")


def test_summarize_on_a_hand_made_table():
    from pipeline_src.report.aggregate import summarize

    results = pd.DataFrame({
        "task": ["t"] * 5, "kind": ["lm"] * 5, "cell": ["a", "a", "a", "b", "b"], "family": ["f"] * 5,
        "label": ["A", "A", "A", "B", "B"], "leaks_future": [False] * 5, "seed": [0, 1, 2, 0, 1],
        "test_ppl": [10.0, 12.0, 14.0, 5.0, np.nan], "wall_s": [1.0, 1.0, 4.0, 2.0, 2.0]})
    s = summarize(results).set_index("cell")
    assert s.loc["a", "test_ppl_mean"] == 12.0 and s.loc["a", "test_ppl_std"] == pytest.approx(2.0)
    assert s.loc["a", "wall_s_std"] == pytest.approx(np.std([1.0, 1.0, 4.0], ddof=1))
    assert s.loc["b", "test_ppl_mean"] == 5.0 and np.isnan(s.loc["b", "test_ppl_std"])  # one value: no std
    assert list(s.index) == ["a", "b"] and s.loc["a", "n_seeds"] == 3


def test_significance_identical_and_clearly_worse_cells(in_root):
    study = in_root["study"]
    sig = pd.read_csv(_reports(study) / "significance.csv")
    assert set(sig["cell"]) == {"pe_none", "same_as_base", "encoder_only"}  # never the baseline itself
    same = sig[sig.cell == "same_as_base"]
    assert set(same.metric) == {"bleu", "test_ppl"} and set(same.seed.astype(str)) == {"0", "1", "2", "runs"}
    assert (same.p_value == 1.0).all() and (same.delta == 0).all() and not same.significant.any()
    # The seed-level rows: a paired t over the three runs, q-values Benjamini-Hochberg-adjusted.
    worse = sig[(sig.cell == "pe_none") & (sig.seed.astype(str) == "runs")].set_index(["task", "metric"])
    assert set(worse.index) == {("tr_task", "bleu"), ("tr_task", "test_ppl"), ("sum_task", "rouge1"),
                                ("sum_task", "rouge2"), ("sum_task", "rougeLsum"), ("sum_task", "test_ppl")}
    assert (worse.n_runs == 3).all() and (worse.p_value < 0.05).all() and (worse.q_value >= worse.p_value).all()
    assert worse.loc[("tr_task", "bleu"), "delta"] < 0 and worse.loc[("tr_task", "test_ppl"), "delta"] > 0
    per_seed = sig[(sig.cell == "pe_none") & (sig.seed.astype(str) == "0") & (sig.metric == "bleu")]
    assert per_seed["n_examples"].iloc[0] == 30 and "trained models" in per_seed["about"].iloc[0]
    leak = sig[sig.cell == "encoder_only"]
    assert leak.leaks_future.all() and set(leak.metric) == {"test_ppl", "test_ppl_word"}
    # Word perplexity repeats the token perplexity's comparison: one test for Benjamini-Hochberg,
    # and the same q (the same mark) on both rows.
    runs = sig[sig.seed.astype(str) == "runs"]
    leak_runs = runs[runs.cell == "encoder_only"].set_index("metric")
    assert leak_runs.loc["test_ppl_word", "duplicate_of"] == "test_ppl"
    assert leak_runs.loc["test_ppl_word", "q_value"] == leak_runs.loc["test_ppl", "q_value"]
    assert runs[runs.metric != "test_ppl_word"]["duplicate_of"].isna().all()


def test_benjamini_hochberg_counts_a_repeated_comparison_once():
    from statsmodels.stats.multitest import multipletests

    from pipeline_src.report.aggregate import RUN_LEVEL, SIGNIFICANCE_COLUMNS, _false_discovery

    rows = [("a", "test_ppl", 0.010), ("a", "test_ppl_word", 0.012), ("a", "bleu", 0.040),
            ("b", "test_ppl_word", 0.030),  # b is on another tokenizer: no test_ppl, its own test
            ("b", "bleu", 0.045), ("c", "test_ppl", float("nan")), ("c", "test_ppl_word", float("nan"))]
    frame = pd.DataFrame([{"task": "t", "cell": c, "metric": m, "seed": RUN_LEVEL, "p_value": p} for c, m, p in rows]
                         + [{"task": "t", "cell": "a", "metric": "test_ppl_word", "seed": 0, "p_value": 0.001}],
                         columns=SIGNIFICANCE_COLUMNS)
    _false_discovery(frame)
    distinct = [0, 2, 3, 4]
    expect = multipletests(frame.loc[distinct, "p_value"], method="fdr_bh")[1]
    assert frame.loc[distinct, "q_value"].astype(float).to_numpy() == pytest.approx(expect)
    assert frame.loc[1, "q_value"] == frame.loc[0, "q_value"] and frame.loc[1, "duplicate_of"] == "test_ppl"
    assert frame.loc[[0, 2, 3, 4, 5, 6, 7], "duplicate_of"].isna().all()
    # Counted again, the repeat's small p would have passed for a second discovery and lowered the
    # step-up thresholds of the others: q 0.03 instead of 0.04 for a's token perplexity.
    assert frame.loc[0, "q_value"] == pytest.approx(0.04)
    assert multipletests(frame.loc[:4, "p_value"], method="fdr_bh")[1][0] == pytest.approx(0.03)
    assert frame.loc[5:6, "q_value"].isna().all() and pd.isna(frame.loc[7, "q_value"])  # no test, per-seed row


def test_aggregate_fails_in_one_line_on_missing_or_bad_input(in_root, tmp_path, monkeypatch):
    study = in_root["study"]
    from pipeline_src.report import aggregate

    work = tmp_path / "copy"
    shutil.copytree(in_root["root"] / "data", work / "data")
    shutil.copy(in_root["root"] / "params_test.yaml", work / "params_test.yaml")
    monkeypatch.chdir(work)
    target = Path(output_path("evaluate", "metrics", study=study.name, task="sum_task", cell="pe_none", seed=1))
    target.write_text("{not json")
    with pytest.raises(StageError) as e:
        aggregate.run(study)
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    target.unlink()
    with pytest.raises(StageError, match="missing"):
        aggregate.run(study)
    assert not Path("reports").exists()  # nothing half-written


# --- figures ---------------------------------------------------------------------------------


def test_figures_written_as_pdf_and_png(in_root):
    import matplotlib

    study = in_root["study"]
    figdir = _reports(study) / "figures"
    index = json.loads((figdir / "index.json").read_text())
    kinds = [f["kind"] for f in index]
    assert kinds.count("loss") == 3 and kinds.count("ablation") == 3
    assert "size" in kinds and "cost" in kinds and "attention" in kinds
    for f in index:
        assert (figdir / f"{f['name']}.pdf").read_bytes().startswith(b"%PDF")
        assert (figdir / f"{f['name']}.png").read_bytes().startswith(b"\x89PNG")
        assert f["caption"]
    # the heat map came from the injected tiny model, for the first training job's checkpoint
    assert in_root["loaded"]["ckpt"].endswith("runs/tr_task/baseline/seed0/ckpt")
    att = [f["name"] for f in index if f["kind"] == "attention"]
    assert att == ["attention_tr_task_encoder0_self", "attention_tr_task_decoder0_cross"]
    assert matplotlib.get_backend().lower() == "agg"


def test_attention_inputs_from_a_real_checkpoint(in_root):
    """The default loader (pipeline_src.train.trainer.load_trained_model) on the fake checkpoint, and the
    sample built from the BPE stage's arrays as the trainer feeds it (src + EOS, BOS + tgt)."""
    import torch

    from pipeline_src.report import figures

    study = in_root["study"]
    task = figures.attention_task(study)
    model, meta = figures.load_model(Path(output_path("train", "ckpt", study=study.name, task=task.name,
                                                      cell="baseline", seed=0)))
    src, tgt, src_p, tgt_p = figures.sample_inputs(task, Path(data_paths(study, task.name)[1]), "encoder_decoder")
    assert src[-1] == 3 and tgt[0] == 2 and len(src_p) == len(src) and len(tgt_p) == len(tgt)
    assert len(src) <= figures.ATTENTION_MAX_TOKENS and src_p[-1] == "</s>" and tgt_p[0] == "<s>"
    weights = model.attention_weights(torch.tensor([src]), torch.tensor([tgt]))
    assert weights["decoder.0.cross"].shape == (1, 2, len(tgt), len(src))
    with pytest.raises(StageError, match="missing"):
        figures.load_model(Path("no/such/ckpt"))


# --- tables ----------------------------------------------------------------------------------


from pipeline_src.report.tables import FITWIDTH  # noqa: E402


def _strip_math(tex: str) -> str:
    return re.sub(r"\$[^$]*\$", "", tex.replace(r"\$", ""))


def test_tables_escape_latex_specials(in_root):
    study = in_root["study"]
    tabdir = _reports(study) / "tables"
    index = json.loads((tabdir / "index.json").read_text())
    names = {t["name"] for t in index}
    assert {"datasets", "filtering", "hyperparameters", "cells", "cost", "results_tr_task", "results_sum_task",
            "results_lm_task", "ablation_positional_encoding", "ablation_dropout_rate",
            "ablation_architecture"} <= names
    for t in index:
        tex = (tabdir / f"{t['name']}.tex").read_text()
        body = _strip_math(tex.replace(FITWIDTH, ""))
        assert not re.search(r"(?<!\\)_", body), f"{t['name']}: unescaped underscore"
        for ch in "%#":
            assert not re.search(rf"(?<!\\){ch}", body), f"{t['name']}: raw {ch}"
    cells = (tabdir / "cells.tex").read_text().replace(r"\allowbreak{}", "")
    assert r"same\_as\_base" in cells and r"base\_model \& co" in cells
    assert r"dropout 0.1 = base \#1 \$x\_1\$" in cells
    results = (tabdir / "results_tr_task.tex").read_text()
    assert r"PE none (no\_pos) 100\%" in results


def test_tables_mark_significance_bold_and_leaks(in_root):
    tabdir = _reports(in_root["study"]) / "tables"
    tr = (tabdir / "results_tr_task.tex").read_text()
    pe_row = next(line for line in tr.splitlines() if line.startswith("PE none"))
    assert r"\ddag" in pe_row or r"\dag" in pe_row  # clearly worse: significant
    same_row = next(line for line in tr.splitlines() if line.startswith("dropout 0.1"))
    assert r"\dag" not in same_row and r"\ddag" not in same_row  # identical: not significant
    base_row = next(line for line in tr.splitlines() if "(base)" in line)
    assert r"\textbf" in base_row and r"\textbf" not in pe_row
    lm = (tabdir / "results_lm_task.tex").read_text()
    leak_row = next(line for line in lm.splitlines() if line.startswith("encoder-only"))
    assert r"\S" in leak_row and r"\textbf" not in leak_row  # lowest PPL, but leaks: not bold
    assert "leaks the future" in lm
    fam = (tabdir / "ablation_positional_encoding.tex").read_text()
    assert "tr\\_task" in fam and "sum\\_task" in fam and r"$\Delta$" in fam and "none" in fam


def test_tables_fail_on_missing_summary(in_root, tmp_path, monkeypatch):
    from pipeline_src.report import tables

    monkeypatch.chdir(tmp_path)
    with pytest.raises(StageError, match="summary.csv: missing"):
        tables.run(in_root["study"])


# --- report ----------------------------------------------------------------------------------


@pytest.fixture
def latexmk():
    if shutil.which("latexmk") is None:
        pytest.skip("latexmk is not installed (TeX Live: make system-deps)")


def test_report_builds_pdf(in_root, latexmk, capsys):
    from pipeline_src.report import build

    study = in_root["study"]
    build.run(study)
    pdf, tex = _reports(study) / "report.pdf", _reports(study) / "report.tex"
    assert pdf.read_bytes().startswith(b"%PDF") and pdf.stat().st_size > 20_000
    text = tex.read_text()
    assert r"\input{tables/results_tr_task}" in text and r"\input{tables/ablation_positional_encoding}" in text
    assert "attention_tr_task_decoder0_cross" in text and "Report test: a\\_b \\& c" in text
    assert "No " in text and "dvc.lock" in text  # no dvc.lock next to the params file
    assert "overfull" not in capsys.readouterr().err  # nothing sticks out of the margins
    assert not list(pdf.parent.glob(".report-build.*"))  # build directory cleaned up


def test_report_lists_dvc_lock_hashes(in_root, latexmk, monkeypatch):
    from pipeline_src.report import build

    Path("dvc.lock").write_text("schema: '2.0'\nstages:\n  aggregate@rtest:\n    cmd: python -m x\n    outs:\n"
                                "    - path: reports/rtest/results.csv\n      md5: 0123456789abcdef0123\n")
    try:
        text = build.render(in_root["study"])
    finally:
        Path("dvc.lock").unlink()
    assert "aggregate@rtest" in text and "0123456789" in text


def test_report_latex_error_is_one_line_and_keeps_old_pdf(in_root, latexmk, monkeypatch):
    from pipeline_src.report import build

    study = in_root["study"]
    pdf = _reports(study) / "report.pdf"
    pdf.write_bytes(b"%PDF old")
    good = build.render(study)
    monkeypatch.setattr(build, "render", lambda s: good.replace(r"\section{Data}", r"\section{Data}\undefinedmacro"))
    with pytest.raises(StageError) as e:
        build.run(study)
    msg = str(e.value)
    assert "\n" not in msg and "Undefined control sequence" in msg and "report.tex line" in msg
    assert pdf.read_bytes() == b"%PDF old"
    assert not list(pdf.parent.glob(".report-build.*"))


def test_latex_escape():
    from pipeline_src.report import latex_escape

    assert latex_escape("a_b & c% $d #e {f} ~g ^h \\i") == (
        r"a\_b \& c\% \$d \#e \{f\} \textasciitilde{}g \textasciicircum{}h \textbackslash{}i")
    assert latex_escape("--cores") == "-{}-cores"
    assert latex_escape("Grüße “x” – 日本 😀") == "Grüße ``x'' -- ?? ?"
    assert latex_escape(float("nan")) == "" and latex_escape(None) == ""


def test_the_report_states_each_cells_peak_lr_and_whether_it_was_tuned():
    import pandas as pd

    from pipeline_src.study.config import load_study
    from pipeline_src.report.build import _lr_text

    study = load_study(Path(__file__).parent / "fixtures" / "params" / "adaptive_lm.yaml")
    runs = pd.DataFrame([{"task": "lm", "cell": c, "lr": lr} for c, lr in
                         (("baseline", 0.01), ("lr_low", 0.008), ("order_1", 0.01), ("tuned", 0.003))])
    text = _lr_text(study, runs)
    assert "1 of 4 cells chose theirs on validation" in text
    assert "lm: baseline 0.01, lr\\_low 0.008, order\\_1 0.01, tuned 0.003 (tuned)." in text
    assert "did not record" in _lr_text(study, runs.drop(columns="lr"))
