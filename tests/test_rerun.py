"""Editing one cell in the params file reruns exactly that cell's train/evaluate jobs and the
report steps, under Snakemake and under DVC. Runs a real (tiny) study in a scratch copy of the repo."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from project_copy import copy_project, without_shipped_pipelines
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml"
BIN = Path(sys.executable).parent
PARAMS = "workflow/studies/tiny/params.yaml"
REPORT_STEPS = {"aggregate", "figures", "tables", "claims", "report"}

pytestmark = pytest.mark.slow


def _run(cmd, cwd, **kw):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(cwd))
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _edit_cell(repo: Path, **model):
    path = repo / PARAMS
    params = yaml.safe_load(path.read_text())
    params["cells"]["pe_none"].setdefault("model", {}).update(model)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A git + DVC copy of the project with a tiny study, run once end to end by Snakemake."""
    repo = tmp_path_factory.mktemp("rerun") / "repo"
    without_shipped_pipelines(copy_project(repo))
    (repo / PARAMS).parent.mkdir(parents=True, exist_ok=True)
    # The tiny study plus cells that reach the data (a data-size and a tokenizer cell) and a
    # two-stage screening, so the forks and the promotion run under both drivers.
    params = yaml.safe_load(TINY.read_text())
    params["cells"].update({
        "data_half": {"family": "data_size", "filter": {"sample_fraction": 0.5}},
        "tok_char": {"family": "tokenizer", "bpe": {"model_type": "char"}},
        "heads_1": {"family": "heads", "model": {"n_heads": 1}},
        "no_residual": {"family": "residual", "model": {"residual": False}}})
    params["tasks"]["reorder"]["cells"] += ["data_half", "tok_char"]
    params["screening"] = {"scr": {"task": "reorder", "cells": ["baseline", "heads_1", "no_residual"],
                                   "stage_one": {"filter": {"sample_fraction": 0.5}}, "promote": {"top_k": 1}}}
    (repo / PARAMS).write_text(yaml.safe_dump(params, sort_keys=False))
    _run(["git", "init", "-q"], repo)
    _run([sys.executable, "-m", "pipeline_src", "dvc-yaml", "--params", PARAMS], repo)
    _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}"], repo)
    assert (repo / "reports/tiny/report.pdf").exists()
    return repo


def test_screening_promotes_one_family_and_records_the_rest(repo):
    record = json.loads((repo / "data/tiny/screening/scr/promotion.json").read_text())
    assert len(record["promoted"]) == 1 and {f["family"] for f in record["families"]} == {"heads", "residual"}
    (loser,) = [f["cell"] for f in record["families"] if not f["promoted"]]
    (winner,) = [f["cell"] for f in record["families"] if f["promoted"]]
    assert json.loads((repo / f"data/tiny/runs/scr-s2/{loser}/seed0/train_metrics.json").read_text())["promoted"] is False
    assert (repo / f"data/tiny/runs/scr-s2/{winner}/seed0/ckpt/best.pt").exists()
    tables = repo / "reports/tiny/tables"
    assert (tables / "screening_scr.tex").exists() and "not run" in (tables / "screening_scr.tex").read_text()
    assert (repo / "reports/tiny/figures/learning_curve_reorder.pdf").exists()
    tex = (repo / "reports/tiny/report.tex").read_text()
    assert "Ablations that reach the data" in tex and "not comparable across tokenizers" in tex


def _planned_jobs(repo: Path, wildcards: str) -> set[tuple[str, str | None]]:
    """(rule, value of the first of `wildcards` it has) of every job `snakemake -n` would run."""
    out = _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}", "-n"], repo)
    jobs = set()
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        head = re.match(r"(?:local)?rule (\w+):", block)
        if head and head.group(1) != "all":
            key = re.search(rf"(?:{wildcards})=([\w-]+)", block)
            jobs.add((head.group(1), key.group(1) if key else None))
    return jobs


def test_snakemake_reruns_exactly_the_edited_cell(repo):
    out = _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}", "-n"], repo)
    assert "Nothing to be done" in out
    _edit_cell(repo, dropout=0.2)
    jobs = _planned_jobs(repo, "cell")
    assert jobs == {("train", "pe_none"), ("evaluate", "pe_none")} | {(s, None) for s in REPORT_STEPS}, jobs
    _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}"], repo)


def _edit_data_cell(repo: Path, **bpe):
    path = repo / PARAMS
    params = yaml.safe_load(path.read_text())
    params["cells"]["tok_char"]["bpe"] = bpe
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    _run([sys.executable, "-m", "pipeline_src", "dvc-yaml", "--params", PARAMS], repo)  # the DAG's forks changed


def test_snakemake_reruns_only_the_edited_tokenizer_fork(repo):
    """A data override forks the DAG at the tokenizer: editing it reruns exactly that tokenizer,
    the cell's training/evaluation and the report steps; the shared filtered set and the other
    cells' tokenizers stay."""
    _edit_data_cell(repo, model_type="unigram")
    jobs = _planned_jobs(repo, "cell|bpe_variant")
    assert jobs == {("bpe", "unigram60"), ("train", "tok_char"), ("evaluate", "tok_char")} | \
        {(s, None) for s in REPORT_STEPS}, jobs
    _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}"], repo)


