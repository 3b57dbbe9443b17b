#!/usr/bin/env bash
# The reference CPU study in one command, from the repository root (after `make install`):
#
#   bash workflow/studies/cpu/run.sh
#
# Runs `snakemake --cores 2 --config params=workflow/studies/cpu/params.yaml`: download -> filter
# -> BPE -> every training run and its evaluation, two one-thread jobs at a time -> aggregate ->
# figures, tables, claims -> report.pdf. Typing the same command again continues a study that was
# stopped: Snakemake keeps every finished job, and a training run that was cut off resumes from
# its last evaluation with the same result. Each sitting's wall time is appended to
# logs/cpu/sittings.tsv; the study's wall time is their sum.
#
# When the report is built, the products are copied into reports/reference/cpu/ (REFERENCE_OUT):
# report.pdf/.tex, results/summary/significance/claims/references CSVs, the cost table, the exact
# command, wall time and the `validate` estimate beside it, each cell's lr trials (lr_trials/),
# versions, dvc.lock (hashes of every output, `dvc commit` after the run) and the re-checked run's
# metrics files under check/ (what `.ci/run` compares a fresh run of it against:
# pipeline_src/report/reference.py).
# CORES (default 2) sets --cores; --fresh deletes this study's previous outputs first.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PARAMS=${STUDY_PARAMS:-workflow/studies/cpu/params.yaml}
OUT=${REFERENCE_OUT:-reports/reference/cpu}
CORES=${CORES:-2}
CHECK_RUN=${CHECK_RUN:-"ptb baseline 0"}  # task cell seed of the run CI re-makes
# ... made from a shortened copy of the study (check.yaml beside its params file) where there is one
[[ -f "$(dirname "$PARAMS")/check.yaml" ]] && default_check="$(dirname "$PARAMS")/check.yaml" || default_check=$PARAMS
CHECK_PARAMS=${CHECK_PARAMS:-$default_check}
[[ -d .venv/bin ]] && export PATH="$PWD/.venv/bin:$PATH"
export PIPELINE_QUIET=${PIPELINE_QUIET:-1} PYTHONUNBUFFERED=1
NAME=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['study'])" "$PARAMS")
LOGS="logs/$NAME"

mirror=${PIPELINE_DATA_MIRROR:-../shared/datasets}
for d in $(python -c "import sys, yaml; print(' '.join(yaml.safe_load(open(sys.argv[1]))['datasets']))" "$PARAMS"); do
  [[ -d "$mirror/$d" ]] || { echo "error: $mirror/$d missing (set PIPELINE_DATA_MIRROR)"; exit 1; }
done
if [[ "${1:-}" == "--fresh" ]]; then
  echo "removing this study's previous outputs: data/$NAME reports/$NAME $LOGS"
  rm -rf "data/$NAME" "reports/$NAME" "$LOGS"
fi
mkdir -p "$LOGS" "$OUT"
python -m pipeline_src validate --params "$PARAMS" | tee "$LOGS/validate.txt"

SNAKEMAKE_ARGS=(--cores "$CORES" --config params="$PARAMS")
CMD="snakemake ${SNAKEMAKE_ARGS[*]}"
[[ -f "$LOGS/sittings.tsv" ]] || printf 'start_utc\tend_utc\twall_s\texit\n' > "$LOGS/sittings.tsv"
start_utc=$(date -u +%FT%TZ); t0=$(date +%s.%N)
status=running
record_sitting() {  # also when the sitting is interrupted (Ctrl-C, a kill): its time still counts
  local t1; t1=$(date +%s.%N)
  printf '%s\t%s\t%s\t%s\n' "$start_utc" "$(date -u +%FT%TZ)" "$(python -c "print(round($t1 - $t0, 1))")" \
    "$status" >> "$LOGS/sittings.tsv"
}
trap 'status=interrupted; record_sitting; trap - EXIT; exit 130' INT TERM
trap 'record_sitting' EXIT
echo "+ $CMD"
status=0
snakemake "${SNAKEMAKE_ARGS[@]}" || status=$?
record_sitting
trap - EXIT INT TERM
if ((status)); then
  echo "snakemake stopped (exit $status); type the same command to continue"
  exit "$status"
fi

