"""The study: its params file, where its files live, and the stage table that makes its DAG.

    config.py         load and validate a params file; base + cell configs, frozen (Study)
    claims_config.py  the `claims:` and `references:` sections, validated
    paths.py          every stage's output paths (templates over a job's wildcards), stage commands
    imports.py        the package's import graph: the code each stage runs
    stages.py         the stage table: every job, its command, inputs, outputs and code
    seed_plan.py      adaptive seeds: which cells run more seeds (reads the seed plan the `plan` stage writes)
    screening.py      two-stage screening: which families stage two trains
    convergence.py    the rule that says whether a run converged (trainer and report)
    estimate.py       a study's training compute and wall time before anything runs
"""
