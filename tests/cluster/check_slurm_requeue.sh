#!/usr/bin/env bash
# A training job longer than its SLURM time limit finishes by itself, across several allocations,
# through `snakemake --profile workflow/profiles/slurm` on a real SLURM cluster
# (tests/cluster/slurm_up.sh), and ends with the metrics of the same training run locally:
#   - the train job asks for 1 minute (--set-resources train:runtime=1) and needs ~64 s of
#     training (its step count is calibrated on this machine first), more than two allocations
#     leave once 30 s are kept back (at most ~25 s of training each);
#   - inside the job the stage reads the time left (squeue), saves its state before the limit
#     and requeues the job (scontrol requeue); SLURM starts it again, the stage resumes;
#   - checked: SLURM restarted the job at least twice (>= 3 allocations), the run's cost.json
#     lists its stops, and train_metrics.json equals the local run's byte for byte.
# Needs SLURM_CONF (or /etc/slurm/slurm.conf) and the venv on PATH.
set -euo pipefail
# A command that fails names itself and its line (set -e alone would end the script silently).
trap 'echo "FAIL: $0 line $LINENO: \`$BASH_COMMAND\` exited $?" >&2' ERR
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${CLUSTER_WORK:-/tmp/pipeline-cluster-check}-requeue
PARAMS=workflow/studies/requeue/params.yaml
RUN=data/requeue/runs/reorder/baseline/seed0
export PIPELINE_QUIET=1
fail() { echo "FAIL: $*" >&2; exit 1; }
say() { echo "check_slurm_requeue: $*"; }

# A job that requeues itself is eligible again ~11 s later, but only the scheduler's periodic pass
# starts it, every 60 s by default: about 70 s of this check's time was that wait. For this check
# the pass runs every 5 s. Not for the whole test cluster: there it delayed the start of freshly
# submitted jobs by 1-2 s, which the Snakemake plugin's status checks turned into ~30 s more for
# the tiny study (check_slurm.sh). The setting is put back when the check ends. Only the test
# cluster of slurm_up.sh (ClusterName=pipeline) is touched, and only if it sets no scheduler
# parameters of its own.
conf=${SLURM_CONF:-/etc/slurm/slurm.conf}
if [ -w "$conf" ] && grep -qx "ClusterName=pipeline" "$conf" && ! grep -q "^SchedulerParameters=" "$conf"; then
  echo "SchedulerParameters=sched_interval=5" >>"$conf"
  trap 'sed -i --follow-symlinks "/^SchedulerParameters=sched_interval=5$/d" "$conf"; scontrol reconfigure || true' EXIT
  scontrol reconfigure || fail "scontrol reconfigure"
fi

