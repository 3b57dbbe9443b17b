# Shared set-up: load + validate the study's params file and expose the stage table to rules.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir)))

from pipeline_src.common import StageError
from pipeline_src.study.config import ConfigError, load_study
from pipeline_src.runtime.run_lock import claim_run
from pipeline_src.runtime import slurm_guard
from pipeline_src.report import views
from pipeline_src.runtime.scheduler_timers import coalesce_reevaluation_timers
from pipeline_src.study.stages import DIRECTORIES, OUTPUTS, JobIndex

PARAMS_FILE = config.get("params", "params.yaml")
try:
    STUDY = load_study(PARAMS_FILE)
except ConfigError as err:
    # One line naming the key, and nothing scheduled.
    raise SystemExit(f"error: {err}")

JOB = JobIndex(STUDY)

# The run that Snakemake itself starts (not the per-job processes a cluster executor starts)
# holds the study's run lock; locks left by a run that died are removed (pipeline_src/runtime/run_lock.py).
if workflow.is_main_process:
    try:
        _stale_locks = claim_run(STUDY.name)
    except StageError as err:  # .snakemake/ on a full or read-only disk
        raise SystemExit(f"error: {err}")
    for _stale in _stale_locks:
        print(f"pipeline: removed stale lock {_stale} of a dead run of study '{STUDY.name}'", file=sys.stderr)
    # One re-scheduling timer instead of one more per finished job (pipeline_src/runtime/scheduler_timers.py).
    coalesce_reevaluation_timers()
REPORT_PDF = OUTPUTS["report"]["pdf"].format(study=STUDY.name)


onstart:
    # Under the SLURM executor: would SLURM accept these jobs? One line if not, before any sbatch;
    # and a run whose controller stays unreachable stops with one line instead of waiting forever.
    if workflow.executor_plugin is not None and workflow.executor_plugin.name == "slurm":
        slurm_guard.check(workflow.dag.needrun_jobs())
        slurm_guard.watch()


wildcard_constraints:
    task="[a-z0-9_-]+",
    cell="[a-z0-9_-]+",
    dataset="[a-z0-9_-]+",
    seed=r"\d+",
    filter_variant="[a-z0-9_-]+",
    bpe_variant="[a-z0-9_-]+",
    screen="[a-z0-9_-]+",
    kind="[a-z-]+",


def stage_outputs(stage, shown=None):
    """The stage's output templates, with the study filled in and directories marked.
    shown: {output name: report() arguments} for the outputs that go into `snakemake --report`."""
    outs = {}
    for name, template in OUTPUTS[stage].items():
        path = template.replace("{study}", STUDY.name)
        outs[name] = directory(path) if name in DIRECTORIES else path
        if shown and name in shown:
            outs[name] = report(outs[name], **shown[name])
    return outs


def report_group(what, wildcard, part):
    """category (part=0) or subcategory (part=1) of a file in the HTML report (pipeline_src/report/views.py)."""
    return lambda wildcards: views.report_group(STUDY, what, wildcards[wildcard])[part]


def stage_inputs(stage):
    return lambda wildcards: list(JOB(stage, wildcards).deps)


def stage_command(stage):
    return lambda wildcards: JOB(stage, wildcards).cmd


def stage_params_hash(stage):
    # Changes exactly when a params section this job reads changes (Snakemake's params trigger).
    return lambda wildcards: JOB(stage, wildcards).param_hash


def stage_log(stage, pattern):
    return f"logs/{STUDY.name}/{stage}/{pattern}.log"


def stage_benchmark(stage, pattern):
    # Wall time, memory and I/O per job; bench/bench_demo.py turns them into a per-stage table.
    return f"logs/{STUDY.name}/bench/{stage}/{pattern}.tsv"
