"""Where every stage's outputs live, as templates over a job's wildcards, and the command that
runs a stage. The stage modules read and write through these; the stage table
(pipeline_src/study/stages.py) builds the DAG from them.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from .config import Study

# Output paths, as templates over the job's wildcards. Snakemake rules use these templates
# verbatim (with wildcards); DVC stages and jobs use them formatted.
OUTPUTS: dict[str, dict[str, str]] = {
    # The hashes of the code files a stage kind runs, which its jobs depend on (code_manifest.py).
    "code": {"manifest": "data/{study}/code/{kind}.json"},
    "download": {"raw": "data/{study}/raw/{dataset}"},
    # {filter_variant}/{bpe_variant}: the data variant (config.Study.data_variant): cells that
    # override `filter` or `bpe` get their own filtered set / tokenizer; cells with equal settings
    # share them.
    "filter": {"filtered": "data/{study}/filtered/{task}/{filter_variant}"},
    "bpe": {"bpe": "data/{study}/bpe/{task}/{filter_variant}/{bpe_variant}"},
    # A cell's peak lr chosen on validation before its runs (cells with train.lr_grid; tune/lr_trials.py).
    "tune": {"tune": "data/{study}/tune/{task}/{cell}"},
    "train": {
        "ckpt": "data/{study}/runs/{task}/{cell}/seed{seed}/ckpt",
        "metrics": "data/{study}/runs/{task}/{cell}/seed{seed}/train_metrics.json",
        "info": "data/{study}/runs/{task}/{cell}/seed{seed}/train_info.json",
        "log": "data/{study}/runs/{task}/{cell}/seed{seed}/train_log.tsv",
        "cost": "data/{study}/runs/{task}/{cell}/seed{seed}/cost.json",
    },
    "evaluate": {
        "outputs": "data/{study}/eval/{task}/{cell}/seed{seed}/outputs",
        "metrics": "data/{study}/eval/{task}/{cell}/seed{seed}/eval_metrics.json",
        "info": "data/{study}/eval/{task}/{cell}/seed{seed}/eval_info.json",
    },
    "promote": {"promotion": "data/{study}/screening/{screen}/promotion.json"},
    # Adaptive seeds: which cells run the seeds beyond the first round (seed_plan.py).
    "plan": {"plan": "data/{study}/plan/seeds.json"},
    "aggregate": {
        "results": "reports/{study}/results.csv",
        "summary": "reports/{study}/summary.csv",
        "significance": "reports/{study}/significance.csv",
        # <task>/<cell>.json: the task's headline metric (mean, std over seeds), test PPL, cost.
        "headline": "reports/{study}/metrics",
        # Data behind the dvc.yaml plots: <task>/train_loss|val_loss/<cell>.tsv, <task>/headline.tsv.
        "plots": "reports/{study}/plots",
    },
    "figures": {"figures": "reports/{study}/figures"},
    "tables": {"tables": "reports/{study}/tables"},
    "claims": {"claims": "reports/{study}/claims.csv", "references": "reports/{study}/references.csv"},
    "report": {"pdf": "reports/{study}/report.pdf", "tex": "reports/{study}/report.tex"},
}
DIRECTORIES = {"raw", "filtered", "bpe", "tune", "ckpt", "outputs", "figures", "tables", "headline", "plots"}
# What DVC shows as metrics and plots: the study-level views only (one small file per task x cell;
# plots defined at the top level of dvc.yaml by pipeline_src/runtime/dvc_yaml.py). Per-run metrics files
# stay plain outputs: declared as metrics they made `dvc metrics show` a table of ~80 rows.
METRICS = {("aggregate", "headline")}
PLOTS = {("aggregate", "plots")}
# Scratch space for resumable training state: deliberately NOT a declared output, so a driver
# that deletes incomplete outputs after a crash does not delete the state needed to resume.
SCRATCH = "data/{study}/scratch/{task}/{cell}/seed{seed}"


def output_path(stage: str, name: str, **wildcards) -> str:
    return OUTPUTS[stage][name].format(**wildcards)


def code_manifest_path(study: Study, kind: str) -> str:
    return output_path("code", "manifest", study=study.name, kind=kind)


def promotion_path(study: Study, screen: str) -> str:
    return output_path("promote", "promotion", study=study.name, screen=screen)


def seed_plan_path(study: Study) -> str:
    return output_path("plan", "plan", study=study.name)


def tune_path(study: Study, task: str, cell: str) -> str:
    return output_path("tune", "tune", study=study.name, task=task, cell=cell)


def tune_record(study: Study, task: str, cell: str) -> Path:
    """The tune stage's record of a cell: its lr grid, every trial and the lr chosen (tune/lr_trials.py)."""
    return Path(tune_path(study, task, cell)) / "tune.json"