HELPER = "pipeline_src/report/claims.py"


def _edit_helper(repo: Path) -> None:
    path = repo / HELPER
    path.write_text(path.read_text() + "\n# an edit that changes no behaviour, only the file\n")


# The code records of the two stage kinds that run the helper (pipeline_src/study/code_manifest.py)
HELPER_RECORDS = {("code", "claims"), ("code", "report")}


def test_snakemake_reruns_exactly_the_stages_that_import_an_edited_helper(repo):
    """The code dependencies are read from the imports: report/claims.py is the claims stage's
    module and a helper the report stage imports; editing it leaves every run and data stage
    alone and reruns exactly those two stages, after their code records."""
    from pipeline_src.study.stages import CODE

    assert {s for s, files in CODE.items() if HELPER in files} == {"claims", "plan", "report"}  # no plan here
    assert "Nothing to be done" in _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}", "-n"], repo)
    _edit_helper(repo)
    assert _planned_jobs(repo, "cell|kind") == {("claims", None), ("report", None)} | HELPER_RECORDS
    _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}"], repo)


def test_dvc_reruns_exactly_the_edited_cell(repo):
    dvc_file = "workflow/studies/tiny/dvc.yaml"
    _run([BIN / "dvc", "init", "-q", "--force"], repo)
    _run([BIN / "dvc", "commit", "--force", dvc_file], repo)  # adopt the Snakemake-built outputs
    assert "up to date" in _run([BIN / "dvc", "status", dvc_file], repo)
    _edit_cell(repo, dropout=0.3)
    out = _run([BIN / "dvc", "repro", dvc_file], repo)
    ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", out))
    assert ran == {"train@reorder-pe_none-s0", "evaluate@reorder-pe_none-s0"} | REPORT_STEPS, ran
    out = _run([BIN / "dvc", "repro", dvc_file], repo)
    assert "Running stage" not in out


def test_dvc_reruns_only_the_edited_tokenizer_fork(repo):
    _edit_data_cell(repo, model_type="word")
    out = _run([BIN / "dvc", "repro", "workflow/studies/tiny/dvc.yaml"], repo)
    ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", out))
    assert ran == {"bpe@reorder-default-word60", "train@reorder-tok_char-s0", "evaluate@reorder-tok_char-s0"} \
        | REPORT_STEPS, ran


def test_dvc_finds_exactly_the_stages_that_import_an_edited_helper_stale(repo):
    """The same edit under DVC (its hashes, after the Snakemake runs above were adopted)."""
    dvc_file = "workflow/studies/tiny/dvc.yaml"
    assert "up to date" in _run([BIN / "dvc", "status", dvc_file], repo)
    _edit_helper(repo)
    status = _run([BIN / "dvc", "status", dvc_file], repo)
    stale = set(re.findall(rf"^{re.escape(dvc_file)}:([\w@-]+):", status, flags=re.M))
    records = {f"code-{kind}" for _, kind in HELPER_RECORDS}
    assert stale == records, status  # what the edit changed: the records' inputs (then the stages that read them)
    ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", _run([BIN / "dvc", "repro", dvc_file], repo)))
    assert ran == {"claims", "report"} | records, ran


def _files(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_dvc_repro_on_a_stale_dvc_yaml_stops_before_any_work(repo):
    """Cells added to or removed from a task: `dvc repro` with yesterday's dvc.yaml stops at the
    first stage it starts, in one line naming the command that regenerates the file; regenerated,
    it runs the new DAG."""
    dvc_file, path = "workflow/studies/tiny/dvc.yaml", repo / PARAMS
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(repo))
    for edit in ("add", "remove"):
        params = yaml.safe_load(path.read_text())
        cells = params["tasks"]["reorder"]["cells"]
        cells.append("heads_1") if edit == "add" else cells.remove("data_half")
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        runs = _files(repo / "data/tiny")
        proc = subprocess.run([BIN / "dvc", "repro", dvc_file], cwd=repo, capture_output=True, text=True, env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out
        ours = [line for line in out.splitlines() if "is out of date" in line]
        assert len(ours) == 1 and f"`python -m pipeline_src dvc-yaml --params {PARAMS}`" in ours[0], out
        assert len(re.findall(r"Running stage", out)) == 1, out  # the first stage started stopped at once
        assert _files(repo / "data/tiny") == runs  # no job ran: data and runs untouched

        _run([sys.executable, "-m", "pipeline_src", "dvc-yaml", "--params", PARAMS], repo)
        ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", _run([BIN / "dvc", "repro", dvc_file], repo)))
        if edit == "add":
            assert {"train@reorder-heads_1-s0", "evaluate@reorder-heads_1-s0"} | REPORT_STEPS <= ran, ran
        else:
            assert "aggregate" in ran and ran <= REPORT_STEPS, ran
        assert "Running stage" not in _run([BIN / "dvc", "repro", dvc_file], repo)
