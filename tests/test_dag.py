"""Snakemake and DVC run the same DAG: same jobs, same commands, same inputs and outputs.

Both sides are read from the drivers themselves (`snakemake -n -p --forceall` and
`dvc repro --dry --force --all-pipelines` plus DVC's own stage loader), not from our stage table,
so a rule or a dvc.yaml that drifted from the table makes this fail.
"""
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_src.study.config import load_study
from pipeline_src.runtime.dvc_yaml import dvc_yaml_path, render, view_files
from pipeline_src.study.stages import CODE_FOLDERS

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ["params.yaml", "workflow/studies/demo/params.yaml", "workflow/studies/mirror/params.yaml",
           "workflow/studies/gpu/params.yaml", "workflow/studies/cpu/params.yaml", "workflow/studies/cnndm/params.yaml"]
BIN = Path(sys.executable).parent
CODE_FOLDER_OF = {f: folder for folder, files in CODE_FOLDERS.items() for f in files}


def _env():
    return dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")


def snakemake_jobs(params: str, cwd: Path = ROOT) -> dict[str, dict]:
    """{shell command: {"rule", "inputs", "outputs"}} from a forced dry run."""
    proc = subprocess.run([BIN / "snakemake", "--config", f"params={params}", "--forceall", "-n", "-p",
                           "--cores", "1"], cwd=cwd, capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", proc.stdout):
        head = re.match(r"(?:local)?rule (\w+):", block)
        if not head or head.group(1) == "all":
            continue
        fields = dict(re.findall(r"^    (input|output): (.*)$", block, re.M))
        cmd = re.search(r"^Shell command: (.*)$", block, re.M).group(1)
        cmd = re.sub(r" 2> \S+$", "", cmd)  # Snakemake's log redirection; DVC shows logs on the console
        jobs[cmd] = {"rule": head.group(1), "inputs": set(filter(None, fields.get("input", "").split(", "))),
                     "outputs": set(fields["output"].split(", "))}
    return jobs


@functools.cache
def dvc_dry_run(cwd: Path = ROOT) -> dict[str, list[str]]:
    """{dvc.yaml: commands} as `dvc repro --dry --force --all-pipelines` lists them: one run for
    every study (each `dvc repro` first reads every dvc.yaml and dvc.lock of the repository, ~10 s
    of CPU, so six runs of one study each cost five more of those)."""
    dry = subprocess.run([BIN / "dvc", "repro", "--dry", "--force", "--all-pipelines"], cwd=cwd, capture_output=True,
                         text=True, env=_env())
    assert dry.returncode == 0, dry.stderr[-2000:]
    listed: dict[str, list[str]] = {}
    dvc_file = None
    for line in dry.stdout.splitlines():
        if stage := re.match(r"Running stage '([^']+)':$", line):  # 'file:name', or 'name' in the root dvc.yaml
            dvc_file = stage.group(1).rpartition(":")[0] or "dvc.yaml"
        elif line.startswith("> "):
            listed.setdefault(dvc_file, []).append(line[2:])
    return listed


def dvc_jobs(params: str, cwd: Path = ROOT) -> dict[str, dict]:
    from dvc.repo import Repo

    study = load_study(cwd / params)
    dvc_file = str(dvc_yaml_path(study))
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with Repo(str(cwd)) as repo:
            stages = repo.stage.collect(dvc_file)
            jobs = {}
            for st in stages:
                wdir = Path(st.wdir).resolve()
                rel = lambda p: os.path.relpath(wdir / p, cwd.resolve())  # noqa: E731
                deps = {rel(d.def_path) for d in st.deps if type(d).__name__ != "ParamsDependency"}
                jobs[st.cmd] = {"stage": st.addressing, "inputs": deps, "outputs": {rel(o.def_path) for o in st.outs}}
    finally:
        os.chdir(old)
    listed = dvc_dry_run(cwd).get(os.path.relpath(Path(dvc_file).resolve(), cwd.resolve()), [])
    assert sorted(listed) == sorted(jobs), "dvc repro --dry lists other jobs than dvc.yaml defines"
    return jobs


@pytest.mark.parametrize("params", STUDIES)
def test_committed_dvc_yaml_is_up_to_date(params, monkeypatch):
    monkeypatch.chdir(ROOT)  # commands in dvc.yaml name the params file relative to the root
    study = load_study(params)
    path = ROOT / dvc_yaml_path(study)
    assert path.exists(), f"{path} missing: run `make dvc-yaml`"
    assert path.read_text() == render(study), f"{path} is stale: run `make dvc-yaml`"
    # What DVC shows of the study is in git before it is run (placeholders the command writes).
    tracked = set(subprocess.run(["git", "ls-files", f"reports/{study.name}"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split())
    missing = [p.as_posix() for p in view_files(study) if p.as_posix() not in tracked]
    assert not missing, f"not in git: {missing[:3]} ...: run `make dvc-yaml` and commit reports/{study.name}/"


def _upstream(jobs: dict[str, dict]) -> dict[str, tuple[set, set]]:
    """{command: (commands of the jobs it reads outputs of, inputs no job writes)}. An input
    folder reads every job that writes into it."""
    outs = [(out, cmd) for cmd, job in jobs.items() for out in job["outputs"]]
    graph = {}
    for cmd, job in jobs.items():
        upstream, sources = set(), set()
        for path in job["inputs"]:
            writers = {c for out, c in outs if out == path or out.startswith(path + "/")}
            upstream |= writers
            if not writers:
                sources.add(path)
        graph[cmd] = (upstream, sources)
    return graph


@pytest.mark.slow
@pytest.mark.parametrize("params", STUDIES)
def test_snakemake_and_dvc_run_the_same_jobs(params, monkeypatch):
    monkeypatch.chdir(ROOT)
    smk = snakemake_jobs(params)
    dvc = dvc_jobs(params)
    assert set(smk) == set(dvc), f"only in snakemake: {set(smk) - set(dvc)}; only in dvc: {set(dvc) - set(smk)}"
    # DVC lists folders where Snakemake lists the files in them (stages.folder_deps): the same
    # upstream jobs, and each Snakemake input is a DVC input or in one of its folders. Code folders
    # (stages.CODE_FOLDERS) are one DVC dependency wherever a code job hashes all of their files.
    def fold(inputs: set[str]) -> set[str]:
        whole = {folder for folder, files in CODE_FOLDERS.items() if files <= inputs}
        return {CODE_FOLDER_OF[p] if CODE_FOLDER_OF.get(p) in whole else p for p in inputs}

    code_folded = {cmd: dict(job, inputs=fold(set(job["inputs"]))) for cmd, job in smk.items()}
    smk_graph, dvc_graph = _upstream(code_folded), _upstream(dvc)
    for cmd in smk:
        assert smk[cmd]["outputs"] == dvc[cmd]["outputs"], cmd
        assert smk_graph[cmd] == dvc_graph[cmd], cmd
        assert all(any(p == d or p.startswith(d + "/") for d in dvc[cmd]["inputs"]) for p in smk[cmd]["inputs"]), cmd
    assert all(code_folded[cmd]["inputs"] == dvc[cmd]["inputs"] for cmd in smk
               if smk[cmd]["rule"] in ("code", "train", "evaluate"))
    assert all("pipeline_src/model" in dvc[cmd]["inputs"] for cmd in smk if cmd.endswith("--kind evaluate")), \
        "the model folder is not folded where a job runs all of it"
    # A job depends on its kind's code record (pipeline_src/study/code_manifest.py), not on code files.
    records = {cmd.rsplit(" ", 1)[1]: job["outputs"] for cmd, job in smk.items() if job["rule"] == "code"}
    assert set(records) == {j["rule"] for j in smk.values()} - {"code"}
    for job in (j for j in smk.values() if j["rule"] != "code"):
        assert records[job["rule"]] <= job["inputs"] and not any(p.startswith("pipeline_src/") for p in job["inputs"])
    folded = {cmd for cmd in smk if code_folded[cmd]["inputs"] != dvc[cmd]["inputs"]}
    assert folded <= {cmd for cmd in smk if smk[cmd]["rule"] in ("promote", "plan", "aggregate", "figures", "tables",
                                                                 "claims", "report")}, folded
    study = load_study(ROOT / params)
    # + screening stages (stage two only for cells the screened task does not train itself)
    n_train = sum(len(study.own_cells(t)) for t in study.all_tasks) * len(study.seeds)
    assert sum(j["rule"] == "train" for j in smk.values()) == n_train
    # Data variants fork the DAG: one filter job per filter variant, one bpe job per tokenizer.
    n_variants = [study.data_variants(t) for t in study.all_tasks]
    assert sum(j["rule"] == "filter" for j in smk.values()) == sum(len(filter_variants) for filter_variants, _ in n_variants)
    assert sum(j["rule"] == "bpe" for j in smk.values()) == sum(len(pairs) for _, pairs in n_variants)
    assert sum(j["rule"] == "promote" for j in smk.values()) == len(study.screens)


def test_snakemake_lint_is_clean():
    proc = subprocess.run([BIN / "snakemake", "--lint"], cwd=ROOT, capture_output=True, text=True, env=_env())
    assert proc.returncode == 0 and "good condition" in proc.stdout + proc.stderr, proc.stdout[-2000:]
