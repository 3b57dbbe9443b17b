#!/usr/bin/env bash
# A colleague reuses a finished study without recomputing it: the study run by Snakemake on the
# cluster (check_slurm.sh leaves it in $CLUSTER_WORK/repo) is adopted by DVC, pushed to a remote
# and committed; a fresh clone then pulls it, and
#   - every output is there and `dvc status` is clean,
#   - `dvc repro` runs nothing,
#   - rebuilding the report's numbers from the pulled results gives the same files.
# The remote is a scratch directory here (`dvc remote modify --local`, so .dvc/config keeps the
# project's url); S3 or SSH remotes work the same way (docs/dvc.md, "Sharing a study").
set -euo pipefail
WORK=${CLUSTER_WORK:-/tmp/pipeline-cluster-check}
PARAMS=workflow/studies/tiny/params.yaml
DVC_YAML=workflow/studies/tiny/dvc.yaml
REMOTE="$WORK/dvc-remote"
export PIPELINE_QUIET=1
fail() { echo "FAIL: $*" >&2; exit 1; }
say() { echo "check_dvc_remote: $*"; }
# Any other command that fails names itself and its line (set -e alone would end the check silently).
trap 'echo "FAIL: $0 line $LINENO: \`$BASH_COMMAND\` exited $?" >&2' ERR
dvc_logged() {  # dvc_logged ARGS...: runs `dvc ARGS`, quietly; on failure prints what DVC said and fails
  local log rc=0
  log=$(mktemp)
  dvc "$@" >"$log" 2>&1 || rc=$?
  if ((rc)); then tail -40 "$log" >&2; rm -f "$log"; fail "dvc $* exited $rc"; fi
  rm -f "$log"
}
test -s "$WORK/repo/reports/tiny/report.pdf" || fail "no finished study in $WORK/repo (run check_slurm.sh first)"
# the project's remote (.dvc/config), named on push and pull as docs/dvc.md shows
remote=$(cd "$WORK/repo" && dvc remote list | awk 'NR == 1 {print $1}')
[[ -n $remote ]] || fail "no DVC remote in .dvc/config"

say "on the cluster: adopt the Snakemake-built study into DVC, push it, commit dvc.lock"
cd "$WORK/repo"
export PYTHONPATH=$PWD
rm -rf "$REMOTE"
python -m pipeline_src dvc-yaml --params "$PARAMS" >/dev/null
dvc_logged commit --force "$DVC_YAML"   # the same commands made these outputs, so DVC takes them as they are
dvc remote modify --local "$remote" url "$REMOTE"
dvc_logged push -r "$remote" "$DVC_YAML"
git add "$DVC_YAML" "${DVC_YAML%.yaml}.lock" reports/tiny   # (reports/tiny: what DVC shows, kept in git)
git -c user.name=ci -c user.email=ci@localhost commit -qm "tiny study: dvc.lock, metrics and plots"
n_files=$(find "$REMOTE" -type f | wc -l)
echo "  pushed to the '$remote' remote: $n_files objects, $(du -sh "$REMOTE" | cut -f1)"

say "on a colleague's machine: fresh clone, dvc pull"
rm -rf "$WORK/clone"
git clone -q "$WORK/repo" "$WORK/clone"
cd "$WORK/clone"
export PYTHONPATH=$PWD
[ ! -e data ] || fail "the clone has data/ before dvc pull"
dvc remote modify --local "$remote" url "$REMOTE"
# A pull that fails is shown whole and tried once more, so that a passing check after a failed first
# pull says so instead of hiding it.
if ! dvc pull -r "$remote" "$DVC_YAML" >"$WORK/pull.log" 2>&1; then
  echo "  the first dvc pull failed; its output:"; tail -40 "$WORK/pull.log" | sed 's/^/    /'
  dvc_logged pull -r "$remote" "$DVC_YAML"
  echo "  the second dvc pull succeeded"
fi
lock_outs=$(python - "${DVC_YAML%.yaml}.lock" <<'PY'
import sys, yaml
lock = yaml.safe_load(open(sys.argv[1]))["stages"]
print("\n".join(sorted({o["path"] for s in lock.values() for o in s.get("outs", [])})))
PY
)
n_outs=0
while read -r out; do
  [ -e "$out" ] || fail "$out missing after dvc pull"
  n_outs=$((n_outs + 1))
done <<<"$lock_outs"
status=$(dvc status "$DVC_YAML" 2>&1) || { rc=$?; echo "$status"; fail "dvc status exited $rc"; }
grep -q "Data and pipelines are up to date" <<<"$status" || { echo "$status"; fail "dvc status is not clean in the clone"; }
out=$(dvc repro "$DVC_YAML" 2>&1) || { rc=$?; echo "$out" | tail -40; fail "dvc repro exited $rc in the clone"; }
if grep -q "Running stage" <<<"$out"; then grep "Running stage" <<<"$out"; fail "dvc repro reran stages in the clone"; fi
echo "  $n_outs outputs pulled; dvc status clean; dvc repro runs nothing"

say "rebuilding the report's numbers from the pulled results gives the same files"
for stage in aggregate tables; do dvc_logged repro --force --single-item "$DVC_YAML:$stage"; done
n=0
for f in reports/tiny/results.csv reports/tiny/summary.csv reports/tiny/significance.csv reports/tiny/tables/*; do
  cmp "$f" "$WORK/repo/$f" || fail "$f differs from the cluster's"
  n=$((n + 1))
done
echo "  $n report files identical"
say "passed"