rm -rf "$WORK" && mkdir -p "$WORK/repo"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$WORK/repo")
cd "$WORK/repo"
export PYTHONPATH=$PWD
mkdir -p "$(dirname "$PARAMS")"
# The tiny study, one cell, d64. Its step count is set from this machine's speed so that the
# training takes about 64 s. A 1-minute allocation leaves 17-25 s of it (30 s are kept back for
# the save, and the job's start-up and the last step's safety margin come off too), so two
# allocations (at most ~50 s) are too few; three or four are needed. The calibration misjudges
# the real run's speed both ways, by up to a quarter (docs/ci-history.md), so the step count errs
# long: one allocation too many costs ~50 s, one too few fails the check. ~64 s needs three
# allocations if the real run is up to ~1.4x faster than calibrated, four if it is ~5 % slower.
# The calibration trains two runs at once, as the real phase does (the SLURM job beside the local
# run), over 1,500 steps each so that start-up costs hardly count; the faster sets the speed.
study() {  # study NAME MAX_STEPS [SEEDS] -> params file on stdout
  python - "$@" <<'PY'
import sys, yaml
p = yaml.safe_load(open("tests/fixtures/params/valid_tiny.yaml"))
p["study"] = sys.argv[1]
if len(sys.argv) > 3:
    p["seeds"] = list(range(int(sys.argv[3])))
task = p["tasks"]["reorder"]
task["cells"] = ["baseline"]
task["model"].update(d_model=64, d_ff=256)
steps = int(sys.argv[2])
task["train"].update(max_steps=steps, eval_every=max(1, steps // 5), log_every=50)
print(yaml.safe_dump(p))
PY
}
study calibrate 1500 2 >"$WORK/calibrate.yaml"
# (its stages fork from the start-up server: the training loop's speed is the same, the imports are saved)
python -m pipeline_src preload bash -c 'for stage in "download --dataset tiny_reorder" "filter --task reorder" \
    "bpe --task reorder"; do
  python -m pipeline_src $stage --params "$0" >/dev/null || exit 1
done
python -m pipeline_src train --task reorder --cell baseline --seed 0 --params "$0" >/dev/null & first=$!
python -m pipeline_src train --task reorder --cell baseline --seed 1 --params "$0" >/dev/null || exit 1
wait $first' "$WORK/calibrate.yaml"
read -r rate steps < <(python -c "import json
walls = [json.load(open(f'data/calibrate/runs/reorder/baseline/seed{s}/cost.json'))['wall_s'] for s in (0, 1)]
rate = 1500 / min(walls)
print(round(rate), max(1000, round(rate * 64 / 100) * 100))")
rm -rf data/calibrate
say "this machine trains the cell at $rate steps/s (the faster of two runs at once): $steps steps, about 64 s"
study requeue "$steps" >"$PARAMS"
git init -q && git add -A && git -c user.name=ci -c user.email=ci@localhost commit -qm "scratch copy"

say "local run (reference), in the background"
git clone -q "$WORK/repo" "$WORK/local"
# (its jobs forked from the start-up server, as in check_slurm.sh; the SLURM job runs the normal way)
(cd "$WORK/local" && PYTHONPATH=$PWD python -m pipeline_src preload snakemake --cores 1 --config "params=$PARAMS" \
   --quiet rules -- "$RUN/train_metrics.json") >"$WORK/local.log" 2>&1 &
local_run=$!

# The data stages (download, filter, BPE) run here, forked from the start-up server: this check is
# about the training job, and the same stages as a SLURM job cost ~40 s, mostly waiting for the
# plugin's status checks (3, 16, 39 s) to see a job of a few seconds finished. The tiny study
# (check_slurm.sh) runs them through SLURM.
say "the data stages, locally"
python -m pipeline_src preload snakemake --cores 1 --config "params=$PARAMS" --quiet rules --until bpe \
  -- "$RUN/train_metrics.json" >"$WORK/data.log" 2>&1 || { tail -30 "$WORK/data.log"; fail "the data stages"; }

say "SLURM: the train job has a 1-minute limit"
# The SLURM plugin checks the job's state after 3 s, then waits 10 s longer after each check that
# finds it unfinished: checks at 3, 16, 39, 72 and 115 s. The requeued job finishes ~95 s after it
# was submitted, so the check at 115 s sees it (with 8 s, as elsewhere, the checks fall at 92 and
# 140 s, and the check waited ~45 s for the second one).
t0=$SECONDS
snakemake --profile workflow/profiles/slurm --config "params=$PARAMS" --slurm-init-seconds-before-status-checks 3 \
  --set-resources train:runtime=1 -- "$RUN/train_metrics.json" >"$WORK/slurm.log" 2>&1 \
  || { tail -40 "$WORK/slurm.log"; fail "the SLURM run did not finish"; }
[ "$(grep -c "submitted with SLURM jobid" "$WORK/slurm.log")" = 1 ] || fail "SLURM ran more than the train job"
job=$(grep -oE "submitted with SLURM jobid [0-9]+" "$WORK/slurm.log" | tail -1 | grep -oE "[0-9]+$")  # the cell's
restarts=$(scontrol show job "$job" 2>/dev/null | grep -oE "Restarts=[0-9]+" | cut -d= -f2)
[ -n "$restarts" ] || fail "SLURM no longer knows job $job"
stops=$(python -c "import json; print(len(json.load(open('$RUN/cost.json'))['stops']))")
if [ "$restarts" -lt 2 ]; then  # say whether the calibration or the stage is to blame
  python - "$RUN/cost.json" "$steps" "$rate" <<'PY' >&2
import json, sys
cost, steps, rate = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
print(f"the run stopped at steps {[s['step'] for s in cost['stops']]} of {steps}; it trained at "
      f"{steps / cost['wall_s']:.0f} steps/s, calibrated at {rate}")
PY
  fail "job $job was restarted $restarts times; expected >= 2 (>= 3 allocations)"
fi
[ "$stops" = "$restarts" ] || fail "cost.json lists $stops stops, SLURM restarted the job $restarts times"
grep -q "the job's time is nearly up" "$RUN/cost.json" || fail "cost.json does not say why the run stopped"
echo "  job $job: $((restarts + 1)) allocations of 1 minute, $stops saved stops, $((SECONDS - t0)) s in all"

say "metrics from the requeued job equal the local run's byte for byte"
wait $local_run || { tail -30 "$WORK/local.log"; fail "local run"; }
cmp "$RUN/train_metrics.json" "$WORK/local/$RUN/train_metrics.json" || fail "train_metrics.json differs"
echo "  $RUN/train_metrics.json identical"
say "passed"
