#!/usr/bin/env bash
# .ci/demo_study.sh: CI's demo steps, run from the root of a fresh clone with the venv's tools on
# PATH (.ci/run runs it in the background, on the cores the other steps leave idle):
#   1. `make demo` from scratch under Snakemake (its jobs forked from the start-up server), to its PDF;
#   2. a second `snakemake -n` plans no job;
#   3. Snakemake's `--report` (HTML) carries the study's figures.
# Each part prints its time, since the timing table of .ci/run has one row for all three.
set -euo pipefail
trap 'echo "FAIL: $0 line $LINENO: \`$BASH_COMMAND\` exited $?" >&2' ERR
PARAMS=workflow/studies/demo/params.yaml
t0=$SECONDS
make -o install demo  # the venv on PATH is CI's own: nothing to install in this clone
test -s reports/demo/report.pdf
echo "demo study: $((SECONDS - t0)) s"

t0=$SECONDS
out=$(snakemake --cores 2 --config params=$PARAMS -n 2>&1)
grep -q "Nothing to be done" <<<"$out" || { echo "$out" | tail -30; echo "FAIL: snakemake wants to rerun jobs"; exit 1; }
echo "a second snakemake has nothing to do: $((SECONDS - t0)) s"

t0=$SECONDS
snakemake --cores 2 --config params=$PARAMS --report reports/demo/report.html
grep -q "loss_reorder.png" reports/demo/report.html || { echo "FAIL: reports/demo/report.html lacks the figures"; exit 1; }
ls -l reports/demo/report.html reports/demo/report.pdf
echo "the HTML report: $((SECONDS - t0)) s"