def write_records(stage: str, rec: dict, marker: str, **wildcards) -> None:
    """Every declared output of a `stage` job that does not run (a screening family not promoted,
    an adaptive seed not needed), holding the record of why: directories get the `marker` file,
    the training log a header only, JSON files the record. The DAG stays static; the record says
    why there is nothing in it."""
    from ..common import atomic_dir, atomic_write_json, atomic_write_text

    for name in OUTPUTS[stage]:
        path = Path(output_path(stage, name, **wildcards))
        if name in DIRECTORIES:
            with atomic_dir(path) as tmp:
                (tmp / marker).write_text(json.dumps(rec, indent=1) + "\n")
        elif path.suffix == ".tsv":
            atomic_write_text(path, "step\ttrain_loss\tval_loss\n")
        else:
            atomic_write_json(path, rec)


def write_skipped_train(study: Study, task: str, cell: str, seed: int, marker: str, rec: dict, why: str) -> None:
    """A training job that does not run (`why`: e.g. "not promoted"): its declared outputs,
    holding `rec` instead of a model (write_records)."""
    write_records("train", rec, marker, study=study.name, task=task, cell=cell, seed=seed)
    print(f"[train] {task}/{cell}/seed{seed}: {why}, nothing trained", flush=True)


def write_skipped_eval(study: Study, task: str, cell: str, seed: int, marker: str, why: str) -> bool:
    """When the checkpoint is a `marker` record (write_skipped_train), pass it on as the
    evaluation's outputs and return True; else False."""
    path_fields = {"study": study.name, "task": task, "cell": cell, "seed": seed}
    record = Path(output_path("train", "ckpt", **path_fields)) / marker
    if not record.is_file():
        return False
    write_records("evaluate", json.loads(record.read_text()), marker, **path_fields)
    print(f"[evaluate] {task}/{cell}/seed{seed}: {why}, nothing evaluated", flush=True)
    return True


def data_paths(study: Study, task: str, cell: str | None = None) -> tuple[str, str]:
    """(filtered dir, bpe dir) a cell trains and evaluates on; without a cell, the task's
    baseline cell's (the data the report describes as the task's)."""
    filter_variant, bpe_variant = study.data_variant(task, cell or study.task(task).baseline_cell)
    owner = study.data_task(task)  # stage two of a screening reads the screened task's data
    return (output_path("filter", "filtered", study=study.name, task=owner, filter_variant=filter_variant),
            output_path("bpe", "bpe", study=study.name, task=owner, filter_variant=filter_variant,
                        bpe_variant=bpe_variant))


def stage_command(stage: str, study: Study, **args) -> str:
    """`python -m pipeline_src STAGE --params FILE --ARG VALUE...`: what both drivers run."""
    parts = ["python", "-m", "pipeline_src", stage, "--params", study.path]
    for k, v in args.items():
        parts += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(parts)


def dvc_yaml_path(study: Study) -> Path:
    """The study's dvc.yaml: beside its params file (the root one for params.yaml)."""
    params = Path(study.path)
    return Path("dvc.yaml") if params.as_posix() == "params.yaml" else params.parent / "dvc.yaml"
