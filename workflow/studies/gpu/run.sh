#!/usr/bin/env bash
# The reference GPU study in one command, from the repository root of a checkout with CUDA torch,
# on a machine without a job time limit (in short job slots, or on a node without network, run it
# in parts instead: `bash bundle/node.sh parts workflow/studies/gpu/params.yaml ARCHIVES`,
# docs/gpu-nodes.md):
#
#   bash workflow/studies/gpu/run.sh            # from scratch: download -> PDF, timed
#   bash workflow/studies/gpu/run.sh --resume   # keep data/gpu (what is done stays done; not a timing)
#
# Runs workflow/studies/gpu/params.yaml with Snakemake, GPU_JOBS (default 8) training/evaluation
# jobs sharing the GPU, then copies the products into reports/reference/h100/ (REFERENCE_OUT):
# report.pdf/.tex, results/summary/significance/claims/references CSVs, the cost table, the exact
# command, wall time and GPU-seconds, stage times, versions, and dvc.lock (hashes of every output,
# recorded by `dvc commit` after the timed run). Needs the offline mirror in ../shared/datasets
# (or PIPELINE_DATA_MIRROR) and a CUDA device. On a GPU node without internet, run it from a
# bundle: `bash bundle/node.sh study workflow/studies/gpu/params.yaml` (docs/gpu-nodes.md). Without latexmk it stops before the PDF (snakemake --omit-from report) and
# says how to build the PDF elsewhere from the products. STUDY_PARAMS and REQUIRE_CUDA=0 run this
# script on a CPU with a small study (e.g. workflow/studies/mirror/params.yaml).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PARAMS=${STUDY_PARAMS:-workflow/studies/gpu/params.yaml}
OUT=${REFERENCE_OUT:-reports/reference/h100}
K=${GPU_JOBS:-8}  # workflow/studies/gpu/parts.yaml: jobs_per_gpu
CORES=${NODE_CORES:-$(nproc)}  # not CORES: some nodes set it for other tools
RESUME=0
[[ "${1:-}" == "--resume" ]] && RESUME=1
[[ -d .venv/bin ]] && export PATH="$PWD/.venv/bin:$PATH"
export PIPELINE_QUIET=1 PYTHONUNBUFFERED=1
NAME=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['study'])" "$PARAMS")
# K training processes share 16 cores: keep each one's CPU thread pools small (their work is on the GPU).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} MKL_NUM_THREADS=${MKL_NUM_THREADS:-2}

[[ ${REQUIRE_CUDA:-1} == 0 ]] || python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} sees no CUDA device; the GPU study needs one (device: cuda)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY
mirror=${PIPELINE_DATA_MIRROR:-../shared/datasets}
for d in multi30k ptb; do
  [[ -d "$mirror/$d" ]] || { echo "error: $mirror/$d missing (set PIPELINE_DATA_MIRROR)"; exit 1; }
done
python -m pipeline_src validate --params "$PARAMS"

if [[ $RESUME == 0 ]]; then
  echo "removing this study's previous outputs: data/$NAME reports/$NAME logs/$NAME"
  rm -rf "data/$NAME" "reports/$NAME" "logs/$NAME"
fi
mkdir -p "$OUT" "logs/$NAME"
export PIPELINE_JOBS_PER_GPU=$K  # K slots on the one GPU (pipeline_src/runtime/gpu_slots.py)
# --keep-going: a GPU is rare; one failed run must not stop the others (the report then is not built)
SNAKEMAKE_ARGS=(--cores "$CORES" --resources gpu="$K" --keep-going --config params="$PARAMS")
PDF=1
if ! command -v latexmk >/dev/null; then
  PDF=0  # everything up to the report's inputs; the PDF is one stage, run where TeX is
  SNAKEMAKE_ARGS+=(--omit-from report)
  echo "no latexmk here: running up to the report's inputs (--omit-from report)"
fi
CMD="PIPELINE_JOBS_PER_GPU=$K snakemake ${SNAKEMAKE_ARGS[*]}"

# GPU utilisation every 2 s while the study runs (busy GPU-seconds = sum of utilisation x 2 s).
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 \
  > "logs/$NAME/gpu_util.csv" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null || true' EXIT
