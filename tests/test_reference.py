"""The check of a committed run (`check-reference`): passes on the same bytes, names every figure
that moved and by how much, and fails beyond the tolerance (a changed seed or learning rate)."""
import json
import subprocess
import sys

import pytest
import yaml

from pipeline_src.report import reference
from project_copy import checkout_env

JOB = ["--task", "reorder", "--cell", "baseline", "--seed", "0"]


def _stage(d, *args, check=True):
    return subprocess.run([sys.executable, "-m", "pipeline_src", *args, "--params", "tiny.yaml"], cwd=d,
                          env=checkout_env(PIPELINE_CPU_THREADS="1"), capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The tiny study trained and evaluated once, its run copied into a reference directory."""
    from test_train import _write_params
    d = tmp_path_factory.mktemp("reference")
    _write_params(d, max_steps=20, eval_every=10, log_every=10)
    for stage, arg in [("download", ["--dataset", "tiny_reorder"]), ("filter", ["--task", "reorder"]),
                       ("bpe", ["--task", "reorder"]), ("train", JOB), ("evaluate", JOB)]:
        _stage(d, stage, *arg)
    _stage(d, "check-reference", *JOB, "--reference", "ref", "--make")
    return d


def _retrain(d, **train):
    params = yaml.safe_load((d / "tiny.yaml").read_text())
    params["tasks"]["reorder"]["train"].update(train)
    (d / "tiny.yaml").write_text(yaml.safe_dump(params))
    for stage in ("train", "evaluate"):
        _stage(d, stage, *JOB)


def test_a_remade_run_has_the_reference_bytes(study):
    _retrain(study)
    proc = _stage(study, "check-reference", *JOB, "--reference", "ref")
    assert proc.returncode == 0 and "identical" in proc.stdout and "PASS" in proc.stdout


@pytest.mark.parametrize("change", [{"lr": 3.0e-3}, {"max_steps": 21}])
def test_the_check_fails_when_the_numbers_move(study, change):
    original = (study / "tiny.yaml").read_text()
    try:
        _retrain(study, **change)
        proc = _stage(study, "check-reference", *JOB, "--reference", "ref", check=False)
    finally:
        (study / "tiny.yaml").write_text(original)
    assert proc.returncode == 1, proc.stdout
    assert "FAIL" in proc.stdout and "same machine kind as the reference" in proc.stdout
    assert "moved beyond its tolerance" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    if "max_steps" in change:  # a count must match exactly
        assert "FAIL steps: 20 -> 21" in proc.stdout


AVX512 = ["avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"]


def _machine(cpu="AMD EPYC", flags=AVX512, aten="AVX512", **changes):
    return {"device": "cpu", "cpu": cpu, "vendor": "AuthenticAMD", "kernel_flags": flags, "aten_capability": aten,
            "kernel_env": {}, "threads": 1, "torch": "2.13.0+cpu", "numpy": "2.4.6", "precision": "fp32", **changes}


def _run_dir(tmp_path, name, bleu, loss, rouge2=None, **machine):
    d = tmp_path / name
    d.mkdir()
    (d / "train_metrics.json").write_text(json.dumps({"steps": 10, "best_val_loss": loss, "best_step": 10}))
    metrics = {"bleu": bleu, "test_ppl": 2.718281828 ** loss} | ({"rouge2": rouge2} if rouge2 is not None else {})
    (d / "eval_metrics.json").write_text(json.dumps({"metrics": metrics, "n_test": 30, "checkpoint_step": 10}))
    (d / "cost.json").write_text(json.dumps({"device_name": "AMD EPYC", "precision": "fp32",
                                             "machine": _machine(**machine)}))
    (d / "train_info.json").write_text(json.dumps({"provenance": {"versions": {"torch": "2.13.0+cpu"}}}))
    return d


def test_tolerances_on_the_same_and_on_another_machine_kind(tmp_path):
    ref = _run_dir(tmp_path, "ref", bleu=33.0, loss=2.0)
    within = _run_dir(tmp_path, "within", bleu=33.2, loss=2.005)
    passed, lines = reference.compare(ref, within)
    assert passed and any("ok   bleu: 33 -> 33.2" in line for line in lines)
    assert any(line.startswith("same machine kind as the reference") for line in lines)
    beyond = _run_dir(tmp_path, "beyond", bleu=33.5, loss=2.0)
    passed, lines = reference.compare(ref, beyond)
    assert not passed and any(line.strip().startswith("FAIL bleu: 33 -> 33.5") for line in lines)
    # another machine kind: the seeds' spread (std 0.4 BLEU -> +-1.2) decides, not the stated +-0.3
    other = _run_dir(tmp_path, "other", bleu=33.9, loss=2.0, cpu="Intel Xeon", vendor="GenuineIntel")
    passed, lines = reference.compare(ref, other, spread={"bleu": 0.4})
    assert passed and any(line.startswith("another machine kind (vendor: AuthenticAMD -> GenuineIntel") for line in lines)
    passed, _ = reference.compare(ref, other, spread={"bleu": 0.2})
    assert not passed
    # the tolerance printed is the one applied (3 x 0.0243 = 0.0729, not the stated 0.01)
    loss = _run_dir(tmp_path, "loss", bleu=33.0, loss=2.05, threads=2)
    passed, lines = reference.compare(ref, loss, spread={"best_val_loss": 0.0243, "test_ppl": 0.2})
    assert passed and any("best_val_loss: 2 -> 2.05" in line and "seed std = +-0.0729" in line for line in lines)
    # a perplexity's spread is relative to the study's level: a check run at perplexity 7.39 (a
    # shortened run) against seeds at 2.5 +- 0.05 (2 %) may move by 6 % of 7.39 = 0.443, not 3 x 0.05
    passed, lines = reference.compare(ref, loss, spread={"best_val_loss": 0.0243, "test_ppl": 0.05},
                                      level={"test_ppl": 2.5})
    assert passed and any("test_ppl: 7.38906 ->" in line and "(6 % of 7.38906)" in line for line in lines), lines
    assert not reference.compare(ref, loss, spread={"best_val_loss": 0.0243, "test_ppl": 0.05})[0]


def test_one_model_name_with_and_without_avx512_is_two_machine_kinds(tmp_path):
    """An "AMD EPYC" without AVX-512 computes with AVX2 kernels: its run is another draw of the
    seeds' noise, not a failed byte-for-byte check (what a model-name check concluded)."""
    ref = _run_dir(tmp_path, "ref", bleu=33.0, loss=5.763)
    avx2 = _run_dir(tmp_path, "avx2", bleu=33.0, loss=5.798, flags=["avx", "avx2", "fma"], aten="AVX2")
    passed, lines = reference.compare(ref, avx2, spread={"best_val_loss": 0.0238, "test_ppl": 1.72}, level={"test_ppl": 71.9})
    assert passed, lines
    assert any("kernel_flags:" in line and "aten_capability: AVX512 -> AVX2" in line for line in lines)
    assert any("best_val_loss" in line and "seed std = +-0.0714" in line for line in lines)
    # the same CPU with its kernels forced down is another kind too
    forced = _run_dir(tmp_path, "forced", bleu=33.0, loss=5.798, aten="AVX2", kernel_env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert any("kernel_env" in line for line in reference.compare(ref, forced, spread={"best_val_loss": 0.0238, "test_ppl": 1.72}, level={"test_ppl": 71.9})[1])
    # a reference made before runs recorded their machine facts: never assumed to be the same machine
    legacy = _run_dir(tmp_path, "legacy", bleu=33.0, loss=5.763)
    cost = json.loads((legacy / "cost.json").read_text())
    del cost["machine"]
    (legacy / "cost.json").write_text(json.dumps(cost))
    passed, lines = reference.compare(legacy, avx2, spread={"best_val_loss": 0.0238, "test_ppl": 1.72}, level={"test_ppl": 71.9})
    assert passed and any(line.startswith("another machine kind (device: not recorded") for line in lines)


def test_no_tolerance_lets_a_zero_pass(tmp_path):
    """A seed spread as large as the figure (ROUGE-2 0.96, 3 seed std = 0.99) is capped below half of it."""
    ref = _run_dir(tmp_path, "ref", bleu=33.0, loss=2.0, rouge2=0.96)
    zero = _run_dir(tmp_path, "zero", bleu=33.0, loss=2.0, rouge2=0.0, aten="AVX2")
    passed, lines = reference.compare(ref, zero, spread={"rouge2": 0.33})
    assert not passed and any(line.strip().startswith("FAIL rouge2: 0.96 -> 0") and "capped below 50 %" in line
                              for line in lines), lines
    near = _run_dir(tmp_path, "near", bleu=33.0, loss=2.0, rouge2=0.6, aten="AVX2")
    assert reference.compare(ref, near, spread={"rouge2": 0.33})[0]


def test_the_machine_facts_of_this_process():
    from pipeline_src.runtime import machine
    facts = machine.facts("fp32")
    assert facts["aten_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "NO AVX")
    assert set(facts["kernel_flags"]) <= set(machine.KERNEL_FLAGS) and facts["threads"] >= 1
    assert machine.differences(facts, dict(facts)) == []
    assert machine.differences(facts, dict(facts, kernel_flags=[])) == [f"kernel_flags: {facts['kernel_flags']} -> []"]


def test_a_perplexity_scored_with_another_stride_is_named(tmp_path):
    """The window and stride an lm run's perplexity was scored with compare exactly; a reference
    made before they were recorded was scored with non-overlapping windows of train.lm_seq_len."""
    def lm_run(name, lm_eval=None, ppl=176.0):
        d = _run_dir(tmp_path, name, bleu=33.0, loss=2.0)
        ev = json.loads((d / "eval_metrics.json").read_text())
        ev["metrics"] = {"test_ppl": ppl, "test_words": 82430}
        if lm_eval:
            ev["lm_eval"] = lm_eval
        (d / "eval_metrics.json").write_text(json.dumps(ev))
        (d / "train_info.json").write_text(json.dumps({"kind": "lm", "config": {"train": {"lm_seq_len": 128}}}))
        return d

    legacy = lm_run("legacy")
    same = lm_run("same", {"lm_window": 128, "lm_stride": 128, "lm_mean_context": 64.5, "lm_mean_context_val": 64.5})
    passed, lines = reference.compare(legacy, same)
    assert passed and not any("lm_" in line for line in lines), lines
    sliding = lm_run("sliding", {"lm_window": 128, "lm_stride": 64, "lm_mean_context": 96.5}, ppl=150.0)
    passed, lines = reference.compare(legacy, sliding)
    assert not passed and any(line.strip() == "FAIL lm_stride: 128 -> 64 (-64, -50.000 %; tolerance exact)"
                              for line in lines), lines
    assert not any("lm_window" in line or "lm_mean_context" in line for line in lines), lines


def _results_with_lr(directory, lr):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.csv").write_text(f"task,cell,seed,lr\nreorder,baseline,0,{lr}\nreorder,baseline,1,{lr}\n")
    return directory


def test_a_check_run_at_another_lr_than_the_reference_study_is_refused(tmp_path):
    """A study that chose its lr on a grid and a check run made from a shortened copy of it must
    train at one lr: the check names the key to set and the value."""
    from pipeline_src.common import StageError
    from pipeline_src.study.config import load_study
    from test_train import _write_params
    study = load_study(tmp_path / _write_params(tmp_path, lr=2.0e-3))
    reference.check_lr_matches(study, _results_with_lr(tmp_path / "same", 0.002), "reorder", "baseline")
    reference.check_lr_matches(study, tmp_path / "no_results", "reorder", "baseline")
    with pytest.raises(StageError, match=r"set tasks\.reorder\.train\.lr to 0\.003"):
        reference.check_lr_matches(study, _results_with_lr(tmp_path / "other", 0.003), "reorder", "baseline")


# The committed studies whose check run CI re-makes (.ci/run), with the params file it is made from.
SHIPPED_CHECKS = {"reports/reference/cpu": "workflow/studies/cpu/check.yaml",
                  "reports/reference/cnndm": "workflow/studies/cnndm/check.yaml"}


@pytest.mark.parametrize("ref", sorted(SHIPPED_CHECKS))
def test_each_shipped_check_run_trains_at_its_study_s_lr(ref):
    from pathlib import Path

    from pipeline_src.study.config import load_study
    root = Path(__file__).resolve().parents[1]
    study = load_study(root / SHIPPED_CHECKS[ref])
    runs = sorted((root / ref / "check").glob("*/*/seed*"))
    assert runs, f"{ref} has no check run"
    for run in runs:
        task, cell = run.parts[-3], run.parts[-2]
        reference.check_lr_matches(study, root / ref, task, cell)


def test_a_shortened_check_run_carries_the_spread_over_its_own_seeds(study):
    """A check params file with several seeds: --make trains on none of them itself, refuses while
    a seed is missing, then writes their spread beside the run; the check uses it on another
    machine kind instead of the study's spread (runs early in training differ far more)."""
    params = yaml.safe_load((study / "tiny.yaml").read_text())
    params["seeds"] = [0, 1, 2]
    (study / "tiny3.yaml").write_text(yaml.safe_dump(params))

    def stage(*args, check=True):
        return subprocess.run([sys.executable, "-m", "pipeline_src", *args, "--params", "tiny3.yaml"], cwd=study,
                              env=checkout_env(PIPELINE_CPU_THREADS="1"), capture_output=True, text=True, check=check)

    job = JOB[:-1]
    stage("train", *job, "1")
    stage("evaluate", *job, "1")
    refused = stage("check-reference", *JOB, "--reference", "ref3", "--make", check=False)
    assert refused.returncode == 1 and "needs seed 2 trained and evaluated too" in refused.stderr
    stage("train", *job, "2")
    stage("evaluate", *job, "2")
    made = stage("check-reference", *JOB, "--reference", "ref3", "--make")
    assert "spread over seeds 0, 1, 2 written to" in made.stdout
    std, mean, seeds = reference.check_seed_spread(study / "ref3", "reorder", "baseline")
    assert seeds == [0, 1, 2] and std["best_val_loss"] > 0 and "steps" in mean
    per_seed = [json.loads((study / f"data/tiny/runs/reorder/baseline/seed{s}/train_metrics.json").read_text())
                ["best_val_loss"] for s in seeds]
    assert mean["best_val_loss"] == pytest.approx(sum(per_seed) / 3)
    # the run dirs the check scripts glob (check/*/*/seed*) are the runs, not the spread file
    assert [p.name for p in (study / "ref3" / "check").glob("*/*/seed*")] == ["seed0"]
    assert reference.check_seed_spread(study / "ref", "reorder", "baseline") is None
