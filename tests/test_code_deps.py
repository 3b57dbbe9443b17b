"""A stage's code dependencies are the code it runs: the import closure of its entry module
(pipeline_src/study/imports.py), listed for every stage kind of every study (its code job, which
records their hashes and which every job of the kind depends on), so that an edited module reruns
exactly the stages that run it."""
from pathlib import Path

import pytest

from pipeline_src.study import imports, stages
from pipeline_src.study.config import load_study

ROOT = Path(__file__).resolve().parent.parent
STUDY_FILES = sorted(p.relative_to(ROOT).as_posix() for p in
                     [ROOT / "params.yaml", *ROOT.glob("workflow/studies/*/*.yaml")]
                     if p.name not in ("parts.yaml", "trials.yaml", "dvc.yaml"))


def unlisted_imports(listed: set[str]) -> list[str]:
    """Package modules imported by a listed module (or the packages above one) that are not listed."""
    mods = imports.modules()
    by_file = {path.relative_to(ROOT).as_posix(): name for name, path in mods.items()}
    missing = []
    for f in sorted(listed):
        if f not in by_file:
            continue
        for target in sorted(imports.closure(by_file[f])):
            need = mods[target].relative_to(ROOT).as_posix()
            if need not in listed:
                missing.append(f"{f} runs {need}")
    return missing


def _code(deps) -> set[str]:
    files = set()
    for d in deps:
        if d in stages.CODE_FOLDERS:
            files |= stages.CODE_FOLDERS[d]
        elif d.startswith("pipeline_src/"):
            files.add(d)
    return files


@pytest.mark.parametrize("params", STUDY_FILES)
def test_every_job_lists_the_code_it_runs_closed_under_imports(params, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = load_study(params)
    jobs = stages.build_jobs(study)
    code_jobs = {j.wildcards["kind"]: j for j in jobs if j.stage == "code"}
    checked = set()
    for job in jobs:
        if job.stage == "code":
            continue
        # the job depends on its kind's code record, and on no code file itself
        manifest = stages.code_manifest_path(study, job.stage)
        assert manifest in job.deps and manifest in job.dvc_deps, (params, job.stage, job.key)
        assert not _code(job.deps) and not _code(job.dvc_deps), (params, job.stage, job.key)
        # ... which depends on the closure of the kind's entry module
        entry = imports.modules()[stages.ENTRIES[job.stage]].relative_to(ROOT).as_posix()
        code_job = code_jobs[job.stage]
        assert code_job.outs == {"manifest": manifest}
        for view, deps in (("snakemake", code_job.deps), ("dvc", code_job.dvc_deps)):
            code = _code(deps)
            assert entry in code, (params, job.stage, view)
            assert unlisted_imports(code) == [], (params, job.stage, job.key, view)
        checked.add(job.stage)
    assert {"download", "filter", "bpe", "train", "evaluate", "aggregate", "report"} <= checked
    assert set(code_jobs) == checked, (params, set(code_jobs) - checked)  # a record for every kind run, no other


def test_a_code_record_holds_the_hash_of_each_file_its_kind_runs(tmp_path, monkeypatch):
    import hashlib
    import json

    from pipeline_src.study import code_manifest

    monkeypatch.chdir(tmp_path)
    study = load_study(ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml")
    code_manifest.run(study, "train")
    record = json.loads((tmp_path / stages.code_manifest_path(study, "train")).read_text())
    assert record["kind"] == "train" and sorted(record["files"]) == sorted(stages.CODE["train"])
    layers = "pipeline_src/model/layers.py"
    assert record["files"][layers] == hashlib.sha256((ROOT / layers).read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="not a stage kind"):
        code_manifest.run(study, "nonsense")


def test_the_check_finds_an_unlisted_helper():
    listed = set(stages.CODE["figures"]) - {"pipeline_src/report/views.py"}
    assert unlisted_imports(listed) != [] and all(m.endswith("runs pipeline_src/report/views.py")
                                                  for m in unlisted_imports(listed))


def test_closures_stay_small():
    """What reading the import graph bought: the report stages do not run the trainer or the
    stage table, evaluation loads its model without the training loop, and data stages run
    neither the model nor the report."""
    code = stages.CODE
    for stage in ("figures", "tables", "claims", "aggregate", "report", "evaluate"):
        assert "pipeline_src/train/trainer.py" not in code[stage], stage
        assert "pipeline_src/study/stages.py" not in code[stage], stage
        assert "pipeline_src/runtime/dvc_yaml.py" not in code[stage], stage
    for stage in ("download", "filter", "bpe"):
        assert not [f for f in code[stage] if f.startswith(("pipeline_src/model/", "pipeline_src/report/"))], stage
    # a model default (model/config.py) reruns what builds a model, not the data or the statistics
    readers = {s for s, files in code.items() if "pipeline_src/model/config.py" in files}
    assert readers == {"tune", "train", "evaluate", "figures"}, readers
    assert "pipeline_src/report/templates/report.tex" in code["report"]


def test_a_task_level_lr_grid_tunes_every_cell_the_same_way(tmp_path):
    """Every arm tuned the same way: a grid in the task's train section gives each cell a tune job,
    and each cell's training runs read their own tune record."""
    import yaml

    params = yaml.safe_load((ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml").read_text())
    params["tasks"]["reorder"]["train"].update(lr_grid=[1.0e-3, 3.0e-3], lr_tune_steps=4)
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(params))
    study = load_study(tmp_path / "grid.yaml")
    jobs = stages.build_jobs(study)
    tuned = {j.wildcards["cell"] for j in jobs if j.stage == "tune"}
    assert tuned == set(study.task("reorder").cells) == {"baseline", "pe_none"}
    for job in (j for j in jobs if j.stage == "train"):
        assert stages.tune_path(study, "reorder", job.wildcards["cell"]) in job.deps


def test_the_cached_graph_follows_an_edited_module(tmp_path, monkeypatch):
    """The graph is kept beside the bytecode; an edit that adds an import shows in the next build."""
    import shutil

    shutil.copytree(ROOT / "pipeline_src", tmp_path / "pipeline_src", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(imports, "ROOT", tmp_path)
    monkeypatch.setattr(imports, "CACHE", tmp_path / "pipeline_src" / "__pycache__" / "import_graph.json")

    def fresh():
        imports.modules.cache_clear()
        imports.import_graph.cache_clear()
        return imports.import_graph()

    try:
        assert "pipeline_src.train.trainer" not in fresh()["pipeline_src.report.figures"]
        assert imports.CACHE.is_file()
        figures = tmp_path / "pipeline_src" / "report" / "figures.py"
        figures.write_text(figures.read_text() + "\n\ndef _late():\n    from ..train.trainer import Trainer  # noqa\n")
        assert "pipeline_src.train.trainer" in fresh()["pipeline_src.report.figures"]
        # The same module name from another file (x.py -> x/__init__.py, mtime and size kept): its
        # relative imports now start one folder deeper, and the cached entry is not reused.
        layout = tmp_path / "pipeline_src" / "node" / "parts_layout.py"
        assert "pipeline_src.study.config" in fresh()["pipeline_src.node.parts_layout"]
        (layout.parent / "parts_layout").mkdir()
        shutil.move(layout, layout.parent / "parts_layout" / "__init__.py")
        assert "pipeline_src.study.config" not in fresh()["pipeline_src.node.parts_layout"]
    finally:
        imports.modules.cache_clear()
        imports.import_graph.cache_clear()
