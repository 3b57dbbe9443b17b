#!/usr/bin/env bash
# Rehearse a lent GPU session on this CPU machine, as close to the device as a CPU allows: the
# device image's Python 3.12 and torch 2.11 (with its numpy, pandas and pyarrow, none of them
# carried), the carried wheels installed by bench/device.sh, a copy of the tree without .git, and no
# latexmk on PATH. A GPU is lent rarely and for 30 minutes: run this after changing anything on the
# device path (train, evaluate, bench/, workflow/studies/gpu), so that the first call there works.
#
#   bash bench/rehearse_device.sh     # ~5.5 min on 2 cores; ~7 the first time (making the venv)
#
# It runs `device.sh d` under a short deadline (the part's skip logic and packing), the mirror study
# through `device.sh study` in calls of WAIT_S seconds until it finishes, then `from_device.sh` on
# every study tarball in a clone of HEAD (first ones refused as "still running", the last one's PDF
# built here). It uses the fixed paths device.sh uses on the device (/tmp/site, /tmp/gpu_session,
# /tmp/gpu_study), and REHEARSAL_DIR (default /tmp/rehearsal) for the tree, tarballs and clone.
# PYTHON312: a Python 3.12 to make the venv REHEARSAL_VENV (default /tmp/rehearsal-py312) from.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DIR=${REHEARSAL_DIR:-/tmp/rehearsal}
VENV=${REHEARSAL_VENV:-/tmp/rehearsal-py312}
WAIT_S=${WAIT_S:-100}
# a GPU session runs a commit (gpu_carry.sh records it), and so does this
if [[ -n $(git status --porcelain) ]]; then
  echo "error: commit first: the rehearsal, like a GPU session, runs HEAD (git status is not clean)"; exit 1
fi

if [[ ! -x $VENV/bin/python ]]; then
  PY312=${PYTHON312:-}
  if [[ -z $PY312 ]]; then  # the first that runs (a pyenv shim may exist without the version active)
    for py in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
      "$py" -c pass 2>/dev/null && { PY312=$py; break; }
    done
  fi
  [[ -n $PY312 ]] || { echo "error: no working python3.12 found (set PYTHON312)"; exit 1; }
  echo "making $VENV from $PY312: the device image's torch 2.11 and the packages it holds"
  "$PY312" -m venv "$VENV"
  # torch is capped by this machine's pip constraints; 2.11 is under the cap
  "$VENV/bin/pip" install -q torch==2.11.0 numpy pandas pyarrow sentencepiece sacrebleu matplotlib packaging pytest \
    2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch" || { rm -rf "$VENV"; echo "error: making $VENV failed"; exit 1; }
fi

# the carry, made for this commit (gpu_carry.sh writes the commit it was made at)
if [[ ! -f .whl/COMMIT || $(cat .whl/COMMIT) != $(git rev-parse HEAD) ]]; then
  bash bench/gpu_carry.sh
fi

# the tree as a device call sends it (no .git), and the carried folders
rm -rf "$DIR" && mkdir -p "$DIR/tree" "$DIR/out"
git ls-files -z | tar --null -cf - -T - | tar -xf - -C "$DIR/tree"
cp -r .whl .mirror "$DIR/tree/"
# PATH without latexmk: the device has no TeX, so the study stops before the PDF
mkdir -p "$DIR/bin"
for f in /usr/bin/*; do [[ $(basename "$f") == latexmk ]] || ln -s "$f" "$DIR/bin/"; done
DEVICE_PATH=$VENV/bin:$DIR/bin
rm -rf /tmp/site /tmp/gpu_session /tmp/gpu_study /tmp/pybin

on_device() {  # on_device NAME ARGS...: bash bench/device.sh ARGS with the device's PATH, OUT=$DIR/out/NAME
  local out=$DIR/out/$1; shift
  mkdir -p "$out"
  echo "+ device.sh $*   [$(date -u +%T)]"
  (cd "$DIR/tree" && env -i HOME="$HOME" PATH="$DEVICE_PATH" REQUIRE_CUDA=0 OUT="$out" \
     STUDY_PARAMS=workflow/studies/mirror/params.yaml WAIT_S="$WAIT_S" bash bench/device.sh "$@")
}
WAIT_S=45 on_device d d | tail -n 4
calls=0
until [[ -f /tmp/gpu_study/run.rc ]]; do
  calls=$((calls + 1))
  (( calls <= 8 )) || { echo "error: the mirror study did not finish in 8 calls"; exit 1; }
  log=$DIR/out/study$calls.log
  on_device "study$calls" study > "$log" 2>&1 || { tail -n 20 "$log"; echo "error: device.sh study failed"; exit 1; }
  grep -E "^(\+ device|starting|the study|study|packed|call)" "$log"
done

# back here, in a clone of HEAD (the checkout's results folders stay untouched)
git clone -q "$REPO" "$DIR/clone"
ln -s "$REPO/.venv" "$DIR/clone/.venv"
for i in $(seq 1 "$calls"); do
  echo "+ from_device.sh study$i/study.tar.gz"
  (cd "$DIR/clone" && bash bench/from_device.sh "$DIR/out/study$i/study.tar.gz") | tail -n 2 || true
done
pdf=$DIR/clone/reports/reference/h100/report.pdf
[[ -f $pdf ]] || { echo "error: from_device.sh built no report.pdf"; exit 1; }
echo "rehearsal passed: $calls study call(s); $pdf built here"
