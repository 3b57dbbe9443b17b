"""Calibration and power of the claims' verdicts, measured on real training runs.

A demo-scale language-modelling task (the demo's generated grammar corpus, a 1-layer d32
decoder, 120 steps, ~0.5 s a run) is trained for 12 seeds in six cells: the baseline, four cells
that differ from it only by noise (another batch order: `train.data_order`, same
initialisation), and one with a real, planted difference (a lower peak learning rate). Then the
claims engine (report/claims.py) judges many comparisons drawn from these runs, exactly as a
study would:

* A/A: a noise cell against another noise cell (or the baseline) on 3 runs each. Any verdict
  other than "inconclusive" is a false positive; the rate must stay near the nominal 5 %.
* power: the planted cell against the baseline on 3 runs: how often it is found.
* adaptive seeds: the same with seeds {min: 3, max: 6} - a first look on 3 runs, the seed plan's
  decision, and a second look on 6 runs when the plan extends the comparison.

The comparisons reuse runs (12 seeds make 220 triples), so the rates are estimates from
dependent draws; a simulation with independent normal differences checks the same engine at a
precision the real runs cannot give, and checks claims of equality within a margin where they
are hardest to get right: a true difference of exactly the margin. The rates are printed.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline_src.study.config import load_study
from pipeline_src.report import claims as C

# The rates are printed in the run's summary ("measured", tests/conftest.py).
SEEDS = list(range(12))
NOISE = ["baseline", "order_1", "order_2", "order_3", "order_4"]
PLANTED = "lr_low"
PARAMS = {
    "study": "calib", "seeds": SEEDS, "device": "cpu",
    "datasets": {"grammar": {"kind": "lm", "generator": "grammar", "generator_seed": 3,
                             "generator_rows": {"train": 3000, "validation": 200, "test": 300}}},
    "tasks": {"lm": {
        "kind": "lm", "dataset": "grammar", "filter": {"unit": "words", "min_src_len": 1, "dedup": False},
        "bpe": {"vocab_size": 120, "character_coverage": 1.0},
        "model": {"arch": "decoder_only", "d_model": 32, "n_heads": 2, "dec_layers": 1, "enc_layers": 1, "d_ff": 64,
                  "dropout": 0.0, "max_len": 64},
        "train": {"max_steps": 120, "batch_tokens": 512, "lr": 1.0e-2, "warmup_steps": 20, "eval_every": 120,
                  "log_every": 40, "lm_seq_len": 32, "label_smoothing": 0.0},
        "eval": {"batch_size": 64, "n_samples": 0, "bootstrap": 10},
        "cells": NOISE + [PLANTED]}},
    "cells": {"baseline": {"family": "baseline"},
              **{f"order_{k}": {"family": "noise", "train": {"data_order": k}} for k in range(1, 5)},
              # 60 % of the baseline's lr: found in 94 of 100 triples with AVX2 and with ATen's default
              # kernels, far from the 0.8 the test asks; at 8e-3 it was found in exactly 80, where
              # one verdict moved by another CPU's floats would fail the test.
              PLANTED: {"family": "planted", "train": {"lr": 6.0e-3}}},
}


def _claim(cell: str, versus: str, expect: str = "lower") -> dict:
    return {"c": {"statement": f"{cell} vs {versus}", "source": "test", "origin": "test", "compare": [
        {"task": "lm", "cell": cell, "versus": versus, "metric": "test_ppl_word", "expect": expect}]}}


def _study(name: str, claims: dict, seeds=None):
    params = dict(PARAMS, claims=claims, seeds=seeds or SEEDS)
    Path(name).write_text(yaml.safe_dump(params, sort_keys=False))
    return load_study(name)


# Trains and evaluates the runs named on the command line ("cell:seed"), one after another in one
# process (no start-up per run), with the stage functions the pipeline calls.
_WORKER = """
import sys
from pipeline_src.evaluate import evaluator
from pipeline_src.study.config import load_study
from pipeline_src.train import trainer
study = load_study("calib.yaml")
for cell, seed in (arg.split(":") for arg in sys.argv[1:]):
    trainer.run(study, "lm", cell, int(seed))
    evaluator.run(study, "lm", cell, int(seed))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """72 real training runs and their evaluations, as results.csv rows: two worker processes
    (one per core) of one-thread runs, whose bytes do not depend on which worker made them."""
    import os
    import subprocess
    import sys

    from pipeline_src.data.bpe import run as bpe
    from pipeline_src.data.download import run as download
    from pipeline_src.data.filter import run as filter_
    from pipeline_src.report.aggregate import collect_results

    root = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("PIPELINE_QUIET", "1")
        mp.setenv("PIPELINE_CPU_THREADS", "1")
        study = _study("calib.yaml", {})
        download(study, "grammar")
        filter_(study, "lm", "default")
        bpe(study, "lm", "default", None)
        every = [f"{cell}:{seed}" for cell in NOISE + [PLANTED] for seed in SEEDS]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                           os.environ.get("PYTHONPATH", "")]))
        workers = [subprocess.Popen([sys.executable, "-c", _WORKER, *every[k::2]], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
        for worker in workers:
            out, _ = worker.communicate()
            assert worker.returncode == 0, out[-3000:]
        results = collect_results(study)
        yield root, results


def _verdicts(study, results: pd.DataFrame, subsets) -> list[str]:
    return [C.evaluate_claims(study, results[results["seed"].isin(s)])["verdict"].iloc[0] for s in subsets]


def _triples(rng, n: int):
    every = list(itertools.combinations(SEEDS, 3))
    return [every[i] for i in rng.choice(len(every), size=n, replace=False)]


def test_runs_trained_and_noise_cells_differ_only_by_noise(runs):
    _, results = runs
    assert not results["failed"].any(), results.loc[results["failed"], ["cell", "seed", "failure"]]
    ppl = results.pivot(index="seed", columns="cell", values="test_ppl_word")
    # Another batch order moves a run's result (noise), but not systematically.
    assert (ppl["order_1"] != ppl["baseline"]).all()
    assert (ppl[PLANTED] > ppl["baseline"]).mean() > 0.9


def test_a_a_comparisons_are_calibrated_and_a_planted_effect_is_found(runs, measured):
    root, results = runs
    rng = np.random.default_rng(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        false, total = 0, 0
        for i, (a, b) in enumerate(itertools.combinations(NOISE, 2)):
            study = _study(f"aa{i}.yaml", _claim(b, a))
            v = _verdicts(study, results, _triples(rng, 60))
            false += sum(x in ("supported", "contradicted") for x in v)
            total += len(v)
        planted = _study("planted.yaml", _claim(PLANTED, "baseline", expect="higher"))
        found = _verdicts(planted, results, _triples(rng, 100))
    fpr, power = false / total, found.count("supported") / len(found)
    measured(f"[calibration] real runs, 3 runs per cell: A/A verdicts {false}/{total} = {fpr:.1%} "
           f"(nominal 5 %); planted effect found {found.count('supported')}/{len(found)} = {power:.0%}")
    assert fpr <= 0.10
    assert power >= 0.8 and "contradicted" not in found


def test_adaptive_seeds_keep_the_error_rate_over_two_looks(runs, measured):
    from pipeline_src.report.plan import decide

    root, results = runs
    rng = np.random.default_rng(1)

    def judge(study, order) -> tuple[str, bool]:
        first = C.evaluate_claims(study, results[results["seed"].isin(order[:3])])
        _, extend = decide(study, first)
        if not extend:
            return first["verdict"].iloc[0], False
        return C.evaluate_claims(study, results[results["seed"].isin(order)])["verdict"].iloc[0], True

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        false = total = extended = 0
        for i, (a, b) in enumerate(itertools.combinations(NOISE, 2)):
            study = _study(f"seq{i}.yaml", _claim(b, a), seeds={"min": 3, "max": 6})
            assert study.adaptive_seeds and C.looks(study) == 2
            for _ in range(40):
                verdict, more = judge(study, list(rng.permutation(SEEDS)[:6]))
                false += verdict in ("supported", "contradicted")
                extended += more
                total += 1
        planted = _study("seq_planted.yaml", _claim(PLANTED, "baseline", expect="higher"), seeds={"min": 3, "max": 6})
        found = [judge(planted, list(rng.permutation(SEEDS)[:6]))[0] for _ in range(60)]
    fpr, power = false / total, found.count("supported") / len(found)
    measured(f"[calibration] real runs, adaptive seeds 3 -> 6: A/A verdicts {false}/{total} = {fpr:.1%} "
           f"({extended} comparisons extended); planted effect found {power:.0%}")
    assert fpr <= 0.10 and power >= 0.8


def test_simulated_a_a_with_independent_comparisons(measured):
    """Normal per-seed differences, independent A/A comparisons (10,000 with 3 runs, 5,000 with
    adaptive seeds), through the
    engine's decision for one comparison (claims.judge_alone) and the seed plan's rule."""
    from pipeline_src.report.plan import extends

    rng = np.random.default_rng(2)
    trials = 10_000
    base = rng.normal(100.0, 5.0, (trials, 6))
    cell = base + rng.normal(0.0, 1.0, (trials, 6))  # a cell's run shares its seed's init with the baseline's
    fixed = [C.judge_alone("lower", c[:3], b[:3], runs_needed=False)["verdict"] for c, b in zip(cell, base)]
    adaptive = []
    for c, b in zip(cell[:5000], base[:5000]):
        first = C.judge_alone("lower", c[:3], b[:3], n_looks=2)
        if extends(first["verdict"], first["runs_needed"], 6):
            first = C.judge_alone("lower", c, b, n_looks=2)
        adaptive.append(first["verdict"])
    rates = {name: sum(v in ("supported", "contradicted") for v in verdicts) / len(verdicts)
             for name, verdicts in (("fixed, 3 runs", fixed), ("adaptive 3 -> 6", adaptive))}
    measured("[calibration] simulated A/A (normal differences): "
           + ", ".join(f"{k}: {v:.2%}" for k, v in rates.items()) + " (nominal 5 %)")
    assert 0.043 <= rates["fixed, 3 runs"] <= 0.057  # calibrated: about alpha (3 standard errors)
    assert rates["adaptive 3 -> 6"] <= 0.055


def test_simulated_equality_claims_at_the_margin(measured):
    """A true difference of exactly the margin: "equal within +-m" and "different beyond +-m"
    are both wrong, so any verdict is an error; the engine must keep the two together at alpha.
    (Deciding on the smaller of the TOST p and the beyond-margin p, each at alpha, gives ~7.5 %
    here: TOST ~5 % plus the doubled one-sided test's 2.5 %.)"""
    rng = np.random.default_rng(3)
    trials = 4000
    d = rng.normal(1.0, 0.3, (trials, 3))
    verdicts = [C.judge_alone("equal", x, np.zeros(3), margin=1.0, runs_needed=False)["verdict"] for x in d]
    rate = sum(v in ("supported", "contradicted") for v in verdicts) / trials
    measured(f"[calibration] simulated equality claims at the margin, 3 runs: {rate:.2%} verdicts (nominal 5 %)")
    # At the margin the rate is alpha itself (alpha/2 for each verdict, the interval's two ends),
    # so the bound is alpha plus 3 standard errors of the estimate.
    assert rate <= 0.05 + 3 * (0.05 * 0.95 / trials) ** 0.5
