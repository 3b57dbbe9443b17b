"""Each driver's own views of a study, as their users look at them: `dvc metrics show`,
`dvc plots show`, `dvc exp run -S` / `dvc exp show`, and `snakemake --report`.

Runs a real tiny study (one translation task, two cells, two seeds) in a scratch git + DVC copy of
the project, built once by Snakemake and adopted by DVC.
"""
import csv
import io
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
DVC_FILE = "workflow/studies/tiny/dvc.yaml"
CELLS = ["baseline", "pe_none"]

pytestmark = pytest.mark.slow


def _run(cmd, cwd, **kw):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(cwd))
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A git + DVC copy of the project with the tiny study (two seeds), run once by Snakemake,
    adopted by DVC and committed, so that experiments have a baseline commit."""
    repo = tmp_path_factory.mktemp("views") / "repo"
    without_shipped_pipelines(copy_project(repo))
    params = yaml.safe_load(TINY.read_text())
    params["seeds"] = [0, 1]
    (repo / PARAMS).parent.mkdir(parents=True, exist_ok=True)
    (repo / PARAMS).write_text(yaml.safe_dump(params, sort_keys=False))
    _run(["git", "init", "-q"], repo)
    _run(["git", "config", "user.name", "test"], repo)
    _run(["git", "config", "user.email", "test@example.com"], repo)
    _run([sys.executable, "-m", "pipeline_src", "dvc-yaml", "--params", PARAMS], repo)
    _run([BIN / "snakemake", "--cores", "2", "--config", f"params={PARAMS}"], repo)
    _run([BIN / "dvc", "init", "-q", "--force"], repo)
    _run([BIN / "dvc", "commit", "--force", DVC_FILE], repo)
    _run(["git", "add", "-A"], repo)
    _run(["git", "commit", "-q", "-m", "tiny study"], repo)
    return repo


def test_snakemake_report_carries_the_study(repo):
    out = repo / "reports/tiny/report.html"
    _run([BIN / "snakemake", "--cores", "1", "--config", f"params={PARAMS}", "--report", out], repo)
    html = out.read_text(encoding="utf-8")
    # Every figure, table, CSV and the PDF is embedded (self-contained: no links to local files).
    index = json.loads((repo / "reports/tiny/figures/index.json").read_text())
    assert index
    for entry in index:
        assert f"{entry['name']}.png" in html, entry["name"]
    for table in json.loads((repo / "reports/tiny/tables/index.json").read_text()):
        assert f"{table['name']}.tex" in html, table["name"]
    for name in ("results.csv", "summary.csv", "significance.csv", "report.pdf", "baseline.json", "pe_none.json"):
        assert name in html, name
    assert "data:image/png;base64" in html or "iVBORw0KGgo" in html  # PNG bytes inline
    # Categories: the task, the ablation families, the study; and the workflow description.
    for category in ("reorder", "Ablation families", "Study", "positional_encoding"):
        assert category in html, category
    assert "Transformer ablation study" in html


def test_dvc_metrics_show_is_one_short_row_per_cell(repo):
    shown = json.loads(_run([BIN / "dvc", "metrics", "show", "--json", "reports/tiny/metrics"], repo))
    files = shown[""]["data"]
    rows = {Path(path).parent.name + "/" + Path(path).stem: body["data"] for path, body in files.items()}
    assert set(rows) == {f"reorder/{c}" for c in CELLS}  # no .snakemake_timestamp row (.dvcignore)
    summary = {r["cell"]: r for r in csv.DictReader((repo / "reports/tiny/summary.csv").open())}
    for cell in CELLS:
        row = rows[f"reorder/{cell}"]
        assert set(row) == {"bleu", "bleu_std", "test_ppl", "wall_s"}, row
        assert all(isinstance(v, (int, float)) for v in row.values()), row
        assert row["bleu"] == pytest.approx(float(summary[cell]["bleu_mean"]), abs=1e-4)
        assert row["bleu_std"] == pytest.approx(float(summary[cell]["bleu_std"]), abs=1e-4)
        assert row["test_ppl"] == pytest.approx(float(summary[cell]["test_ppl_mean"]), abs=1e-4)
    table = _run([BIN / "dvc", "metrics", "show", "--md", "reports/tiny/metrics"], repo)
    header = next(line for line in table.splitlines() if line.startswith("| Path"))
    assert header.count("|") - 1 == 5, header  # Path + 4 numbers


def test_dvc_plots_show_the_report_comparisons(repo):
    proc = subprocess.run([BIN / "dvc", "plots", "show", "--json"], cwd=repo, capture_output=True, text=True)
    shown = json.loads(proc.stdout)["data"]
    ours = {k: v for k, v in shown.items() if k.startswith("tiny.")}
    assert sorted(ours) == ["tiny.reorder.headline", "tiny.reorder.train_loss", "tiny.reorder.val_loss"], list(shown)
    for curve in ("train_loss", "val_loss"):  # the cells of the task overlaid in one plot
        values = ours[f"tiny.reorder.{curve}"][0]["content"]["data"]["values"]
        assert {v["filename"] for v in values} == {f"{c}.tsv" for c in CELLS}
        assert all(curve in v for v in values)
    bars = ours["tiny.reorder.headline"][0]["content"]["data"]["values"]
    assert sorted(v["cell"] for v in bars) == sorted(CELLS)
    assert "bleu" in bars[0]


def test_dvc_exp_run_set_param_reruns_the_cell_and_shows_it(repo):
    out = _run([BIN / "dvc", "exp", "run", DVC_FILE, "-n", "dropout02",
                "-S", f"{PARAMS}:++cells.pe_none.model.dropout=0.2"], repo)
    ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", out))
    assert ran == {f"{s}@reorder-pe_none-s{k}" for s in ("train", "evaluate") for k in (0, 1)} | {
        "aggregate", "figures", "tables", "claims", "report"}, ran
    # The README's command: headline metrics and params that differ, without file hashes.
    shown = _run([BIN / "dvc", "exp", "show", "--csv", "--only-changed", "--drop", EXP_DROP], repo)
    rows = list(csv.DictReader(io.StringIO(shown)))
    metric = "reports/tiny/metrics/reorder/pe_none.json:"
    # (wall_s, rounded to 0.1 s, may by chance equal the baseline's and then is not a changed column)
    columns = list(rows[0])[4:]
    assert columns in ([metric + k for k in ("bleu", "bleu_std", "test_ppl", "wall_s")] + ["cells.pe_none.model.dropout"],
                       [metric + k for k in ("bleu", "bleu_std", "test_ppl")] + ["cells.pe_none.model.dropout"]), columns
    exp = next(r for r in rows if r["Experiment"] == "dropout02")
    base = next(r for r in rows if r["typ"] == "baseline" and r["rev"] != "workspace")
    assert exp["cells.pe_none.model.dropout"] == "0.2" and base["cells.pe_none.model.dropout"] == ""
    assert exp[metric + "test_ppl"] != base[metric + "test_ppl"]
    after = json.loads((repo / "reports/tiny/metrics/reorder/pe_none.json").read_text())
    assert float(exp[metric + "test_ppl"]) == after["test_ppl"]
    # The experiment is applied to the workspace: `dvc metrics diff` against the commit shows the
    # edited cell's numbers, and nothing of the cell that did not rerun.
    diff = json.loads(_run([BIN / "dvc", "metrics", "diff", "--json", "--targets", "reports/tiny/metrics"], repo))
    assert {Path(p).stem for p in diff} == {"pe_none"}, diff
    assert diff[metric[:-1]]["test_ppl"]["new"] == after["test_ppl"]


EXP_DROP = r"^(data|pipeline_src)/|^reports/[^:]*$"