start_utc=$(date -u +%FT%TZ); t0=$(date +%s.%N)
echo "+ $CMD"
snakemake "${SNAKEMAKE_ARGS[@]}"
t1=$(date +%s.%N); end_utc=$(date -u +%FT%TZ)
kill $SMI 2>/dev/null || true

DVC_YAML=$(dirname "$PARAMS")/dvc.yaml
if command -v dvc >/dev/null && [[ -f $DVC_YAML ]]; then
  echo "recording output hashes in ${DVC_YAML%.yaml}.lock (dvc commit; not timed)"
  dvc commit --force "$DVC_YAML" >/dev/null 2>&1 \
    && cp "${DVC_YAML%.yaml}.lock" "$OUT/dvc.lock" || echo "warning: dvc commit failed; no dvc.lock"
else
  echo "no dvc here (or no $DVC_YAML): no dvc.lock"
fi

products="results.csv summary.csv significance.csv claims.csv references.csv"
((PDF)) && products="report.pdf report.tex $products"
for f in $products; do
  cp "reports/$NAME/$f" "$OUT/$f"
done
cp "reports/$NAME/tables/cost.tex" "$OUT/cost_table.tex"
cp "logs/$NAME/gpu_util.csv" "$OUT/gpu_util.csv"
echo "$CMD" > "$OUT/command.txt"

python - "$OUT" "$t0" "$t1" "$start_utc" "$end_utc" "$K" "$CORES" "$CMD" "$RESUME" "$NAME" <<'PY'
import csv, glob, json, os, platform, shutil, subprocess, sys
import pandas as pd
out, t0, t1, start, end, k, cores, cmd, resume, name = sys.argv[1:]
results = pd.read_csv(f"reports/{name}/results.csv")
cost_cols = ["task", "cell", "seed", "steps", "train_tokens", "wall_s", "tokens_per_s", "mfu", "peak_mem_mb",
             "device_name", "precision"]
results[[c for c in cost_cols if c in results]].to_csv(f"{out}/cost.csv", index=False, float_format="%.6g")
util = []
with open(f"logs/{name}/gpu_util.csv") as f:
    for row in csv.reader(f):
        try:
            util.append(float(row[1]))
        except (IndexError, ValueError):
            pass
stages = {}
for path in glob.glob(f"logs/{name}/bench/*/*.tsv"):
    frame = pd.read_csv(path, sep="\t")
    stages.setdefault(path.split("/")[-2], []).append(float(frame["s"].iloc[0]))
timing = {
    "command": cmd, "from_scratch": resume == "0", "start_utc": start, "end_utc": end,
    "wall_s": round(float(t1) - float(t0), 1), "gpu_jobs_sharing_the_gpu": int(k), "cores": int(cores),
    "gpu_busy_s": round(sum(u / 100 * 2.0 for u in util), 1),
    "gpu_mean_utilisation_pct": round(sum(util) / len(util), 1) if util else None,
    "train_wall_s_sum": round(float(results["wall_s"].sum()), 1),
    "stage_seconds": {s: {"jobs": len(v), "sum_s": round(sum(v), 1), "max_s": round(max(v), 1)}
                      for s, v in sorted(stages.items())},
}
json.dump(timing, open(f"{out}/timing.json", "w"), indent=1)
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else "none"
import torch
if os.path.isdir(".git"):
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
else:  # a copy without .git (a node's bundle): the commit workflow/node/bundle.sh recorded
    commit, dirty = os.environ.get("PIPELINE_GIT_COMMIT", "unknown (no .git)"), False
freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
with open(f"{out}/versions.txt", "w") as f:
    f.write(f"git commit: {commit}{' (with uncommitted changes)' if dirty else ''}\n")
    f.write(f"gpu: {smi}\ntorch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}\n")
    f.write(f"python: {platform.python_version()} on {platform.platform()}, {os.cpu_count()} CPUs\n\n{freeze}")
print(json.dumps({k: v for k, v in timing.items() if k != "stage_seconds"}, indent=1))
PY
if ((PDF)); then
  echo "reference products in $OUT/ (commit them with the README)"
else
  echo "reference products in $OUT/, without the PDF (no TeX here). Where TeX is, with these outputs in place:"
  echo "  python -m pipeline_src report --params $PARAMS && cp reports/$NAME/report.{pdf,tex} $OUT/"
  echo "  (workflow/node/unpack.sh does this for the results of bundle/node.sh study)"
fi
