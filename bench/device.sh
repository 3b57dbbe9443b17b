#!/usr/bin/env bash
# One call of the lent GPU machine = one command of this script, from the repository root there:
#
#   bash bench/device.sh a|b|c|d # a part of bench/gpu_session.sh (issue 11's GPU figures), <= 9.5 min
#                                # (WAIT_S=S for less, budget_left_s - 60; bench/results/h100/README.md)
#   bash bench/device.sh study   # the reference GPU study (workflow/studies/gpu/run.sh, issue 12):
#                                # started in the background, then waited for up to WAIT_S (540) s;
#                                # call it again at once, while the machine is warm, to wait on
#
# with carry [".whl", ".mirror"], both made here first by `bash bench/gpu_carry.sh`. Why a script:
# that machine starts bare (no datasets, rouge-score, jsonschema, Snakemake, TeX, mirror, or .git),
# kills a command at 600 s, keeps a machine warm only 30 s between calls, and brings back at most
# 8 files from $OUT. So this installs the carried wheels (once per machine), runs the job under a
# deadline, and packs everything it made into ONE tarball, $OUT/<job>.tar.gz, also when a benchmark
# failed or the study is still running. Unpack it here with `bash bench/from_device.sh FILE...`.
#
# The study runs in a copy of the tree outside the synced checkout (/tmp/gpu_study), in its own
# process session, so it outlives the call; there is no TeX on that machine, so it stops before the
# PDF, which from_device.sh builds here from the returned products (the same report stage).
# A CPU rehearsal of the whole path: REQUIRE_CUDA=0 OUT=/tmp/out bash bench/device.sh a, and
# REQUIRE_CUDA=0 STUDY_PARAMS=workflow/studies/mirror/params.yaml OUT=/tmp/out bash bench/device.sh study
set -uo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-}
if [[ ! $JOB =~ ^(a|b|c|d|study)$ ]]; then
  echo "usage: bash bench/device.sh a|b|c|d|study   (on the lent GPU machine; see its header)" >&2
  exit 2
fi
OUT=${OUT:?set OUT (the device tool sets it)}
WAIT_S=${WAIT_S:-540}
START=$(date +%s)

# The carried packages come first on the path: the image's own versions of their dependencies
# (huggingface-hub, fsspec, ...) would not match what this checkout was tested with.
if [[ -d .whl && ! -f /tmp/site/.installed ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing the carried wheels (.whl) failed"; exit 1; }
  touch /tmp/site/.installed
fi
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
[[ -d .mirror ]] && export PIPELINE_DATA_MIRROR=$PWD/.mirror
# the stages and benchmarks call `python`: make it the interpreter that holds torch (the image's python3)
if ! python -c "import torch" 2>/dev/null; then
  mkdir -p /tmp/pybin && ln -sf "$(command -v python3)" /tmp/pybin/python && export PATH=/tmp/pybin:$PATH
fi
# the carried packages' requirements on the image's own (numpy, pandas, pyarrow: datasets wants
# pyarrow >= 24), then every package the jobs import, before any time is spent; all to the call's log
[[ -d /tmp/site ]] && python bench/check_carry.py /tmp/site
python - <<'PY' || exit 1
import importlib, sys
from importlib.metadata import version
found = []
for name in ("torch", "numpy", "pandas", "pyarrow", "datasets", "sentencepiece", "sacrebleu", "rouge_score",
             "jsonschema", "matplotlib", "snakemake"):
    try:
        importlib.import_module(name)
        found.append(f"{name} {version(name.replace('_', '-'))}")
    except Exception as e:  # one line naming the package, then stop
        sys.exit(f"error: import {name} failed on this machine: {type(e).__name__}: {e}")
print("packages:", ", ".join(found))
PY
# the checkout's commit, recorded here by gpu_carry.sh (the device copy has no .git)
[[ -f .whl/COMMIT ]] && export PIPELINE_GIT_COMMIT=$(cat .whl/COMMIT)

pack() {  # pack DIR NAME PATH... : one tarball of those that exist (callers name no checkpoints)
  local dir=$1 name=$2; shift 2
  local have=()
  for p in "$@"; do [[ -e "$dir/$p" ]] && have+=("$p"); done
  sleep 1  # let tee flush the last lines of the log
  tar -czf "$OUT/$name.tar.gz" -C "$dir" "${have[@]}"
  local shown="${have[*]:0:8}"; (( ${#have[@]} > 8 )) && shown+=" ... (${#have[@]} paths)"
  echo "packed $OUT/$name.tar.gz ($(du -h "$OUT/$name.tar.gz" | cut -f1)): $shown"
}

case "$JOB" in
  a|b|c|d)
    work=/tmp/gpu_session/$JOB
    rm -rf "$work" && mkdir -p "$work"
    DEST=$work PART_BUDGET_S=$(( WAIT_S - 20 )) bash bench/gpu_session.sh "$JOB"
    pack "$work" "bench_$JOB" .
    ;;
  study)
    study=/tmp/gpu_study
    if [[ ! -d $study ]]; then
      mkdir -p $study
      tar -cf - --exclude=./.whl --exclude=./.mirror --exclude=./data --exclude=./logs --exclude=./.snakemake . \
        | tar -xf - -C $study
      echo "starting the study in $study (log: run.log) at $(date -u +%T)"
      (cd $study && setsid bash -c 'bash workflow/studies/gpu/run.sh > run.log 2>&1; echo $? > run.rc' \
        < /dev/null > /dev/null 2>&1 &)
    else
      echo "the study was started earlier in $study; waiting on it"
    fi
    while [[ ! -f $study/run.rc ]] && (( $(date +%s) - START < WAIT_S )); do
      sleep 10
    done
    if [[ -f $study/run.rc ]]; then
      echo "study finished, exit status $(cat $study/run.rc)"
    else
      echo "study still running after this call's ${WAIT_S}s:"
      echo "call 'bash bench/device.sh study' again NOW (the machine stays warm 30 s)"
    fi
    tail -n 25 $study/run.log
    # each finished run's records (not its checkpoints): bench/study_throughput.py reads them, also
    # when the study is cut off before its report
    pack $study study run.log run.rc reports logs $(cd $study && ls -d data/*/eval 2>/dev/null) \
      $(cd $study && ls data/*/runs/*/*/seed*/{cost.json,train_metrics.json,train_info.json,train_log.tsv} 2>/dev/null)
    ;;
esac
