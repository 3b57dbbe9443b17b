"""Fair comparisons and adaptive seeds, under both drivers, on a demo-scale study
(tests/fixtures/params/adaptive_lm.yaml: runs of about half a second):

* a cell's peak lr chosen on validation by the tune stage before its runs;
* adaptive seeds: three seeds for every cell, then the plan stage gives seeds 3 and 4 to both
  cells of the claim comparisons that the first round left unsettled but within reach, and the
  other jobs of those seeds write "not needed" records - a data-dependent DAG that Snakemake and
  DVC run alike (same runs, same bytes);
* a budget in target tokens: a decoder-only translation cell with the encoder-decoder's target
  tokens (tests of the training loop itself).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from project_copy import copy_project, without_shipped_pipelines

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FIXTURE = ROOT / "tests" / "fixtures" / "params" / "adaptive_lm.yaml"
PARAMS = "workflow/studies/adapt/params.yaml"

pytestmark = pytest.mark.slow


def _run(cmd, cwd):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(cwd))
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _copy(dest: Path) -> Path:
    without_shipped_pipelines(copy_project(dest))
    (dest / PARAMS).parent.mkdir(parents=True, exist_ok=True)
    (dest / PARAMS).write_text(FIXTURE.read_text())
    _run(["git", "init", "-q"], dest)
    _run([sys.executable, "-m", "pipeline_src", "dvc-yaml", "--params", PARAMS], dest)
    return dest


@pytest.fixture(scope="module")
def snakemake_repo(tmp_path_factory):
    repo = _copy(tmp_path_factory.mktemp("adaptive") / "snakemake")
    _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}"], repo)
    return repo


def _metrics(repo: Path, cell: str, seed: int) -> dict:
    return json.loads((repo / f"data/adapt/runs/lm/{cell}/seed{seed}/train_metrics.json").read_text())


def test_the_plan_rule_extends_exactly_the_unsettled_comparisons_within_reach():
    """The rule on fixed numbers (real runs put a planted effect on either side of a threshold,
    depending on the CPU's float kernels): settled, inconclusive within reach, beyond the cap,
    not tested."""
    import pandas as pd
    from pipeline_src.study.config import load_study
    from pipeline_src.report.plan import decide

    study = load_study(FIXTURE)  # seeds {min: 3, max: 5}: the cap is 5 runs
    claims = pd.DataFrame([
        {"claim": "settled", "task": "lm", "cell": "a", "versus": "baseline", "metric": "m",
         "verdict": "supported", "p_adjusted": 0.001, "runs_needed": 3.0},
        {"claim": "within_reach", "task": "lm", "cell": "b", "versus": "baseline", "metric": "m",
         "verdict": "inconclusive", "p_adjusted": 0.2, "runs_needed": 4.0},
        {"claim": "at_the_cap", "task": "lm", "cell": "c", "versus": "baseline", "metric": "m",
         "verdict": "inconclusive", "p_adjusted": 0.3, "runs_needed": 5.0},
        {"claim": "beyond_the_cap", "task": "lm", "cell": "d", "versus": "baseline", "metric": "m",
         "verdict": "inconclusive", "p_adjusted": 0.6, "runs_needed": 9.0},
        {"claim": "no_power_estimate", "task": "lm", "cell": "e", "versus": "baseline", "metric": "m",
         "verdict": "inconclusive", "p_adjusted": 0.9, "runs_needed": float("nan")},
        {"claim": "set_aside", "task": "lm", "cell": "f", "versus": "baseline", "metric": "m",
         "verdict": "not tested: run failed to train", "p_adjusted": None, "runs_needed": None},
    ])
    decisions, extend = decide(study, claims)
    by_claim = {d["claim"]: d["decision"] for d in decisions}
    assert by_claim["settled"] == "settled"
    assert by_claim["within_reach"] == by_claim["at_the_cap"] == "extend to 5 runs"
    assert by_claim["beyond_the_cap"] == "no more runs (needs 9 per cell; the cap is 5)"
    assert by_claim["no_power_estimate"].startswith("no more runs (needs")
    assert by_claim["set_aside"] == "no more runs (not tested: run failed to train)"
    assert extend == [{"task": "lm", "cell": "b"}, {"task": "lm", "cell": "baseline"}, {"task": "lm", "cell": "c"}]


def test_the_dag_runs_exactly_the_seeds_the_plan_gives(snakemake_repo):
    """Real runs under Snakemake: whatever the first round decided on this CPU, the plan's
    decisions follow its rule, the cells it extends (and only those) train seeds 3 and 4, the
    others' jobs write "not needed" records, and the report counts what ran."""
    from pipeline_src.report.plan import extends

    repo = snakemake_repo
    plan = json.loads((repo / "data/adapt/plan/seeds.json").read_text())
    decisions = {d["claim"]: d for d in plan["comparisons"]}
    assert set(decisions) == {"lower_lr_hurts", "order_is_noise", "tuned_same"}
    extended = set()
    for d in decisions.values():
        if d["verdict"] in ("supported", "contradicted"):
            assert d["decision"] == "settled", d
        elif extends(d["verdict"], d["runs_needed"], 5):
            assert d["decision"] == "extend to 5 runs", d
            extended |= {("lm", d["cell"]), ("lm", d["versus"])}
        else:
            assert d["decision"].startswith("no more runs"), d
    # The tuned cell trains at the baseline's lr (below): identical runs, equal on any CPU.
    assert decisions["tuned_same"]["decision"] == "settled"
    assert {(e["task"], e["cell"]) for e in plan["extend"]} == extended
    for cell in ("baseline", "lr_low", "order_1", "tuned"):
        for seed in (3, 4):
            tm = _metrics(repo, cell, seed)
            if ("lm", cell) in extended:
                assert tm["steps"] == 120
            else:
                assert tm["needed"] is False and "adaptive seeds" in tm["reason"]
                assert (repo / f"data/adapt/runs/lm/{cell}/seed{seed}/ckpt/NOT_NEEDED.json").exists()
    pd = __import__("pandas")
    results = pd.read_csv(repo / "reports/adapt/results.csv")
    runs = {cell: 5 if ("lm", cell) in extended else 3 for cell in ("baseline", "lr_low", "order_1", "tuned")}
    assert results.groupby("cell")["seed"].count().to_dict() == runs
    claims = pd.read_csv(repo / "reports/adapt/claims.csv").set_index("claim")
    assert (claims["looks"] == 2).all()  # each look tested at alpha / 2
    for claim, d in decisions.items():
        assert claims.loc[claim, "n_runs"] == min(runs[d["cell"]], runs[d["versus"]])
    tex = (repo / "reports/adapt/report.tex").read_text()
    assert "Adaptive seeds" in tex and (repo / "reports/adapt/report.pdf").exists()


def test_the_tuned_cell_trains_at_the_lr_chosen_on_validation(snakemake_repo):
    repo = snakemake_repo
    record = json.loads((repo / "data/adapt/tune/lm/tuned/tune.json").read_text())
    assert record["grid"] == [0.003, 0.01] and record["steps"] == 60
    losses = {t["lr"]: t["best_val_loss"] for t in record["trials"]}
    assert record["chosen_lr"] == min(losses, key=losses.get) == 0.01
    assert (repo / "data/adapt/tune/lm/tuned/trial_lr0p003.tsv").exists()
    info = json.loads((repo / "data/adapt/runs/lm/tuned/seed0/train_info.json").read_text())
    assert info["config"]["train"]["lr"] == 0.01
    # At the baseline's lr, the tuned cell's runs are the baseline's, bit for bit.
    for seed in (0, 1, 2):
        assert _metrics(repo, "tuned", seed) == _metrics(repo, "baseline", seed)


def test_dvc_runs_the_same_data_dependent_dag(snakemake_repo, tmp_path):
    repo = _copy(tmp_path / "dvc")
    dvc_file = "workflow/studies/adapt/dvc.yaml"
    _run([BIN / "dvc", "init", "-q", "--force"], repo)
    out = _run([BIN / "dvc", "repro", f"{dvc_file}:claims"], repo)
    ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", out))
    assert {"tune@lm-tuned", "plan", "train-extra@lm-lr_low-s4", "claims"} <= ran, sorted(ran)
    for cell in ("baseline", "lr_low", "order_1", "tuned"):
        for seed in range(5):
            assert _metrics(repo, cell, seed) == _metrics(snakemake_repo, cell, seed), (cell, seed)
    assert (repo / "data/adapt/plan/seeds.json").read_text() == \
        (snakemake_repo / "data/adapt/plan/seeds.json").read_text()
    assert "Running stage" not in _run([BIN / "dvc", "repro", f"{dvc_file}:claims"], repo)


# --- budgets in target tokens ----------------------------------------------------------------------


def test_a_target_token_budget_gives_a_decoder_only_cell_the_same_target_tokens(tmp_path, monkeypatch):
    """The encoder-decoder and a decoder-only cell (whose batches also hold the source) train to
    the same max_target_tokens: equal target tokens, evaluated at the step that reached them."""
    from pipeline_src.train import trainer
    from pipeline_src.study.config import load_study
    from test_train import TINY, _prepare_data

    params = yaml.safe_load(TINY.read_text())
    params["tasks"]["reorder"]["train"].update(max_steps=1000, max_target_tokens=6000, eval_every=50, max_src_len=64,
                                               max_tgt_len=64)
    params["cells"]["decoder_only"] = {"family": "architecture", "model": {"arch": "decoder_only"}}
    params["tasks"]["reorder"]["cells"].append("decoder_only")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(params))
    _prepare_data(tmp_path, "tiny.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_QUIET", "1")
    study = load_study("tiny.yaml")
    seen, shapes, counted = {}, [], trainer.batch_training_flops
    monkeypatch.setattr(trainer, "batch_training_flops", lambda cfg, src, tgt: shapes.append((cfg, src, tgt)) or
                        counted(cfg, src, tgt))
    for cell in ("baseline", "decoder_only"):
        shapes.clear()
        trainer.run(study, "reorder", cell, 0)
        tm = json.loads(Path(f"data/tiny/runs/reorder/{cell}/seed0/train_metrics.json").read_text())
        cost = json.loads(Path(f"data/tiny/runs/reorder/{cell}/seed0/cost.json").read_text())
        # the FLOPs and tokens the trainer counted: one batch a step, at the batch's real shapes
        assert len(shapes) == tm["steps"] and all((src is None) == (cell == "decoder_only") for _, src, _ in shapes)
        assert cost["train_flops"] == pytest.approx(sum(counted(*call) for call in shapes), rel=1e-12)
        assert cost["target_tokens"] == tm["train_tokens"] < cost["processed_tokens"]  # + the source's tokens
        info = json.loads(Path(f"data/tiny/runs/reorder/{cell}/seed0/train_info.json").read_text())
        log = Path(f"data/tiny/runs/reorder/{cell}/seed0/train_log.tsv").read_text().splitlines()
        assert info["stop_reason"] == "max_target_tokens" and 6000 <= tm["train_tokens"] < 6000 + 600
        last = dict(zip(log[0].split("\t"), log[-1].split("\t")))
        assert int(last["step"]) == tm["steps"] and last["val_loss"] != ""  # evaluated where it stopped
        seen[cell] = tm
    assert seen["decoder_only"]["steps"] > seen["baseline"]["steps"]  # its batches hold fewer target tokens
    assert seen["decoder_only"]["epochs_seen"] == pytest.approx(seen["baseline"]["epochs_seen"], rel=0.1)
