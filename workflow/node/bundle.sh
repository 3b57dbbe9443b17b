#!/usr/bin/env bash
# Pack what a compute node without internet needs to run a study or the benchmarks, on a machine
# that has it (from the repository root, after `make install`):
#
#   make bundle                    # = bash workflow/node/bundle.sh -> bundle/ and bundle.tar.gz
#
# bundle/ holds
#   wheels/       the project's runtime packages as wheels for the node's Python and platform, at
#                 the versions installed in this checkout's .venv (the dependency closure of
#                 NEEDS, one pinned version each), minus what the node already has (NODE_HAS, torch
#                 always: a GPU node brings its own CUDA build). A package with no wheel on PyPI is
#                 built here (pure Python).
#   datasets/     a copy of the offline dataset mirror (PIPELINE_DATA_MIRROR or ../shared/datasets): all
#                 of it, or with BUNDLE_PARAMS=<a study's params file> only the folders that study reads
#   repo.tar.gz   the repository at HEAD (uncommitted changes to tracked files included and flagged)
#   node.sh       what runs there (workflow/node/node.sh); bundle.json: commit, date, Python, packages
#
# Settings: BUNDLE_PARAMS (default: none, the whole mirror), NODE_PYTHON (default 3.12),
# NODE_PLATFORM (x86_64 or aarch64; default this machine's),
# NODE_HAS (default "torch numpy pandas pyarrow": what the node's Python already imports; they are
# then not carried), NEEDS (what the stages and Snakemake import), BUNDLE (default bundle).
# On the node: tar -xzf bundle.tar.gz && bash bundle/node.sh (its header says what it runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MIRROR=${PIPELINE_DATA_MIRROR:-../shared/datasets}
OUT=${BUNDLE:-bundle}
NODE_PYTHON=${NODE_PYTHON:-3.12}
NODE_PLATFORM=${NODE_PLATFORM:-$(uname -m)}
NODE_HAS=${NODE_HAS-"torch numpy pandas pyarrow"}
NEEDS=${NEEDS-"datasets rouge-score jsonschema snakemake sentencepiece sacrebleu matplotlib pyyaml tqdm tensorboard"}
[[ -x $PY ]] || { echo "error: $PY not found: run make install first (or set PYTHON)"; exit 1; }
[[ -d $MIRROR ]] || { echo "error: dataset mirror $MIRROR not found (set PIPELINE_DATA_MIRROR)"; exit 1; }
case $NODE_PLATFORM in
  x86_64|aarch64) ;;
  *) echo "error: NODE_PLATFORM=$NODE_PLATFORM: x86_64 or aarch64"; exit 1 ;;
esac

rm -rf "$OUT" "$OUT.tar.gz" && mkdir -p "$OUT/wheels"
# The dependency closure of NEEDS as installed in the .venv, pinned (environment markers applied).
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
        sys.exit(f"error: {name} is not installed in this environment (make install)")
    seen[norm(name)] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
print(" ".join(f"{k}=={v}" for k, v in sorted(seen.items())))
PY
)
platforms=""
for glibc in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 \
             manylinux2014 manylinux1; do
  platforms="$platforms --platform ${glibc}_$NODE_PLATFORM"
done
skip=" torch $(echo "$NODE_HAS" | tr 'A-Z_.' 'a-z--') "
carried="" built=""
for spec in $specs; do
  name=${spec%%==*}
  [[ $skip == *" $name "* ]] && continue
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$NODE_PYTHON" --implementation cp \
        $platforms -d "$OUT/wheels" "$spec" >/dev/null 2>&1; then
    # no wheel on PyPI for that Python and platform: build one here (works for pure-Python packages)
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/wheels" "$spec" 2>&1 >/dev/null \
      | grep -v "WARNING: Location" >&2 || true
    ls "$OUT/wheels" | grep -qi "^${name//-/_}-" || { echo "error: no wheel for $spec (Python $NODE_PYTHON, $NODE_PLATFORM)"; exit 1; }
    built="$built $name"
  fi
  carried="$carried $spec"
done
if [[ -n ${BUNDLE_PARAMS:-} ]]; then  # only what the study reads: a node's transfers are often limited
  used=$("$PY" -c "import sys; from pipeline_src.study.config import load_study; from pipeline_src.data.download import mirror_datasets
print(' '.join(mirror_datasets(load_study(sys.argv[1]))))" "$BUNDLE_PARAMS") || exit 1
  mkdir -p "$OUT/datasets"
  for f in "$MIRROR"/*; do [[ -f $f ]] && cp "$f" "$OUT/datasets/"; done  # the mirror's README and the like
  for name in $used; do
    [[ -d $MIRROR/$name ]] || { echo "error: $BUNDLE_PARAMS reads dataset $name, which $MIRROR lacks"; exit 1; }
    cp -r "$MIRROR/$name" "$OUT/datasets/$name"
  done
else
  cp -r "$MIRROR" "$OUT/datasets"
fi
# the node's copy of the tree has no .git: the commit travels in bundle.json
commit=$(git rev-parse HEAD)
dirty=false
git diff --quiet HEAD -- . || dirty=true
tree=$(git stash create 2>/dev/null || true)
git archive --format=tar.gz -o "$OUT/repo.tar.gz" "${tree:-HEAD}"
cp workflow/node/node.sh "$OUT/node.sh"
"$PY" - "$OUT/bundle.json" "$commit" "$dirty" "$NODE_PYTHON" "$NODE_PLATFORM" "$NODE_HAS" "$carried" "$built" <<'PY'
import datetime, json, sys
out, commit, dirty, python, platform, has, carried, built = sys.argv[1:]
json.dump({"git_commit": commit, "uncommitted_changes": dirty == "true",
           "made_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "node_python": python, "node_platform": platform, "node_has": has.split(),
           "carried": carried.split(), "built_here": built.split()}, open(out, "w"), indent=1)
PY
tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"  # unpacks as bundle/ wherever OUT was
echo "bundle: $OUT/ ($(du -sh "$OUT" | cut -f1)) and $OUT.tar.gz: $(ls "$OUT/wheels" | wc -l) wheels for Python" \
     "$NODE_PYTHON on $NODE_PLATFORM (built here:${built:- none}), datasets/, repo.tar.gz of $commit$($dirty && echo ' + uncommitted changes')"
echo "on the node: tar -xzf $OUT.tar.gz && bash $OUT/node.sh   (its header lists the jobs)"
