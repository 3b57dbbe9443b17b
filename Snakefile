# The pipeline as a Snakemake workflow. Thin on purpose: every job's inputs, outputs and shell
# command come from the stage table in pipeline_src/study/stages.py, which also generates dvc.yaml,
# so `snakemake` and `dvc repro` run the same DAG (tests/test_dag.py checks it).
#
#   snakemake --cores 8 --resources gpu=1                      # the real study (params.yaml)
#   snakemake --cores 2 --config params=workflow/studies/demo/params.yaml
#   snakemake --profile workflow/profiles/local

include: "workflow/rules/common.smk"


# `snakemake --report reports/<study>/report.html`: this description, plus the outputs flagged
# with report() in workflow/rules/report.smk.
report: "workflow/report/workflow.rst"


rule all:
    input:
        REPORT_PDF,
    default_target: True


include: "workflow/rules/code.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
