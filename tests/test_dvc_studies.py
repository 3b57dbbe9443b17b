"""What DVC shows of the shipped studies, as its users type it, in a scratch git copy of the
project with every shipped dvc.yaml:

- a fresh clone (the studies whose results ship with the project, e.g. the CPU reference study,
  and the others not run; tests/test_dag.py checks that git keeps what DVC shows of each):
  `dvc metrics show`, `dvc plots show`, `dvc exp show` warn of nothing, show rows and curves of
  the shipped results only, and `dvc exp show` has no column per run file of the fan-in stages;
- the demo and mirror studies "run" (their views written by report/views.py from made-up
  numbers, committed twice): the others still warn of nothing, the compact comparison view
  (`python -m pipeline_src exp-show`) of each is at most 40 columns, and `dvc plots diff`
  overlays the demo's training and learning curves of two commits.

No training: what is tested is DVC reading the generated dvc.yaml files and the files git keeps
(the runs themselves are tests/test_views.py's).
"""
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from project_copy import copy_project

from pipeline_src.study.config import load_study
from pipeline_src.report import views
from pipeline_src.study.stages import output_path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RUN = {"demo": "workflow/studies/demo/params.yaml", "mirror": "workflow/studies/mirror/params.yaml"}
ROW_COLUMNS = ["Experiment", "rev", "typ", "Created", "parent"]
# Files of single runs: the fan-in stages depend on the folders that hold them instead.
RUN_FILES = ("train_metrics.json", "train_info.json", "cost.json", "train_log.tsv", "eval_metrics.json",
             "eval_info.json", "/outputs")

pytestmark = pytest.mark.slow


def _shipped_results() -> set[str]:
    """The studies whose views git keeps with real numbers in them (a run committed), by the
    metric files of their cells: a study not run keeps only its metrics folder."""
    out = subprocess.run(["git", "ls-files", "reports/*/metrics/*.json"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return {Path(f).parts[1] for f in out}


SHIPPED = _shipped_results()


def _env(repo):
    return dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", PIPELINE_QUIET="1", PYTHONPATH=str(repo))


def _run(cmd, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env=_env(cwd))
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _quiet(proc: subprocess.CompletedProcess) -> str:
    """DVC's stdout, after checking that it warned of nothing."""
    assert "failed to load" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr[-2000:]
    return proc.stdout


def _git(repo, *args):
    return _run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args], repo)


def _write_views(repo: Path, params: str, shift: float) -> None:
    """The study's metrics and plots as its aggregate stage writes them, from made-up numbers."""
    study = load_study(repo / params)
    rows = []
    for task in study.tasks.values():
        metric = views.headline_metric(task.kind)
        for i, cell in enumerate(task.cells):
            rows.append({"task": task.name, "cell": cell, f"{metric}_mean": 10 + i + shift, f"{metric}_std": 0.5,
                         "test_ppl_mean": 20 - i - shift, "wall_s_mean": 3.0})
    headline = views.headline_rows(study, pd.DataFrame(rows))
    curves = {(t.name, c, col): pd.DataFrame({"step": [10, 20], col: [3.0 - shift, 2.0 - shift]})
              for t in study.tasks.values() for c in t.cells for col in views.CURVES}
    learning = {}
    for task in study.tasks.values():
        metric = views.headline_metric(task.kind)
        cells = views.learning_curve_cells(study, task)
        if cells:
            learning[task.name] = pd.DataFrame({"cell": cells, "train_rows": [100 * (k + 1) for k in range(len(cells))],
                                                metric: [headline[(task.name, c)][metric] for c in cells],
                                                f"{metric}_std": [0.5] * len(cells)})
    plots = repo / output_path("aggregate", "plots", study=study.name)
    header = {p: p.read_text() for p in plots.rglob("*.tsv")}  # the placeholders git keeps
    views.write(study, {"headline": headline, "curves": curves, "learning": learning},
                repo / output_path("aggregate", "headline", study=study.name), plots)
    for path, text in header.items():  # a placeholder's header is the real file's
        assert path.read_text().splitlines()[0] == text.splitlines()[0], path


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("studies") / "repo"
    copy_project(repo)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "the shipped studies, none run")
    return repo


