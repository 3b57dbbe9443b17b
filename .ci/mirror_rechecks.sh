#!/usr/bin/env bash
# Two checks of the mirror study that `make mirror` left in this checkout (.ci/run runs them in the
# background, on idle cores, while the requeue check waits on SLURM):
#   1. retraining one cell gives byte-identical metrics;
#   2. `dvc repro` again redoes only what the retrain's wall-clock figures feed, then nothing, and
#      `dvc status` is clean.
# Run from the repository root with the venv's tools on PATH.
set -euo pipefail
t0=$SECONDS
read -r stage metrics < <(python - <<'PY'
from pipeline_src.config import load_study
from pipeline_src.stages import output_path
s = load_study("workflow/studies/mirror/params.yaml")
t = next(iter(s.tasks.values()))
cell, seed = t.cells[0], s.seeds[0]
print(f"{t.name}-{cell}-s{seed}", output_path("train", "metrics", study=s.name, task=t.name, cell=cell, seed=seed))
PY
)
cp "$metrics" /tmp/ci_metrics_before.json
dvc repro --force --single-item "workflow/studies/mirror/dvc.yaml:train@$stage" >/dev/null
cmp "$metrics" /tmp/ci_metrics_before.json && echo "identical: $metrics"
echo "retrained $stage in $((SECONDS - t0)) s"

t0=$SECONDS
python -m pipeline_src preload dvc repro workflow/studies/mirror/dvc.yaml >/dev/null  # the report stages forked, as in `make mirror`
out=$(dvc repro workflow/studies/mirror/dvc.yaml 2>&1)
if grep -q "Running stage" <<<"$out"; then echo "$out" | grep "Running stage"; echo "FAIL: second dvc repro reran stages"; exit 1; fi
status=$(dvc status workflow/studies/mirror/dvc.yaml 2>&1)
grep -q "Data and pipelines are up to date" <<<"$status" || { echo "$status"; echo "FAIL: dvc status is not clean"; exit 1; }
echo "$status"
echo "dvc repro again, then nothing: $((SECONDS - t0)) s"
