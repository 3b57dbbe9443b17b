#!/usr/bin/env bash
# Run a study or the benchmarks on a compute node without internet, from a bundle made by
# `make bundle` on a connected machine (workflow/node/bundle.sh). On the node:
#
#   tar -xzf bundle.tar.gz
#   bash bundle/node.sh parts workflow/studies/gpu/params.yaml OUT [PART...]   # a study in parts -> OUT/*.tar.gz
#   bash bundle/node.sh study workflow/studies/gpu/params.yaml   # a study, download -> report
#   bash bundle/node.sh bench a                                   # GPU benchmarks, part a|b|c|d|all
#   bash bundle/node.sh run -- python -m pytest -q tests/test_model_gpu.py   # any command
#
# The first call installs the carried wheels offline (pip --no-index) into bundle/site, which goes
# first on PYTHONPATH, ahead of the node's own packages (torch and NODE_HAS stay the node's), and
# unpacks the repository into bundle/repo. Every job runs there with the dataset mirror
# bundle/datasets, writes what it makes under bundle/results/<job>/ and packs that directory into
# bundle/results-<job>.tar.gz: bring that file back and unpack it into the repository with
#   bash workflow/node/unpack.sh results-<job>.tar.gz
# A study keeps its reports, logs, evaluation outputs and every run's records (not its
# checkpoints); a study directory with a run.sh (the GPU and CPU reference studies) is run through
# it, which also times it and gathers its products. Without TeX on the node the study stops before
# the PDF, which unpack.sh builds from the same products. PYTHON (default python3) is the node's
# interpreter with torch; NODE_CORES (default all the node's cores) is Snakemake's --cores. It is not
# read from CORES, which some nodes set for other tools: 2 there once let only 2 of a part's 8
# GPU job slots run at once.
#
# `parts` runs a study in the parts of its parts.yaml (pipeline_src/node/parts.py; all of them in turn,
# or the ones named), for job slots of a few minutes: each part trains and evaluates its runs with
# jobs_per_gpu jobs sharing the GPU, stops them at its limit_s less 30 s (15 s for them to save
# their state, then they are killed; ~10 s to pack), and writes one
# archive of what finished into OUT (a folder the caller names, created if needed; relative paths
# are the caller's) under a temporary name, renamed when whole. A part cut short (SIGTERM/SIGINT,
# as a scheduler sends at the slot's end) stops its jobs and packs what finished; one killed
# outright leaves no archive, and the archives of the parts before it are untouched. Run the
# missing parts again later (on the same node a part continues its stopped runs). Back on any
# machine: python -m pipeline_src parts build OUT --params PARAMS_FILE
set -uo pipefail
BUNDLE=$(cd "$(dirname "$0")" && pwd)
JOB=${1:-}
case $JOB in
  study) [[ -n ${2:-} ]] || { echo "usage: bash node.sh study PARAMS_FILE" >&2; exit 2; } ;;
  parts) [[ -n ${2:-} && -n ${3:-} ]] || { echo "usage: bash node.sh parts PARAMS_FILE OUT_DIR [PART...]" >&2; exit 2; }
         mkdir -p "$3" && OUT_DIR=$(cd "$3" && pwd) || { echo "error: cannot make the folder $3" >&2; exit 2; } ;;
  bench) [[ ${2:-} =~ ^(a|b|c|d|all)$ ]] || { echo "usage: bash node.sh bench a|b|c|d|all" >&2; exit 2; } ;;
  run) [[ ${2:-} == -- && -n ${3:-} ]] || { echo "usage: bash node.sh run -- COMMAND..." >&2; exit 2; } ;;
  *) echo "usage: bash node.sh parts PARAMS_FILE OUT_DIR [PART...] | study PARAMS_FILE | bench a|b|c|d|all | run -- COMMAND...   (see its header)" >&2
     exit 2 ;;
esac
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "error: $PY not found (set PYTHON to the node's interpreter with torch)"; exit 1; }

