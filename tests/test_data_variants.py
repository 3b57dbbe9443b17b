"""Cells that reach the data (filter/bpe overrides), and two-stage screening.

* data variants: cells with equal effective filter/bpe settings share one filter job and one
  tokenizer job; the DAG forks at the earliest data stage a cell changes; editing one cell's
  override changes only that cell's jobs;
* nested samples; SentencePiece model types; tokenizer-aware comparisons;
* the promotion rule (deterministic, top-k / threshold) and the stage-two gate.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline_src.data import bpe
from pipeline_src.study import screening
from pipeline_src.report import promote
from pipeline_src.common import StageError
from pipeline_src.study.config import ConfigError, load_study
from pipeline_src.data import filter as filt
from pipeline_src.runtime.dvc_yaml import render
from pipeline_src.study.stages import build_jobs, code_manifest_path, data_paths, output_path, promotion_path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml"

DATA_CELLS = {
    "data_half": {"family": "data_size", "filter": {"sample_fraction": 0.5}},
    "data_half_again": {"family": "data_size", "label": "same data, other label", "filter": {"sample_fraction": 0.5}},
    "tok_char": {"family": "tokenizer", "bpe": {"model_type": "char"}},
    "tok_char_half": {"family": "tokenizer", "filter": {"sample_fraction": 0.5}, "bpe": {"model_type": "char"}},
    "same_as_base": {"family": "data_size", "filter": {"sample_fraction": 1.0}},
}


def write_params(tmp_path: Path, cells=DATA_CELLS, screening_section=None, name="p.yaml", grid=True) -> Path:
    """The tiny study plus `cells`, in reorder's own grid unless grid=False (defined only, e.g.
    for a screening)."""
    params = yaml.safe_load(TINY.read_text())
    params["cells"].update(cells)
    if grid:
        params["tasks"]["reorder"]["cells"] += list(cells)
    if screening_section:
        params["screening"] = screening_section
    path = tmp_path / name
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def test_equal_data_settings_share_one_variant_and_forks_start_where_a_cell_changes(tmp_path):
    study = load_study(write_params(tmp_path))
    v = {c: study.data_variant("reorder", c) for c in study.tasks["reorder"].cells}
    assert v["baseline"] == v["pe_none"] == v["same_as_base"] == ("default", "bpe60")
    assert v["data_half"] == v["data_half_again"] == ("sample_fraction-0p5", "bpe60")
    assert v["tok_char"] == ("default", "char") and v["tok_char_half"] == ("sample_fraction-0p5", "char")
    jobs = build_jobs(study)
    filters = sorted(j.key for j in jobs if j.stage == "filter")
    bpes = sorted(j.key for j in jobs if j.stage == "bpe")
    assert filters == ["reorder-default", "reorder-sample_fraction-0p5"]  # tokenizer-only cells share the filter
    assert bpes == ["reorder-default-bpe60", "reorder-default-char", "reorder-sample_fraction-0p5-bpe60",
                    "reorder-sample_fraction-0p5-char"]
    train = {j.wildcards["cell"]: j for j in jobs if j.stage == "train"}
    assert train["tok_char"].deps[0] == "data/tiny/bpe/reorder/default/char"
    assert train["data_half_again"].deps[0] == train["data_half"].deps[0] == \
        "data/tiny/bpe/reorder/sample_fraction-0p5/bpe60"
    bpe_job = next(j for j in jobs if j.key == "reorder-sample_fraction-0p5-char")
    assert bpe_job.deps[0] == "data/tiny/filtered/reorder/sample_fraction-0p5"
    assert "--filter-variant sample_fraction-0p5 --bpe-variant char" in bpe_job.cmd
    assert study.bpe_config("reorder", "default", "char").model_type == "char"
    assert study.filter_config("reorder", "sample_fraction-0p5").sample_fraction == 0.5
    # The generated dvc.yaml keeps one foreach stage per stage despite the forks.
    stages = yaml.safe_load(render(study))["stages"]
    kinds = {"download", "filter", "bpe", "train", "evaluate", "aggregate", "figures", "tables", "claims", "report"}
    assert set(stages) == kinds | {f"code-{kind}" for kind in kinds}  # and a code record per stage kind
    assert len(stages["bpe"]["foreach"]) == 4


def test_editing_one_cells_override_changes_only_its_jobs(tmp_path):
    before = {(j.stage, j.key): (j.cmd, j.deps, j.param_hash) for j in build_jobs(load_study(write_params(tmp_path)))}
    cells = dict(DATA_CELLS, tok_char={"family": "tokenizer", "bpe": {"model_type": "unigram"}})
    after = {(j.stage, j.key): (j.cmd, j.deps, j.param_hash)
             for j in build_jobs(load_study(write_params(tmp_path, cells, name="q.yaml")))}
    # Compare jobs by what they run (the params file name differs, so drop it from the command).
    norm = lambda d: {k: (v[0].replace("p.yaml", "X").replace("q.yaml", "X"), v[1]) for k, v in d.items()}  # noqa: E731
    b, a = norm(before), norm(after)
    changed = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert changed == {("bpe", "reorder-default-char"), ("bpe", "reorder-default-unigram60"),
                       ("train", "reorder-tok_char-s0"), ("evaluate", "reorder-tok_char-s0")}, changed


def test_variant_names_are_valid_and_distinct_for_odd_values(tmp_path):
    cells = {"odd": {"family": "x", "filter": {"splits_to_filter": ["train", "validation"], "max_ratio": 2.5}},
             "odd2": {"family": "x", "filter": {"splits_to_filter": ["train", "validation"], "max_ratio": 2.25}}}
    study = load_study(write_params(tmp_path, cells))
    a, b = study.data_variant("reorder", "odd")[0], study.data_variant("reorder", "odd2")[0]
    assert a != b and a.startswith("max_ratio-2p5")
    assert all(c.isalnum() or c in "_-" for c in a + b)
    cells = {"c1": {"family": "t", "bpe": {"model_type": "char"}},
             "c2": {"family": "t", "bpe": {"model_type": "char", "vocab_size": 40}},
             "u": {"family": "t", "bpe": {"model_type": "unigram", "vocab_size": 40, "character_coverage": 0.99}}}
    study = load_study(write_params(tmp_path, cells, name="c.yaml"))
    assert [study.data_variant("reorder", c)[1] for c in cells] == [
        "char", "char-vocab_size-40", "unigram40-character_coverage-0p99"]


def test_bad_override_names_the_key(tmp_path):
    cells = {"bad": {"family": "x", "bpe": {"model_type": "wordpiece"}}}
    with pytest.raises(ConfigError) as err:
        load_study(write_params(tmp_path, cells))
    assert "cells.bad.bpe.model_type" in str(err.value) and "\n" not in str(err.value)


def _sampled(n: int, cfg) -> set[int]:
    rules = filt._Rules("t", "d", "train", "f", n, np.ones(n, dtype=np.int64))
    rules.keep[::7] = False  # other rules already dropped some rows
    filt._sample(rules, cfg, "train", lambda k: "")
    return set(np.flatnonzero(rules.keep).tolist())


def test_samples_are_nested_and_independent_of_the_fraction_order():
    from pipeline_src.study.config import FilterConfig

    small, mid, full = (_sampled(1000, FilterConfig(sample_fraction=f)) for f in (0.1, 0.3, 1.0))
    assert len(small) == round(0.1 * len(full)) and len(mid) == round(0.3 * len(full))
    assert small < mid < full
    sized = _sampled(1000, FilterConfig(sample_size=50))
    assert sized < small  # sample_size takes the first rows of the same order
    assert _sampled(1000, FilterConfig(sample_fraction=0.3)) == mid  # deterministic
    assert _sampled(1000, FilterConfig(sample_fraction=0.3, sample_seed=1)) != mid


@pytest.mark.parametrize("model_type", ["char", "unigram", "word"])
def test_sentencepiece_model_types_round_trip(model_type):
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "bird", "flew"]
    texts = [" ".join(rng.choice(words, size=6)) for _ in range(300)]
    model, stats = bpe.train_spm(texts, vocab_size=60, character_coverage=1.0, max_sentences=1000,
                                 model_type=model_type)
    sp = spm.SentencePieceProcessor(model_proto=model)
    assert sp.get_piece_size() <= 60
    pieces = sp.encode(texts[0], out_type=str)
    if model_type == "char":
        assert all(len(p) == 1 for p in pieces)
    if model_type == "word":
        assert len(pieces) == 6
    assert [sp.decode(sp.encode(t)) for t in texts[:20]] == texts[:20]


def test_data_stages_write_each_variant_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path)
    env = {"PYTHONPATH": str(ROOT), "PIPELINE_QUIET": "1", "PATH": str(Path(sys.executable).parent)}
    study = load_study(params)
    for job in build_jobs(study):
        if job.stage in ("download", "filter", "bpe"):
            subprocess.run(job.cmd.split(), cwd=tmp_path, env=env, check=True, capture_output=True)
    full = json.loads((tmp_path / data_paths(study, "reorder")[0] / "stats.json").read_text())
    half = json.loads((tmp_path / data_paths(study, "reorder", "data_half")[0] / "stats.json").read_text())
    assert half["rows"]["train"] == round(full["rows"]["train"] / 2)
    assert half["rows"]["test"] == full["rows"]["test"]  # evaluation data is the same for every cell
    char = json.loads((tmp_path / data_paths(study, "reorder", "tok_char")[1] / "stats.json").read_text())
    base = json.loads((tmp_path / data_paths(study, "reorder")[1] / "stats.json").read_text())
    assert char["model_type"] == "char" and base["model_type"] == "bpe"
    assert char["tokens"]["test"]["tgt"] > base["tokens"]["test"]["tgt"]  # more, shorter pieces
    assert sorted(p.name for p in (tmp_path / "data/tiny/bpe/reorder").iterdir()) == ["default", "sample_fraction-0p5"]


def test_token_level_metrics_are_compared_only_under_one_tokenizer(tmp_path):
    from pipeline_src.report import comparable

    study = load_study(write_params(tmp_path))
    assert comparable(study, "reorder", "pe_none", "test_ppl")
    assert not comparable(study, "reorder", "tok_char", "test_ppl")
    assert not comparable(study, "reorder", "data_half", "test_ppl")  # its tokenizer learnt on the subset
    assert comparable(study, "reorder", "tok_char", "test_ppl_word") and comparable(study, "reorder", "tok_char", "bleu")


# --- two-stage screening ---------------------------------------------------------------------------

SCREEN_CELLS = {
    "heads_1": {"family": "heads", "model": {"n_heads": 1}},
    "no_residual": {"family": "residual", "model": {"residual": False}},
}


def screen_params(tmp_path, promote, name="s.yaml"):
    section = {"scr": {"task": "reorder", "cells": ["baseline", "pe_none", "heads_1", "no_residual"],
                       "stage_one": {"filter": {"sample_fraction": 0.5}}, "promote": promote}}
    # heads_1 and no_residual are screened only; baseline and pe_none are also in reorder's grid.
    return load_study(write_params(tmp_path, SCREEN_CELLS, section, name, grid=False))


def _tests(**families):
    cells = {"positional_encoding": "pe_none", "heads": "heads_1", "residual": "no_residual"}
    return {cells[f]: {"delta": d, "p_value": p, "base": 10.0, "cell_score": 10.0 + d} for f, (d, p) in families.items()}


def test_promotion_rule_is_deterministic_with_top_k_and_threshold(tmp_path):
    tests = _tests(positional_encoding=(-3.0, 0.01), heads=(0.5, 0.01), residual=(-9.0, 0.2))
    ranked = promote.rank_families(screen_params(tmp_path, {"top_k": 2}), "scr", tests)
    # p-value first, then |delta|: positional_encoding (0.01, 3.0) before heads (0.01, 0.5).
    assert [(r["family"], r["rank"], r["promoted"]) for r in ranked] == [
        ("positional_encoding", 1, True), ("heads", 2, True), ("residual", 3, False)]
    ranked = promote.rank_families(screen_params(tmp_path, {"max_p": 0.05}, "t.yaml"), "scr", tests)
    assert [r["family"] for r in ranked if r["promoted"]] == ["positional_encoding", "heads"]
    ranked = promote.rank_families(screen_params(tmp_path, {"max_p": 0.05, "top_k": 1}, "u.yaml"), "scr", tests)
    assert [r["family"] for r in ranked if r["promoted"]] == ["positional_encoding"]
    nan = _tests(positional_encoding=(0.0, float("nan")), heads=(1.0, 0.5), residual=(2.0, 0.5))
    ranked = promote.rank_families(screen_params(tmp_path, {"top_k": 1}, "v.yaml"), "scr", nan)
    assert [r["family"] for r in ranked] == ["residual", "heads", "positional_encoding"]  # NaN p ranks last


def test_screening_stages_form_a_static_dag(tmp_path):
    study = screen_params(tmp_path, {"top_k": 1})
    assert set(study.screen_tasks) == {"scr-s1", "scr-s2"} and set(study.tasks) == {"reorder"}
    assert study.filter_config("scr-s1", "default").sample_fraction == 0.5
    assert study.filter_config("scr-s2", "default").sample_fraction == 1.0
    jobs = {(j.stage, j.key): j for j in build_jobs(study)}
    promo = promotion_path(study, "scr")
    assert jobs[("promote", "scr")].out("promotion") == promo
    assert all(d.startswith("data/tiny/eval/scr-s1/") for d in jobs[("promote", "scr")].deps
               if d.startswith("data/") and d != code_manifest_path(study, "promote"))
    # Stage two is reorder's full data at reorder's settings: no data jobs of its own, and the
    # cells reorder's grid trains (baseline, pe_none) are read from reorder's runs, not retrained.
    assert not any(j.wildcards.get("task") == "scr-s2" for j in jobs.values() if j.stage in ("filter", "bpe"))
    assert ("train", "scr-s2-baseline-s0") not in jobs and ("evaluate", "scr-s2-pe_none-s0") not in jobs
    assert study.run_task("scr-s2", "pe_none") == "reorder" and study.run_task("scr-s2", "heads_1") == "scr-s2"
    assert "data/tiny/runs/reorder/pe_none/seed0/train_metrics.json" in jobs[("tables", "tiny")].deps
    assert "data/tiny/runs/scr-s2/heads_1/seed0/train_metrics.json" in jobs[("tables", "tiny")].deps
    assert jobs[("train", "scr-s2-heads_1-s0")].deps[0] == "data/tiny/bpe/reorder/default/bpe60"
    # The other stage-two jobs exist; their training waits for the promotion record.
    assert promo in jobs[("train", "scr-s2-heads_1-s0")].deps
    assert promo not in jobs[("train", "scr-s1-heads_1-s0")].deps
    # Stage one's data settings are params its data jobs read (edits rerun them under DVC).
    assert "screening.scr.stage_one.filter" in jobs[("filter", "scr-s1-default")].params
    # The study's own report steps see the study's tasks only; the tables also the screening.
    assert not any("scr-" in d for d in jobs[("aggregate", "tiny")].deps)
    assert promo in jobs[("tables", "tiny")].deps
    stages = yaml.safe_load(render(study))["stages"]
    assert {"train-scr-s1", "train-scr-s2-gated", "promote"} <= set(stages) and "train-scr-s2" not in stages


def test_not_promoted_jobs_write_records_instead_of_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    study = screen_params(tmp_path, {"top_k": 1})
    path = Path(promotion_path(study, "scr"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"promoted": ["heads"]}))
    assert screening.promoted(study, "scr-s2", "heads_1") and screening.promoted(study, "scr-s2", "baseline")
    assert not screening.promoted(study, "scr-s2", "no_residual")
    assert screening.promoted(study, "scr-s1", "no_residual")
    with pytest.raises(StageError, match="stage two reads reorder/pe_none's runs"):
        screening.require_own_run(study, "train", "scr-s2", "pe_none")
    from pipeline_src.evaluate import evaluator
    from pipeline_src.train import trainer

    trainer.run(study, "scr-s2", "no_residual", 0)
    path_fields = dict(study="tiny", task="scr-s2", cell="no_residual", seed=0)
    for name in ("ckpt", "metrics", "log", "cost"):
        assert Path(output_path("train", name, **path_fields)).exists(), name
    assert json.loads(Path(output_path("train", "metrics", **path_fields)).read_text())["promoted"] is False
    assert not list(Path(output_path("train", "ckpt", **path_fields)).glob("*.pt"))
    evaluator.run(study, "scr-s2", "no_residual", 0)
    assert json.loads(Path(output_path("evaluate", "metrics", **path_fields)).read_text())["promoted"] is False
    assert Path(output_path("evaluate", "outputs", **path_fields)).is_dir()


def test_held_verdict_compares_stage_two_with_stage_one(tmp_path, monkeypatch):
    """held: stage two reaches the same verdict at alpha (significant or not) and, when
    significant, in the same direction; families that were not promoted have no verdict."""
    monkeypatch.chdir(tmp_path)
    study = screen_params(tmp_path, {"top_k": 3})
    families = [  # stage one: (family, cell, delta, p, promoted)
        ("positional_encoding", "pe_none", -3.0, 0.01, True),   # stage two: significant, same sign -> held
        ("heads", "heads_1", 2.0, 0.01, True),                  # stage two: significant, sign flipped -> not held
        ("residual", "no_residual", -1.0, 0.30, True),          # stage two: not significant either -> held
    ]
    stage_two = {"pe_none": (-2.5, 0.02), "heads_1": (-1.0, 0.01), "no_residual": (-0.2, 0.6)}
    record = {"metric": "bleu", "promoted": [f for f, *_, p in families if p],
              "families": [{"family": f, "cell": c, "delta": d, "p_value": p, "promoted": pr, "rank": i + 1,
                            "base": 10.0, "cell_score": 10.0 + d} for i, (f, c, d, p, pr) in enumerate(families)]}
    path = Path(promotion_path(study, "scr"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    asked = {}

    def fake_tests(study_, task, cells, metric):
        asked.update(task=task, cells=list(cells), metric=metric)
        return {c: {"delta": stage_two[c][0], "p_value": stage_two[c][1]} for c in cells}

    monkeypatch.setattr(promote, "_tests", fake_tests)
    rows = {r["family"]: r for r in promote.held(study, "scr", alpha=0.05)}
    assert asked == {"task": "scr-s2", "cells": ["pe_none", "heads_1", "no_residual"], "metric": "bleu"}
    assert rows["positional_encoding"]["held"] is True and rows["positional_encoding"]["delta2"] == -2.5
    assert rows["heads"]["held"] is False
    assert rows["residual"]["held"] is True
    # A significant stage-one effect that vanishes at full scale did not hold; a family that was
    # not promoted is not tested again.
    stage_two["pe_none"] = (-0.1, 0.5)
    record["families"][2]["promoted"] = False
    path.write_text(json.dumps(record))
    rows = {r["family"]: r for r in promote.held(study, "scr", alpha=0.05)}
    assert rows["positional_encoding"]["held"] is False
    assert rows["residual"]["held"] is None and rows["residual"]["delta2"] is None
    assert asked["cells"] == ["pe_none", "heads_1"]
