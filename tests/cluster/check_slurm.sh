#!/usr/bin/env bash
# Runs a tiny study through `snakemake --profile workflow/profiles/slurm` on a real SLURM cluster
# (tests/cluster/slurm_up.sh) and checks, in a scratch copy of the repository:
#   1. a refused GPU request stops the run with one line, before anything is queued;
#   2. every job goes through sbatch; a job that fails (here: cancelled while it runs, as a
#      preemption or a lost node would) is reported as failed, and the other cell still finishes;
#   3. the same command again runs only what is missing;
#   4. the metrics equal, byte for byte, those of the same study run locally (`--cores 2`).
# Leaves the scratch repository with the finished study in $CLUSTER_WORK/repo (for
# check_dvc_remote.sh). Needs SLURM_CONF (or /etc/slurm/slurm.conf) and the venv on PATH.
# CLUSTER_COPY_READY=FILE: touches FILE once the scratch copy is made, so that a caller running this
# in the background can wait for it before it changes the working tree (a study writing its
# tracked dvc.lock while it is copied would leave a half-written one in the copy).
set -euo pipefail
# A command that fails names itself and its line (set -e alone would end the script silently).
trap 'echo "FAIL: $0 line $LINENO: \`$BASH_COMMAND\` exited $?" >&2' ERR
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${CLUSTER_WORK:-/tmp/pipeline-cluster-check}
PARAMS=workflow/studies/tiny/params.yaml
STUDY=tiny
# Status checks every few seconds instead of 20 (the profile's value, kind to a big cluster).
SLURM_CMD=(snakemake --profile workflow/profiles/slurm --config "params=$PARAMS" --slurm-init-seconds-before-status-checks 8)
export PIPELINE_QUIET=1
fail() { echo "FAIL: $*" >&2; exit 1; }
say() { echo "check_slurm: $*"; }

# A scratch git repository with the working tree's files and the tiny study (a fixture).
rm -rf "$WORK" && mkdir -p "$WORK/repo"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$WORK/repo")
cd "$WORK/repo"
mkdir -p "$(dirname "$PARAMS")" && cp tests/fixtures/params/valid_tiny.yaml "$PARAMS"
# Long enough for both cells to learn the task (a run near the unigram loss is flagged failed and
# would leave the metrics compared below without meaning): 80 steps, about 2 s a run.
python - "$PARAMS" <<'PY'
import sys, yaml
path = sys.argv[1]
params = yaml.safe_load(open(path))
params["tasks"]["reorder"]["train"].update(max_steps=80, lr=1.0e-2, warmup_steps=10, eval_every=20, log_every=10)
open(path, "w").write(yaml.safe_dump(params, sort_keys=False))
PY
git init -q && git add -A && git -c user.name=ci -c user.email=ci@localhost commit -qm "scratch copy"
[[ -z ${CLUSTER_COPY_READY:-} ]] || touch "$CLUSTER_COPY_READY"
export PYTHONPATH=$PWD

metrics() { find data/$STUDY/runs data/$STUDY/eval -type f \( -name '*_metrics.json' -o -path '*/outputs/*' \) | sort; }

# The local reference run goes on in a clone (same commit, so the same git hash in the metrics)
# while the SLURM runs below mostly wait on the queue. Its jobs fork from the start-up server, as
# `make demo`'s do (same bytes as jobs of their own, tests/test_preload.py); the SLURM jobs never
# do, so equal metrics also show that the two ways give the same bytes.
say "local run (reference), in the background"
git clone -q "$WORK/repo" "$WORK/local"
(cd "$WORK/local" && PYTHONPATH=$PWD python -m pipeline_src preload snakemake --cores 2 --config "params=$PARAMS" \
   --quiet rules) >"$WORK/local.log" 2>&1 &
local_run=$!

say "1. a GPU request the cluster cannot meet gives one line and queues nothing"
before=$(squeue -h -t all | wc -l)
if "${SLURM_CMD[@]}" --set-resources train:gpu=4 train:slurm_partition=gpu >"$WORK/refused.log" 2>&1; then
  fail "a request for 4 GPUs on a 1-GPU cluster was not refused"
fi
line=$(grep '^error: SLURM would not run the jobs of rule train' "$WORK/refused.log") \
  || { tail -20 "$WORK/refused.log"; fail "no one-line refusal"; }