# install once: the carried wheels, offline
if [[ ! -f $BUNDLE/site/.installed ]]; then
  echo "installing $(ls "$BUNDLE/wheels" | wc -l) carried wheels into $BUNDLE/site (offline)"
  rm -rf "$BUNDLE/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$BUNDLE/site" \
    "$BUNDLE"/wheels/*.whl || { echo "error: installing the carried wheels failed"; exit 1; }
  touch "$BUNDLE/site/.installed"
fi
if [[ ! -d $BUNDLE/repo ]]; then
  mkdir -p "$BUNDLE/repo.tmp" && tar -xzf "$BUNDLE/repo.tar.gz" -C "$BUNDLE/repo.tmp" && mv "$BUNDLE/repo.tmp" "$BUNDLE/repo"
fi
export PYTHONPATH=$BUNDLE/site${PYTHONPATH:+:$PYTHONPATH} PATH=$BUNDLE/site/bin:$PATH
export PIPELINE_DATA_MIRROR=$BUNDLE/datasets PYTHONUNBUFFERED=1 PIPELINE_QUIET=${PIPELINE_QUIET:-1}
export PIPELINE_GIT_COMMIT=$("$PY" -c "import json, sys; b = json.load(open(sys.argv[1]));
print(b['git_commit'] + (' (with uncommitted changes)' if b['uncommitted_changes'] else ''))" "$BUNDLE/bundle.json")
# the stages, Snakemake's jobs and the benchmarks call `python`: make it the node's interpreter.
# A wrapper, not a symlink: a virtual environment's python is found by the path it is called by.
if [[ $(command -v python || true) != $(command -v "$PY") ]]; then
  mkdir -p "$BUNDLE/bin" && printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$PY")" >"$BUNDLE/bin/python"
  chmod +x "$BUNDLE/bin/python" && export PATH=$BUNDLE/bin:$PATH
fi
# The carried packages' requirements on the node's own (a datasets that wants a newer pyarrow than
# the node has imports fine and fails inside a stage): a warning line each. Then every package a
# job imports, before any time is spent: one line naming what is missing.
python - "$BUNDLE/site" <<'PY' || exit 1
import importlib, sys
from importlib.metadata import PackageNotFoundError, distributions, version
from packaging.requirements import Requirement
for dist in sorted(distributions(path=[sys.argv[1]]), key=lambda d: d.metadata["Name"].lower()):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's or another platform's
        try:
            have = version(req.name)
        except PackageNotFoundError:
            print(f"!! carried wheels: {dist.metadata['Name']} {dist.version} needs {req}: not installed on this node")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            print(f"!! carried wheels: {dist.metadata['Name']} {dist.version} needs {req}: this node has {req.name} {have}")
found = []
for name in ("torch", "numpy", "pandas", "pyarrow", "datasets", "sentencepiece", "sacrebleu", "rouge_score",
             "jsonschema", "matplotlib", "snakemake"):
    try:
        importlib.import_module(name)
        found.append(f"{name} {version(name.replace('_', '-'))}")
    except Exception as e:
        sys.exit(f"error: import {name} failed on this node: {type(e).__name__}: {e}")
print("packages:", ", ".join(found))
PY

cd "$BUNDLE/repo"
if [[ $JOB == parts ]]; then
  params=$2
  shift 3
  layout=$(python -m pipeline_src parts layout --params "$params") || exit 1
  eval "$layout"  # jobs_per_gpu limit_s device parts
  study=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['study'])" "$params")
  (( $# )) && parts="$*"
  if [[ $device == cuda && ${REQUIRE_CUDA:-1} == 1 ]]; then
    python -c "import sys, torch; torch.cuda.is_available() or sys.exit('error: this study needs a CUDA device and torch sees none')" || exit 1
  fi
  export PIPELINE_JOBS_PER_GPU=$jobs_per_gpu  # the GPU's job slots (pipeline_src/runtime/gpu_slots.py)
  # K processes share the node's cores: small CPU thread pools each (their work is on the GPU)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} MKL_NUM_THREADS=${MKL_NUM_THREADS:-2}
  python -m pipeline_src parts predict --params "$params" || exit 1
  cores=${NODE_CORES:-$(nproc)}
  (( cores < jobs_per_gpu )) && echo "!! $cores cores for $jobs_per_gpu GPU job slots: at most $cores jobs run at once" \
    "(NODE_CORES sets Snakemake's --cores; the default is all the node's cores)"
  stop=0 pid=""
  trap 'stop=1; [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null' TERM INT
  overall=0
  for part in $parts; do
    ((stop)) && break
    started=$(date -u +%FT%TZ) t0=$(date +%s)
    mkdir -p "logs/$study"
    log=logs/$study/node_$part.log util=logs/$study/gpu_util_$part.csv
    : >"$log"; rm -f "$util"
    echo "== part $part ($started): $jobs_per_gpu GPU job slots, $cores cores; stops its jobs after" \
         "$((limit_s - 30)) s, packs into $OUT_DIR" | tee -a "$log"
    smi=""
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 >"$util" 2>/dev/null &
      smi=$!
    fi
    mapfile -t targets < <(python -m pipeline_src parts targets --params "$params" --part "$part")
    left=$(( limit_s - 30 - ($(date +%s) - t0) ))
    (( left < 10 )) && left=10
    # --keep-going: one failed run must not stop the others; the part's archive lists what is missing
    timeout -s TERM -k 15 "$left" snakemake --cores "$cores" --resources gpu="$jobs_per_gpu" --keep-going \
      --config params="$params" -- "${targets[@]}" > >(tee -a "$log") 2>&1 &
    pid=$!
    wait "$pid"; status=$?
    while kill -0 "$pid" 2>/dev/null; do wait "$pid"; status=$?; done  # a trapped signal interrupts wait
    pid=""
    [[ -n $smi ]] && kill "$smi" 2>/dev/null
    (( status == 124 )) && echo "part $part: stopped at its limit ($((limit_s - 30)) s); packing what finished" | tee -a "$log"
    ((stop)) && echo "part $part: stopped by a signal; packing what finished" | tee -a "$log"
    python -m pipeline_src parts pack --params "$params" --part "$part" --out "$OUT_DIR" --started "$started" \
      --status "$status" --log "$log" --gpu-util "$util" --cores "$cores" || overall=1
    (( status == 0 )) || overall=1
  done
  ((stop)) && exit 143
  echo "archives in $OUT_DIR: $(cd "$OUT_DIR" && ls -- *.tar.gz 2>/dev/null | tr '\n' ' ')"
  echo "bring them back and run: python -m pipeline_src parts build ARCHIVES_DIR --params $params"
  exit "$overall"
fi
name=$JOB
[[ $JOB == study ]] && name=study-$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['study'])" "$2")
[[ $JOB == bench ]] && name=bench-$2
RESULTS=$BUNDLE/results/$name
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
echo "+ $* (commit $PIPELINE_GIT_COMMIT) -> $RESULTS" | tee "$RESULTS/node.log"
{ "$PY" -c "import platform, torch; print('node:', platform.node(), platform.platform(), 'torch', torch.__version__,
'CUDA', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"; } \
  | tee -a "$RESULTS/node.log"
status=0
case $JOB in
  study)
    params=$2
    study=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['study'])" "$params")
    if [[ -f $(dirname "$params")/run.sh ]]; then
      REQUIRE_CUDA=${REQUIRE_CUDA:-1} bash "$(dirname "$params")/run.sh" 2>&1 | tee -a "$RESULTS/node.log"
      status=${PIPESTATUS[0]}
    else
      omit=()
      command -v latexmk >/dev/null || omit=(--omit-from report)
      snakemake --cores "${NODE_CORES:-$(nproc)}" --config params="$params" "${omit[@]}" 2>&1 | tee -a "$RESULTS/node.log"
      status=${PIPESTATUS[0]}
    fi
    echo "$params" > "$RESULTS/params.txt"
    # what the study made, without checkpoints: reports, logs, evaluation outputs, every run's records
    for p in "reports/$study" "logs/$study" "data/$study/eval" reports/reference; do
      [[ -e $p ]] && mkdir -p "$RESULTS/$(dirname "$p")" && cp -r "$p" "$RESULTS/$p"
    done
    for f in data/"$study"/runs/*/*/seed*/{cost.json,train_metrics.json,train_info.json,train_log.tsv}; do
      [[ -f $f ]] && mkdir -p "$RESULTS/$(dirname "$f")" && cp "$f" "$RESULTS/$f"
    done
    ;;
  bench)
    parts=$2
    [[ $parts == all ]] && parts="a b c d"
    for part in $parts; do
      DEST=$RESULTS bash bench/gpu_benchmarks.sh "$part" || status=$?
    done
    ;;
  run)
    shift 2
    "$@" 2>&1 | tee -a "$RESULTS/node.log"
    status=${PIPESTATUS[0]}
    ;;
esac
echo "$status" > "$RESULTS/exit_status"
tar -czf "$BUNDLE/results-$name.tar.gz" -C "$BUNDLE/results" "$name"
echo "results: $BUNDLE/results-$name.tar.gz (exit status $status); bring it back and run" \
     "bash workflow/node/unpack.sh results-$name.tar.gz in the repository"
exit "$status"
