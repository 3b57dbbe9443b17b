"""The stage table: every job of a study, with its command, inputs, outputs and params read.

This is the one source of truth for the DAG. `workflow/rules/*.smk` take their inputs, outputs
and commands from here; `python -m pipeline_src dvc-yaml` writes dvc.yaml from here; a test
checks that Snakemake's and DVC's views of the DAG agree job for job.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .config import Study, lookup
from .imports import closure_files
from .paths import (DIRECTORIES, METRICS, OUTPUTS, PLOTS, SCRATCH, code_manifest_path, data_paths,  # noqa: F401
                    output_path, promotion_path, seed_plan_path, stage_command, tune_path, tune_record,
                    write_records)

# The module each stage runs (python -m pipeline_src STAGE dispatches to its `run`). A stage's code
# is that module's import closure inside the package (pipeline_src/study/imports.py), plus the
# files it reads that are not Python. Its jobs depend on them through the code stage: one job
# per stage kind depends on the files and records their hashes (code_manifest.py), and every job
# of the kind depends on that record, so that editing any of them reruns the kind's jobs under
# both drivers (DVC hashes the files; Snakemake compares modification times). Directories are
# expanded to their files, because Snakemake looks at a directory's own mtime (which an edited
# file does not change) while DVC hashes its content.
ENTRIES = {
    "download": "pipeline_src.data.download", "filter": "pipeline_src.data.filter", "bpe": "pipeline_src.data.bpe",
    "tune": "pipeline_src.tune.lr_trials", "train": "pipeline_src.train.trainer",
    "evaluate": "pipeline_src.evaluate.evaluator",
    "promote": "pipeline_src.report.promote", "plan": "pipeline_src.report.plan",
    "aggregate": "pipeline_src.report.aggregate", "figures": "pipeline_src.report.figures",
    "tables": "pipeline_src.report.tables", "claims": "pipeline_src.report.claims", "report": "pipeline_src.report.build",
}
RESOURCES = {"report": ["pipeline_src/report/templates/*"]}
ROOT = Path(__file__).resolve().parents[2]


def _expand(pattern: str) -> list[str]:
    if "*" not in pattern:
        return [pattern]
    return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern) if p.is_file())


CODE = {stage: closure_files(entry) + [f for pat in RESOURCES.get(stage, []) for f in _expand(pat)]
        for stage, entry in ENTRIES.items()}
# Code folders that DVC lists whole where a code job hashes all of their files (the package is
# laid out so that the training stages run whole folders: model/, train/, ...): one entry of
# dvc.lock instead of one per file. A folder's files include its subfolders'; bytecode is not
# hashed (.dvcignore).
CODE_FOLDERS = {folder.relative_to(ROOT).as_posix(): {f for f in _expand(f"{folder.relative_to(ROOT)}/**/*")
                                                       if "/__pycache__/" not in f}
                for folder in sorted((ROOT / "pipeline_src").glob("*/")) if folder.name != "__pycache__"}
STAGE_ORDER = ["code", *CODE]
GPU_STAGES = {"tune", "train", "evaluate"}


@dataclass(frozen=True)
class Job:
    stage: str
    key: str  # unique within the stage; also the DVC foreach key
    wildcards: dict
    cmd: str
    deps: tuple[str, ...]
    outs: dict[str, str]  # output name -> path
    params: tuple[str, ...]  # dotted keys of the params file this job reads
    gpu: bool = False
    param_hash: str = field(default="", compare=False)
    # Jobs of one stage with another dependency/params shape (screening stages) form their own
    # DVC foreach stage, named <stage>-<group>.
    group: str = ""
    # The dependencies DVC lists: `deps`, with folders in place of files where that is exact
    # (folder_deps). Snakemake keeps `deps`, file by file.
    dvc_deps: tuple[str, ...] = field(default=(), compare=False)

    def out(self, name: str) -> str:
        return self.outs[name]


def _job(study: Study, stage: str, key: str, wildcards: dict, deps, params, args: dict,
         extra_hash=None, group: str = "") -> Job:
    path_fields = dict(study=study.name, **wildcards)
    outs = {name: tmpl.format(**path_fields) for name, tmpl in OUTPUTS[stage].items()}
    param_hash = study.section_hash(*params)
    if extra_hash is not None:  # settings resolved from more than the listed sections (data variants)
        param_hash = hashlib.sha256((param_hash + repr(extra_hash)).encode()).hexdigest()[:16]
    code = CODE[wildcards["kind"]] if stage == "code" else [code_manifest_path(study, stage)]
    return Job(stage=stage, key=key, wildcards=path_fields, cmd=stage_command(stage, study, **args),
               deps=tuple(deps) + tuple(code), outs=outs, params=tuple(params),
               gpu=stage in GPU_STAGES, param_hash=param_hash, group=group)


def _existing(study: Study, *keys: str) -> list[str]:
    # DVC refuses a params entry whose key is absent from the file, so list only present ones.
    return [k for k in keys if lookup(study.raw, k) is not None]


def _task_keys(study: Study, task, section: str) -> list[str]:
    """Params keys of a task section; a screening stage's task reads its source task's, and
    stage one also its `stage_one` overrides of filter/bpe/train."""
    keys = [f"tasks.{task.source or task.name}.{section}"]
    if task.stage == 1 and section in ("filter", "bpe", "train"):
        keys.append(f"screening.{task.screen}.stage_one.{section}")
    return _existing(study, *keys)


def _group(task, cell: str | None = None) -> str:
    if not task.stage:
        return ""
    gated = task.stage == 2 and cell is not None and cell != task.baseline_cell
    return f"{task.screen}-s{task.stage}" + ("-gated" if gated else "")


def build_jobs(study: Study) -> list[Job]:
    """All jobs of a study, grouped by stage: data, runs, screening promotions, the report."""
    jobs = data_jobs(study) + tune_jobs(study)
    train_jobs, eval_jobs = run_jobs(study)
    promote_jobs = [_job(study, "promote", screen.name, {"screen": screen.name},
                         [j.out(n) for j in eval_jobs if j.wildcards["task"] == screen.stage_tasks[0]
                          for n in ("outputs", "metrics")],
                         _existing(study, f"screening.{screen.name}"), {"screen": screen.name})
                    for screen in study.screens.values()]
    jobs += train_jobs + eval_jobs + promote_jobs + plan_jobs(study, train_jobs, eval_jobs)
    jobs += report_jobs(study, jobs, train_jobs, eval_jobs, promote_jobs)
    return folder_deps(study, code_jobs(study, jobs) + jobs)


def code_jobs(study: Study, jobs: list[Job]) -> list[Job]:
    """One per stage kind the study runs: the hashes of the kind's code files, which its jobs
    depend on instead of on each file (code_manifest.py). It reads no params: the files are its
    input."""
    return [_job(study, "code", kind, {"kind": kind}, [], [], {"kind": kind})
            for kind in dict.fromkeys(j.stage for j in jobs)]


def folder_deps(study: Study, jobs: list[Job]) -> list[Job]:
    """Each job with `dvc_deps`: its dependencies, where a folder of the study's data or reports
    replaces two or more of them if every job that writes into that folder is one the job
    depends on (the highest such folder). DVC then hashes the folder whole; the job's upstream
    jobs, and so what reruns it, are the same, and `dvc exp show` has one column for the folder
    instead of one per file (the fan-in stages list every run's files). Snakemake keeps the
    files: it would judge a folder by the folder's own mtime, which an edited file leaves alone.
    A folder also holds what no job declares (TensorBoard events, partial writes of a killed
    stage: both in .dvcignore) and the runs of cells since removed from the study. A code folder
    (CODE_FOLDERS) replaces its files where the job (a code job) hashes every one of them."""
    producer = {path: (j.stage, j.key) for j in jobs for path in j.outs.values()}
    writers: dict[str, set] = {}  # folder below data/<study>/ or reports/<study>/ -> jobs writing into it
    for path, job in producer.items():
        parts = path.split("/")
        for i in range(3, len(parts)):
            writers.setdefault("/".join(parts[:i]), set()).add(job)

    def folded(job: Job) -> tuple[str, ...]:
        listed: dict[str, set] = {}
        for dep in job.deps:
            parts = dep.split("/")
            for i in range(3, len(parts)):
                listed.setdefault("/".join(parts[:i]), set()).add(producer.get(dep))
        folder = {}
        for dep in job.deps:
            if dep not in producer:
                continue
            parts = dep.split("/")
            folder[dep] = next((f for f in ("/".join(parts[:i]) for i in range(3, len(parts)))
                                if listed[f] == writers[f]), None)
        uses = Counter(folder.values())
        out = [folder[d] if uses[folder.get(d)] >= 2 and folder.get(d) else d for d in job.deps]
        code = set(job.deps)
        for code_folder, files in CODE_FOLDERS.items():
            if files <= code:
                out = [code_folder if d in files else d for d in out]
        return tuple(dict.fromkeys(out))

    return [dataclasses.replace(j, dvc_deps=folded(j)) for j in jobs]


def data_jobs(study: Study) -> list[Job]:
    """download per dataset; filter per filter variant and bpe per (filter, tokenizer) variant of
    each task: the DAG forks at the earliest data stage a cell changes. A variant job's settings
    are in its command (--filter-variant/--bpe-variant name them), so its param hash covers them
    too."""
    s = study.name
    jobs = [_job(study, "download", ds, {"dataset": ds}, [], [f"datasets.{ds}"], {"dataset": ds})
            for ds in dict.fromkeys(t.dataset for t in study.tasks.values())]
    for task in study.all_tasks.values():
        raw = output_path("download", "raw", study=s, dataset=task.dataset)
        filter_variants, pairs = study.data_variants(task.name)
        for filter_variant in filter_variants:
            path_fields = {"task": task.name, "filter_variant": filter_variant}
            jobs.append(_job(study, "filter", f"{task.name}-{filter_variant}", dict(path_fields, dataset=task.dataset),
                             [raw], _task_keys(study, task, "filter"), dict(path_fields),
                             extra_hash=study.filter_config(task.name, filter_variant), group=_group(task)))
        for filter_variant, bpe_variant in pairs:
            path_fields = {"task": task.name, "filter_variant": filter_variant, "bpe_variant": bpe_variant}
            filtered = output_path("filter", "filtered", study=s, task=task.name, filter_variant=filter_variant)
            jobs.append(_job(study, "bpe", f"{task.name}-{filter_variant}-{bpe_variant}", path_fields, [filtered],
                             _task_keys(study, task, "bpe"), dict(path_fields),
                             extra_hash=study.bpe_config(task.name, filter_variant, bpe_variant), group=_group(task)))
    return jobs


def _tuned(study: Study, task: str, cell: str) -> bool:
    return bool(study.cell(task, cell).train.lr_grid)


def _train_params(study: Study, task, cell: str) -> list[str]:
    return (_task_keys(study, task, "model") + _task_keys(study, task, "train")
            + _existing(study, study.cell_key(cell)))


def tune_jobs(study: Study) -> list[Job]:
    """One per task x cell with train.lr_grid: trial runs on validation that choose its lr."""
    jobs = []
    for task in study.all_tasks.values():
        for cell in study.own_cells(task.name):
            if _tuned(study, task.name, cell):
                filter_variant, bpe_variant = study.data_variant(task.name, cell)
                path_fields = {"task": task.name, "cell": cell, "filter_variant": filter_variant,
                               "bpe_variant": bpe_variant}
                jobs.append(_job(study, "tune", f"{task.name}-{cell}", path_fields, [data_paths(study, task.name, cell)[1]],
                                 _train_params(study, task, cell), {"task": task.name, "cell": cell},
                                 group=_group(task)))
    return jobs


def plan_jobs(study: Study, train_jobs: list[Job], eval_jobs: list[Job]) -> list[Job]:
    """Adaptive seeds: the plan job reads the first round's runs of the study's own tasks."""
    if not study.adaptive_seeds:
        return []
    first = [j for j in train_jobs + eval_jobs
             if j.wildcards["task"] in study.tasks and j.wildcards["seed"] in study.first_seeds]
    deps = [j.out(n) for j in first for n in (("metrics", "info", "cost") if j.stage == "train" else ("metrics", "info"))]
    return [_job(study, "plan", study.name, {}, deps, _existing(study, "seeds", "claims", "tasks", "cells", "sweeps"),
                 {})]


def run_jobs(study: Study) -> tuple[list[Job], list[Job]]:
    """(train jobs, evaluate jobs): one of each per task x cell x seed. Stage two of a screening
    has only the cells the screened task's grid does not train."""
    train_jobs, eval_jobs = [], []
    for task in study.all_tasks.values():
        for cell in study.own_cells(task.name):
            filter_variant, bpe_variant = study.data_variant(task.name, cell)
            bpe = data_paths(study, task.name, cell)[1]
            tuned = [tune_path(study, task.name, cell)] if _tuned(study, task.name, cell) else []
            for seed in study.seeds:
                path_fields = {"task": task.name, "cell": cell, "seed": seed, "filter_variant": filter_variant,
                               "bpe_variant": bpe_variant}
                key = f"{task.name}-{cell}-s{seed}"
                args = {"task": task.name, "cell": cell, "seed": seed}
                # Stage two of a screening: a cell trains only if stage one promoted its family
                # (the promote job's record; otherwise the job writes a "not promoted" record).
                # Adaptive seeds beyond the first round: only if the seed plan gives them to the cell.
                gate = [promotion_path(study, task.screen)] if _group(task, cell).endswith("-gated") else []
                extra = [seed_plan_path(study)] if seed not in study.first_seeds else []
                group = "-".join(filter(None, (_group(task, cell), "tuned" if tuned else "", "extra" if extra else "")))
                train_jobs.append(_job(study, "train", key, path_fields, [bpe] + tuned + gate + extra,
                                       _train_params(study, task, cell), args, group=group))
                ckpt = output_path("train", "ckpt", study=study.name, **path_fields)
                eval_params = _task_keys(study, task, "eval") + _existing(study, study.cell_key(cell))
                eval_jobs.append(_job(study, "evaluate", key, path_fields, [bpe, ckpt], eval_params, args,
                                      group=_group(task)))
    return train_jobs, eval_jobs


def report_jobs(study: Study, jobs: list[Job], train_jobs: list[Job], eval_jobs: list[Job],
                promote_jobs: list[Job]) -> list[Job]:
    """aggregate, figures, tables, claims, report. Their per-task parts cover the study's own
    tasks; screening stages feed only the screening tables."""
    s, path_fields = study.name, {}
    main_tasks = set(study.tasks)
    train_jobs = [j for j in train_jobs if j.wildcards["task"] in main_tasks]
    eval_jobs = [j for j in eval_jobs if j.wildcards["task"] in main_tasks]
    filtered_all = [j.out("filtered") for j in jobs if j.stage == "filter" and j.wildcards["task"] in main_tasks]
    run_files = [j.out(n) for j in train_jobs for n in ("metrics", "info", "cost")]
    eval_files = [j.out(n) for j in eval_jobs for n in ("outputs", "metrics", "info")]
    logs = [j.out("log") for j in train_jobs]
    plan = [seed_plan_path(study)] if study.adaptive_seeds else []
    agg = _job(study, "aggregate", s, path_fields, filtered_all + run_files + eval_files + logs + plan,
               _existing(study, "tasks", "cells", "sweeps", "seeds"), {})
    # The attention heat map reads one checkpoint: the first cell and seed of the chosen task.
    attention_task = study.report.get("attention_sample_task") or next(iter(study.tasks))
    first = next(j for j in train_jobs if j.wildcards["task"] == attention_task)
    # (filtered sets: the learning-curve figure counts each data-size cell's training rows)
    figs = _job(study, "figures", s, path_fields, list(agg.outs.values()) + logs + filtered_all + [first.out("ckpt")]
                + [output_path("bpe", "bpe", **first.wildcards)], _existing(study, "report"), {})
    # (a stage-two cell the screened task trains itself is read from that task's runs)
    screen_runs = [dict(study=s, task=study.run_task(t, c), cell=c, seed=seed)
                   for t in study.screen_tasks for c in study.task(t).cells for seed in study.seeds]
    screening = [j.out("promotion") for j in promote_jobs] + [
        output_path(stage, name, **run) for run in screen_runs
        for stage, name in (("evaluate", "outputs"), ("evaluate", "metrics"), ("train", "metrics"))]
    # (the data tables describe each task's data as its baseline cell sees it)
    base_data = [p for t in study.tasks for p in data_paths(study, t)]
    tabs = _job(study, "tables", s, path_fields, list(agg.outs.values()) + base_data + screening,
                _existing(study, "tasks", "cells", "sweeps", "datasets", "screening"), {})
    # Claims and references: evidence from the aggregate tables and the per-example test outputs.
    # (a tuned cell's trials: a failure counts as a claim's effect only if it failed at every lr)
    tuned = [tune_path(study, t, c) for t in study.tasks for c in study.task(t).cells if _tuned(study, t, c)]
    claims = _job(study, "claims", s, path_fields, list(agg.outs.values()) + eval_files + tuned,
                  _existing(study, "claims", "references", *[f"tasks.{t}.baseline_cell" for t in study.tasks]), {})
    report = _job(study, "report", s, path_fields, [figs.out("figures"), tabs.out("tables")] + list(agg.outs.values())
                  + list(claims.outs.values()) + [j.out(n) for j in eval_jobs for n in ("outputs", "metrics", "info")],
                  _existing(study, "report", "study"), {})
    return [agg, figs, tabs, claims, report]


def jobs_by_stage(study: Study) -> dict[str, dict[str, Job]]:
    out: dict[str, dict[str, Job]] = {s: {} for s in STAGE_ORDER}
    for job in build_jobs(study):
        out[job.stage][job.key] = job
    return out


class JobIndex:
    """The study's jobs, built once, looked up by the wildcards of a Snakemake rule instance.
    (Snakemake asks for a job's inputs, command and params hash once each per job.)"""

    def __init__(self, study: Study):
        self.study = study
        # Keyed by the wildcards of the stage's output paths: exactly those a rule instance has
        # (a job also carries derived ones, e.g. a training job its data variant).
        self._jobs = {(job.stage, _key(job.wildcards, _output_wildcards(job.stage))): job
                      for job in build_jobs(study)}

    def __call__(self, stage: str, wildcards) -> Job:
        path_fields = dict(wildcards)
        job = self._jobs.get((stage, _key(path_fields, _output_wildcards(stage))))
        if job is None:  # a rule's wildcards may be a subset of the job's (filter also knows its dataset)
            job = next((j for (s, _), j in self._jobs.items() if s == stage
                        and all(str(j.wildcards.get(k)) == str(v) for k, v in path_fields.items())), None)
        if job is None:
            raise KeyError(f"no {stage} job for {path_fields} in study {self.study.name}")
        return job


def _output_wildcards(stage: str) -> set[str]:
    return {w for tmpl in OUTPUTS[stage].values() for w in re.findall(r"{(\w+)}", tmpl)}


def _key(wildcards: dict, names: set[str]) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in wildcards.items() if k != "study" and k in names))