DVC_YAML=$(dirname "$PARAMS")/dvc.yaml
if command -v dvc >/dev/null && [[ -f $DVC_YAML ]]; then
  echo "recording output hashes in ${DVC_YAML%.yaml}.lock (dvc commit; not timed)"
  dvc commit --force "$DVC_YAML" >/dev/null 2>&1 \
    && cp "${DVC_YAML%.yaml}.lock" "$OUT/dvc.lock" || echo "warning: dvc commit failed; no dvc.lock"
fi
for f in report.pdf report.tex results.csv summary.csv significance.csv claims.csv references.csv; do
  cp "reports/$NAME/$f" "$OUT/$f"
done
cp "reports/$NAME/tables/cost.tex" "$OUT/cost_table.tex"
cp "$LOGS/validate.txt" "$OUT/validate.txt"
# each cell's lr trials (the tune stage's records: every lr of the grid, the validation loss it reached)
python - "$PARAMS" "$OUT/lr_trials" <<'PY'
import shutil, sys
from pathlib import Path
from pipeline_src.study.config import load_study
from pipeline_src.study.stages import build_jobs, tune_record
study = load_study(sys.argv[1])
for job in (j for j in build_jobs(study) if j.stage == "tune"):
    task, cell = job.wildcards["task"], job.wildcards["cell"]
    (Path(sys.argv[2]) / task / cell).mkdir(parents=True, exist_ok=True)
    shutil.copy(tune_record(study, task, cell), Path(sys.argv[2]) / task / cell / "tune.json")
PY
echo "$CMD" > "$OUT/command.txt"
read -r task cell seed <<<"$CHECK_RUN"
if [[ "$CHECK_PARAMS" != "$PARAMS" ]]; then  # the shortened run CI re-makes: made here once (not timed)
  # every seed its params file lists: check-reference --make records their spread beside the run
  targets=$(python -c "import sys; from pipeline_src.study.config import load_study; from pipeline_src.study.stages import output_path
s = load_study(sys.argv[1]); print(' '.join(output_path('evaluate', 'metrics', study=s.name, task=sys.argv[2], cell=sys.argv[3], seed=n) for n in s.seeds))" \
    "$CHECK_PARAMS" "$task" "$cell")
  # shellcheck disable=SC2086
  snakemake --cores "$CORES" --config params="$CHECK_PARAMS" --quiet rules -- $targets
fi
python -m pipeline_src check-reference --params "$CHECK_PARAMS" --task "$task" --cell "$cell" --seed "$seed" \
  --reference "$OUT" --make

python - "$OUT" "$NAME" "$CMD" "$CORES" "$LOGS/sittings.tsv" <<'PY'
import glob, json, os, platform, subprocess, sys
import pandas as pd
out, name, cmd, cores, sittings_path = sys.argv[1:]
results = pd.read_csv(f"reports/{name}/results.csv")
cost_cols = ["task", "cell", "seed", "steps", "train_tokens", "wall_s", "tokens_per_s", "peak_mem_mb",
             "device_name", "precision"]
results[[c for c in cost_cols if c in results]].to_csv(f"{out}/cost.csv", index=False, float_format="%.6g")
sittings = pd.read_csv(sittings_path, sep="\t")
stages = {}
for path in glob.glob(f"logs/{name}/bench/*/*.tsv"):
    frame = pd.read_csv(path, sep="\t")
    stages.setdefault(path.split("/")[-2], []).append(float(frame["s"].iloc[0]))
timing = {
    "command": cmd, "cores": int(cores), "sittings": sittings.to_dict("records"),
    "wall_s": round(float(sittings["wall_s"].sum()), 1),
    "train_wall_s_sum": round(float(results["wall_s"].sum()), 1),
    "stage_seconds": {s: {"jobs": len(v), "sum_s": round(sum(v), 1), "max_s": round(max(v), 1)}
                      for s, v in sorted(stages.items())},
}
json.dump(timing, open(f"{out}/timing.json", "w"), indent=1)
import torch
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True).stdout.strip())
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
with open(f"{out}/versions.txt", "w") as f:
    f.write(f"git commit: {commit}{' (with uncommitted changes)' if dirty else ''}\n")
    f.write(f"cpu: {cpu}, {os.cpu_count()} cores\ntorch: {torch.__version__}\n")
    f.write(f"python: {platform.python_version()} on {platform.platform()}\n\n{freeze}")
print(json.dumps({k: v for k, v in timing.items() if k != "stage_seconds"}, indent=1))
PY
echo "reference products in $OUT/ (commit them with its README)"