def test_a_fresh_clone_warns_of_nothing_and_shows_no_run_file_columns(repo, tmp_path):
    clone = tmp_path / "clone"
    _git(repo, "clone", "-q", str(repo), str(clone))
    table = _quiet(_run([BIN / "dvc", "metrics", "show"], clone))
    shown = {line.split()[0].split("/")[1] for line in table.splitlines()[1:]}
    assert shown == SHIPPED, f"rows of studies not run: {shown - SHIPPED}"
    plots = json.loads(_quiet(_run([BIN / "dvc", "plots", "show", "--json"], clone)))
    assert "errors" not in plots and plots["data"], plots.get("errors")
    curves = {name.split(".")[0] for name, content in plots["data"].items() if content}
    assert curves <= SHIPPED, f"curves of studies not run: {curves - SHIPPED}"
    shown = _quiet(_run([BIN / "dvc", "exp", "show", "--csv"], clone))
    columns = next(csv.reader(io.StringIO(shown)))
    paths = [c for c in columns if c.startswith(("data/", "reports/", "pipeline_src/"))]
    assert not [c for c in paths if c.endswith(RUN_FILES)], [c for c in paths if c.endswith(RUN_FILES)][:5]
    # (3,331 columns, 2,449 of them paths, before the fan-in stages depended on folders; 1,623 once
    # the GPU study's PTB metrics were committed; 1,725 once every claim quotes its source, which
    # the claims stage reads as params)
    assert len(columns) < 1800, len(columns)


def test_studies_run_and_not_run_side_by_side(repo):
    """demo and mirror run (made-up numbers) at two commits, the demo's pe_none cell edited in
    between; the other studies as shipped."""
    for params in RUN.values():
        _write_views(repo, params, shift=0.0)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "demo and mirror run")
    for params in RUN.values():
        _write_views(repo, params, shift=1.0)
    demo = repo / RUN["demo"]
    raw = yaml.safe_load(demo.read_text())
    raw["cells"]["pe_none"]["model"]["dropout"] = 0.05
    demo.write_text(yaml.safe_dump(raw, sort_keys=False))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "demo and mirror again, pe_none with dropout")

    table = _quiet(_run([BIN / "dvc", "metrics", "show"], repo))
    shown = {line.split()[0] for line in table.splitlines()[1:]}
    expected = {f"reports/{s}/metrics/{t.name}/{c}.json" for s, p in RUN.items()
                for t in load_study(repo / p).tasks.values() for c in t.cells}
    assert {p for p in shown if p.split("/")[1] not in SHIPPED} == expected, shown ^ expected

    # The compact comparison view of each: its cells' headline metrics, and the cell settings
    # that differ between the rows (here the demo's pe_none dropout), nothing of the other studies.
    for name, params in RUN.items():
        study = load_study(repo / params)
        out = _quiet(_run([sys.executable, "-m", "pipeline_src", "exp-show", "--params", params, "--csv", "-n", "2"],
                          repo))
        rows = list(csv.DictReader(io.StringIO(out)))
        columns = [c.removeprefix(f"{params}:") for c in rows[0]]
        headlines = {f"reports/{name}/metrics/{t.name}/{c}.json:{views.headline_metric(t.kind)}"
                     for t in study.tasks.values() for c in t.cells}
        changed = {"cells.pe_none.model.dropout"} if name == "demo" else set()
        assert set(columns) == set(ROW_COLUMNS) | headlines | changed, set(columns) ^ (set(ROW_COLUMNS) | headlines)
        assert len(columns) <= 40, len(columns)
        assert len({r["rev"] for r in rows}) >= 2  # both commits

    # Curves across commits: each of the demo's cells, once per revision.
    diff = json.loads(_quiet(_run([BIN / "dvc", "plots", "diff", "HEAD~1", "HEAD", "--json"], repo)))
    assert "errors" not in diff, diff.get("errors")
    study = load_study(repo / RUN["demo"])
    task = study.tasks["reorder"]
    for plot, per_rev in ((f"demo.reorder.{col}", len(task.cells)) for col in views.CURVES):
        (content,) = diff["data"][plot]
        values = content["content"]["data"]["values"]
        by_rev = {}
        for v in values:
            by_rev.setdefault(v["rev"], set()).add(v["filename"])
        assert sorted(by_rev) == ["HEAD", "HEAD~1"] and all(len(f) == per_rev for f in by_rev.values()), by_rev
    (content,) = diff["data"]["demo.reorder.learning_curve"]
    points = content["content"]["data"]["values"]
    cells = views.learning_curve_cells(study, task)
    assert len(cells) == 3 and sorted((p["rev"], p["cell"]) for p in points) == sorted(
        (rev, c) for rev in ("HEAD", "HEAD~1") for c in cells), points
