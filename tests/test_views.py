"""Each driver's own views of a study, as their users look at them: `dvc metrics show`,
`dvc plots show`, `dvc exp run -S` / the compact `dvc exp show` (`python -m pipeline_src exp-show`),
and `snakemake --report`.

Runs a real tiny study (one translation task, two cells and a sweep of two, two seeds) in a
scratch git + DVC copy of the project, built once by Snakemake and adopted by DVC; a copy of that
repository also has the demo study's dvc.yaml, not run (what DVC shows of it are the placeholders
git keeps). Only that copy has it: every DVC command reads every dvc.yaml of the repository, and
the demo's 126 stages made the experiments' runs here a third slower.
"""
import csv
import io
import json
import os
import re
import shutil
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
CELLS = ["baseline", "pe_none", "heads_1", "heads_4"]
REPORT_STEPS = {"aggregate", "figures", "tables", "claims", "report"}

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
    # A sweep written as the schema has it: settings nested under their section (an axis of two
    # values and a setting both cells share), so that `dvc exp run -S` addresses each one.
    params["sweeps"] = {"heads": {"model": {"n_heads": [1, 4], "d_ff": 32}}}
    params["tasks"]["reorder"]["cells"] = ["baseline", "pe_none", "heads"]
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
        # the metrics files keep 4 decimals, summary.csv 6 significant digits (118.2255 vs 118.225)
        for key, column in (("bleu", "bleu_mean"), ("bleu_std", "bleu_std"), ("test_ppl", "test_ppl_mean")):
            assert row[key] == pytest.approx(float(summary[cell][column]), rel=1e-5, abs=1e-4), (key, row)
    table = _run([BIN / "dvc", "metrics", "show", "--md", "reports/tiny/metrics"], repo)
    header = next(line for line in table.splitlines() if line.startswith("| Path"))
    assert header.count("|") - 1 == 5, header  # Path + 4 numbers


def _dvc(repo, *args):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(repo))
    return subprocess.run([BIN / "dvc", *args], cwd=repo, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def beside_a_study_not_run(repo, tmp_path_factory):
    """A copy of the repository (the tiny study run and adopted by DVC) with the demo study's
    dvc.yaml committed too, the demo not run."""
    copy = tmp_path_factory.mktemp("views-beside") / "repo"
    shutil.copytree(repo, copy, symlinks=True)
    demo = "workflow/studies/demo/dvc.yaml"
    shutil.copy2(ROOT / demo, copy / demo)
    _run(["git", "add", demo], copy)
    _run(["git", "commit", "-q", "-m", "the demo study, not run"], copy)
    return copy


def test_dvc_says_nothing_of_a_study_not_run(beside_a_study_not_run):
    """The demo is declared (its dvc.yaml) but not run: its metrics folder holds only the .gitkeep
    and its plot files their header, so DVC shows nothing of it and warns of nothing."""
    repo = beside_a_study_not_run
    for args in (["metrics", "show"], ["plots", "show", "--json"], ["exp", "show", "--csv"]):
        proc = _dvc(repo, *args)
        assert proc.returncode == 0 and "failed to load" not in proc.stderr and "WARNING" not in proc.stderr, \
            (args, proc.stderr[-2000:])
    table = _dvc(repo, "metrics", "show").stdout
    assert "reports/tiny/metrics/reorder/baseline.json" in table and "reports/demo" not in table, table
    plots = json.loads(_dvc(repo, "plots", "show", "--json").stdout)
    assert "errors" not in plots and plots["data"]["demo.reorder.train_loss"] == [], plots.get("errors")


def test_dvc_plots_show_the_report_comparisons(repo):
    shown = json.loads(_dvc(repo, "plots", "show", "--json").stdout)["data"]
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
    assert ran == {f"{s}@reorder-pe_none-s{k}" for s in ("train", "evaluate") for k in (0, 1)} | REPORT_STEPS, ran
    # docs/dvc.md's `make exp-show` command: each cell's headline metric and the cell settings that differ.
    rows, columns = _compact_view(repo)
    metric = "reports/tiny/metrics/reorder/pe_none.json:bleu"
    assert set(columns) == set(ROW_COLUMNS) | set(HEADLINES) | {"cells.pe_none.model.dropout"}, columns
    exp = next(r for r in rows if r["Experiment"] == "dropout02")
    base = next(r for r in rows if r["typ"] == "baseline" and r["rev"] != "workspace")
    assert exp["cells.pe_none.model.dropout"] == "0.2" and base["cells.pe_none.model.dropout"] == ""
    after = json.loads((repo / "reports/tiny/metrics/reorder/pe_none.json").read_text())
    assert float(exp[metric]) == after["bleu"] and base[metric] != ""
    # The experiment is applied to the workspace: `dvc metrics diff` against the commit shows the
    # edited cell's numbers, and nothing of the cell that did not rerun.
    diff = json.loads(_run([BIN / "dvc", "metrics", "diff", "--json", "--targets", "reports/tiny/metrics"], repo))
    assert {Path(p).stem for p in diff} == {"pe_none"}, diff
    assert diff[metric.split(":")[0]]["test_ppl"]["new"] == after["test_ppl"]


ROW_COLUMNS = ["Experiment", "rev", "typ", "Created", "parent"]
HEADLINES = [f"reports/tiny/metrics/reorder/{c}.json:bleu" for c in CELLS]


def _compact_view(repo) -> tuple[list[dict], list[str]]:
    shown = _run([sys.executable, "-m", "pipeline_src", "exp-show", "--params", PARAMS, "--csv"], repo)
    rows = list(csv.DictReader(io.StringIO(shown)))
    return rows, list(rows[0])


def test_dvc_exp_run_set_param_on_a_sweep_reruns_exactly_its_cells(repo):
    """A sweep's settings are nested keys DVC addresses: editing the one its cells share reruns
    the sweep's cells (every seed) and the report steps, nothing else."""
    out = _run([BIN / "dvc", "exp", "run", DVC_FILE, "-n", "heads-dff", "-S", f"{PARAMS}:sweeps.heads.model.d_ff=48"],
               repo)
    ran = set(re.findall(r"Running stage '[^:]+:([^']+)'", out))
    assert ran == {f"{s}-sweep-heads@reorder-heads_{h}-s{k}" for s in ("train", "evaluate") for h in (1, 4)
                   for k in (0, 1)} | REPORT_STEPS, ran
    assert yaml.safe_load((repo / PARAMS).read_text())["sweeps"]["heads"]["model"] == {"n_heads": [1, 4], "d_ff": 48}
    rows, columns = _compact_view(repo)
    assert "sweeps.heads.model.d_ff" in columns and len(columns) <= 40, columns
    exp = next(r for r in rows if r["Experiment"] == "heads-dff")
    base = next(r for r in rows if r["typ"] == "baseline" and r["rev"] != "workspace")
    assert (exp["sweeps.heads.model.d_ff"], base["sweeps.heads.model.d_ff"]) == ("48", "32")
