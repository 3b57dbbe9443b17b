#!/usr/bin/env bash
# Re-make the committed CPU study's check run(s) from scratch and compare them with the reference:
# for every reports/reference/cpu/check/<task>/<cell>/seed<N>/, Snakemake runs that run's jobs
# (download -> filter -> BPE -> train -> evaluate, nothing else of the study), then
# `python -m pipeline_src check-reference` compares its metrics with the committed ones
# (identical bytes on the reference's CPU type; tolerances otherwise: pipeline_src/report/reference.py).
# Run from the repository root with the venv's tools on PATH (as .ci/run does).
set -euo pipefail
PARAMS=${PARAMS:-workflow/studies/cpu/params.yaml}
REF=${REFERENCE:-reports/reference/cpu}
runs=("$REF"/check/*/*/seed*)
[[ -d "${runs[0]}" ]] || { echo "FAIL: no check run in $REF/check"; exit 1; }
for run in "${runs[@]}"; do
  IFS=/ read -r task cell seed_dir <<<"${run#"$REF"/check/}"
  seed=${seed_dir#seed}
  target=$(python -c "import sys; from pipeline_src.study.config import load_study; from pipeline_src.study.stages import output_path
s = load_study(sys.argv[1]); print(output_path('evaluate', 'metrics', study=s.name, task=sys.argv[2], cell=sys.argv[3], seed=int(sys.argv[4])))" \
    "$PARAMS" "$task" "$cell" "$seed")
  t0=$SECONDS
  # its jobs fork from the start-up server (pipeline_src/runtime/preload.py): the same bytes as jobs started
  # the normal way (tests/test_preload.py), without each paying for importing torch
  python -m pipeline_src preload snakemake --cores 2 --config params="$PARAMS" --quiet rules -- "$target"
  echo "re-made $task/$cell/seed$seed in $((SECONDS - t0)) s"
  python -m pipeline_src check-reference --params "$PARAMS" --task "$task" --cell "$cell" --seed "$seed" --reference "$REF"
done