echo "  $line"
[ "$(squeue -h -t all | wc -l)" = "$before" ] || fail "jobs were queued despite the refusal"

say "2. SLURM run; the first training job is cancelled while it runs"
"${SLURM_CMD[@]}" >"$WORK/run1.log" 2>&1 &
run1=$!
cancelled=""
for _ in $(seq 1500); do  # 5 min at most
  cancelled=$(squeue -h -p gpu -t RUNNING -o %i | head -1)
  [ -n "$cancelled" ] && { scancel "$cancelled"; break; }
  kill -0 $run1 2>/dev/null || break
  sleep 0.2
done
[ -n "$cancelled" ] || fail "no job ever ran in the gpu partition"
if wait $run1; then fail "the run with a cancelled job exited 0"; fi
# A failed group job is reported as "Error in group cell" with its SLURM log, which says why.
slurm_log=$(grep -A1 "message: Error in group cell" "$WORK/run1.log" | grep -oE "/[^ ]*/$cancelled\.log" | head -1) \
  || { tail -40 "$WORK/run1.log"; fail "the cancelled job $cancelled was not reported as failed"; }
grep -q "CANCELLED" "$slurm_log" || fail "$slurm_log does not say the job was cancelled"
echo "  job $cancelled reported failed; its SLURM log: $(grep CANCELLED "$slurm_log" | head -1)"
n_sbatch=$(grep -c "has been submitted with SLURM jobid" "$WORK/run1.log")
# data group + two cell groups; the report stages never start (they need both cells).
[ "$n_sbatch" = 3 ] || fail "expected 3 sbatch submissions (data, cell x2), got $n_sbatch"
# Only the code records (one small job per stage kind, hashing its code) run where Snakemake runs.
if grep "^localrule" "$WORK/run1.log" | grep -qv "^localrule code:"; then fail "a job ran outside SLURM"; fi
[ ! -e reports/$STUDY/report.pdf ] || fail "the report was built although a cell failed"
n_done=$(find data/$STUDY/eval -name eval_metrics.json | wc -l)
[ "$n_done" = 1 ] || fail "expected one of the two cells evaluated, got $n_done"

say "3. the same command again runs only what is missing"
"${SLURM_CMD[@]}" >"$WORK/run2.log" 2>&1 || { tail -40 "$WORK/run2.log"; fail "the rerun failed"; }
rules=$(grep -oE "^\s*rule [a-z_]+:|wildcards: .*" "$WORK/run2.log" | tr -s ' ' | paste -sd' ')
n_train=$(grep -cE "^\s*rule train:" "$WORK/run2.log"); n_eval=$(grep -cE "^\s*rule evaluate:" "$WORK/run2.log")
n_data=$(grep -cE "^\s*rule (download|filter|bpe):" "$WORK/run2.log" || true)
[ "$n_train" = 1 ] && [ "$n_eval" = 1 ] && [ "$n_data" = 0 ] \
  || fail "the rerun should run one train + one evaluate and no data job: $rules"
n_sbatch=$(grep -c "has been submitted with SLURM jobid" "$WORK/run2.log")
[ "$n_sbatch" = 6 ] || fail "expected 6 sbatch submissions (cell; aggregate, figures, tables, claims, report), got $n_sbatch"
test -s reports/$STUDY/report.pdf || fail "no report after the rerun"
echo "  reran: 1 cell (train + evaluate) and the 5 report stages, in $n_sbatch sbatch jobs"

say "4. metrics from SLURM equal the local run's byte for byte"
wait $local_run || { tail -30 "$WORK/local.log"; fail "local run"; }
n_metrics=$(cd "$WORK/local" && metrics | wc -l)
[ "$(metrics | wc -l)" = "$n_metrics" ] || fail "SLURM produced $(metrics | wc -l) metrics files, local $n_metrics"
metrics | while read -r f; do cmp "$f" "$WORK/local/$f" || fail "$f differs"; done
echo "  $n_metrics files identical ($(metrics | grep -c _metrics.json) metrics JSON, the rest evaluation outputs)"
failed=$(python -c "import pandas as pd; print(int(pd.read_csv('reports/$STUDY/results.csv')['failed'].sum()))")
[ "$failed" = 0 ] || fail "$failed of the study's runs failed to train: its metrics compare models that learned nothing"
echo "  every run trained (none near the unigram loss)"
say "passed"
