#!/usr/bin/env bash
# Prepare what a lent GPU machine lacks, so that bench/gpu_session.sh and the GPU study
# (workflow/studies/gpu/run.sh) run there in one call each. That machine starts bare: Python 3.12
# with torch + CUDA, numpy, pandas, pyarrow, sentencepiece, sacrebleu, matplotlib, but not
# datasets, rouge-score, jsonschema or Snakemake, and no network. Run here, from the repository root:
#
#   bash bench/gpu_carry.sh
#
# It writes (both ignored by git through .git/info/exclude; ~45 MB, under the 64 MiB a call carries):
#   .whl/     wheels for CPython 3.12 / manylinux x86-64 of the runtime dependencies that image
#             lacks, at the versions of this checkout's .venv (one version each, no resolver there);
#             numpy, pandas and pyarrow are the image's own. Two have no wheel on PyPI
#             (rouge-score, connection-pool): they are built here (pure Python).
#   .mirror/  a copy of the offline dataset mirror (../shared/datasets, which does not travel).
#
# and .whl/COMMIT, this checkout's commit (the device copy has no .git), then prints the device
# commands. Run it again after a commit, just before the device calls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MIRROR=${PIPELINE_DATA_MIRROR:-../shared/datasets}
# Top-level needs: the pipeline's imports and drivers that the device image does not hold
# (CARRY_NEEDS overrides them; tests/test_device_scripts.py sets none, to check the rest offline).
NEEDS=${CARRY_NEEDS-"datasets rouge-score jsonschema snakemake snakemake-executor-plugin-slurm"}
IMAGE_HAS="numpy pandas pyarrow"

# (git's own path for it: a checkout's .git may lack info/, and a worktree keeps it elsewhere)
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for p in /.whl/ /.mirror/; do
  grep -qxF "$p" "$EXCLUDE" 2>/dev/null || echo "$p" >> "$EXCLUDE"
done
rm -rf .whl && mkdir -p .whl

# The dependency closure of NEEDS as installed in this .venv, pinned (environment markers applied).
specs=$("$PY" - $NEEDS <<'PY'
import re, sys
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

seen, todo = {}, list(sys.argv[1:])
while todo:
    name = todo.pop()
    if norm(name) in seen:
        continue
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        continue
    seen[norm(name)] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
print(" ".join(f"{k}=={v}" for k, v in sorted(seen.items())))
PY
)
platforms=""
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux2014 manylinux1; do
  platforms="$platforms --platform ${p}_x86_64"
done
built=""
for spec in $specs; do
  name=${spec%%==*}
  [[ " $IMAGE_HAS " == *" $name "* ]] && continue
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms -d .whl "$spec" >/dev/null 2>&1; then
    # no wheel on PyPI: build it (pure Python); pip's notes about unused local indexes dropped
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$spec" 2>&1 >/dev/null | grep -v "WARNING: Location" >&2 || true
    ls .whl | grep -qi "^${name//-/_}-" || { echo "error: no wheel for $spec" >&2; exit 1; }
    built="$built $name"
  fi
done
rm -rf .mirror && cp -r "$MIRROR" .mirror
# the device copy of the tree has no .git: the commit its products were made from travels here
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . || echo ' (with uncommitted changes)')" > .whl/COMMIT
echo "wheels: $(ls .whl | wc -l) in .whl ($(du -sh .whl | cut -f1)); built here:$built"
echo "mirror: .mirror ($(du -sh .mirror | cut -f1))"
cat <<'EOF'
then, one device call each (run tool, carry [".whl", ".mirror"]; bench/device.sh installs the wheels):
  bash bench/device.sh a        (b, c: the other parts of bench/gpu_session.sh)
  bash bench/device.sh study    (again at once while it says "still running")
and here: bash bench/from_device.sh /work/.device/.../*.tar.gz
EOF
