#!/usr/bin/env bash
# Here, after the device calls of bench/device.sh: unpack what came back and put it where the
# repository keeps it. From the repository root:
#
#   bash bench/from_device.sh /work/.device/<call>/bench_a.tar.gz ... study.tar.gz
#
#   bench_<part>.tar.gz -> bench/results/h100/ (each benchmark's .md/.json and the part's console log)
#   study.tar.gz        -> bench/results/h100/study_<study>_throughput.md/.json (bench/study_throughput.py:
#                          the finished runs' tok/s and MFU, alone and sharing the GPU; also for a
#                          study still running or failed, which is then refused for the rest), and
#                          reports/reference/h100/ (REFERENCE_DIR), plus the study's reports/<study>,
#                          data/<study>/eval and logs/<study> (ignored by git), then builds the PDF
#                          here with the same report stage (the device has no TeX) and copies
#                          report.pdf/.tex beside the other products.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -d .venv/bin ]] && export PATH="$PWD/.venv/bin:$PATH"
RESULTS=${RESULTS_DIR:-bench/results/h100}
REFERENCE=${REFERENCE_DIR:-reports/reference/h100}
(( $# )) || { echo "usage: bash bench/from_device.sh FILE.tar.gz..." >&2; exit 2; }

for tarball in "$@"; do
  [[ -f $tarball ]] || { echo "error: $tarball not found"; exit 1; }
  case "$(basename "$tarball")" in
    bench_?.tar.gz)
      mkdir -p "$RESULTS"
      tar -xzf "$tarball" -C "$RESULTS"
      echo "$tarball -> $RESULTS/: $(tar -tzf "$tarball" | grep -v '/$' | sed 's|^\./||' | tr '\n' ' ')"
      grep -h "^!! " "$RESULTS"/session_*.log 2>/dev/null || true
      ;;
    study.tar.gz)
      tmp=$(mktemp -d)
      trap 'rm -rf "$tmp"' EXIT
      tar -xzf "$tarball" -C "$tmp"
      state=finished
      [[ -f $tmp/run.rc ]] || state=running
      [[ $state == running || $(cat "$tmp/run.rc") == 0 ]] || state=failed
      # the throughput of every run that finished, whatever became of the study (issue 11's figures)
      for runs in "$tmp"/data/*/runs; do
        [[ -d $runs ]] || continue
        study=$(basename "$(dirname "$runs")")
        python bench/study_throughput.py --root "$tmp" --study "$study" --state "$state" --out "$RESULTS" \
          --source "$(basename "$tarball") of bench/device.sh study, $(date -u -r "$tarball" +%FT%TZ)" \
          | tail -n 1 || echo "!! no throughput summary for study $study"
      done
      [[ $state == finished ]] || { mkdir -p "$RESULTS" && cp "$tmp/run.log" "$RESULTS/study_run_$state.log"; }  # finished: kept below
      if [[ $state == running ]]; then
        echo "error: $tarball is of a study still running (no run.rc): call the device again"; exit 1
      elif [[ $state == failed ]]; then
        echo "error: the study failed on the device; the end of its log:"; tail -n 30 "$tmp/run.log"; exit 1
      fi
      # the study's params file, from the command run.sh recorded
      params=$(sed -n 's/.*--config params=\([^ ]*\).*/\1/p' "$tmp/reports/reference/h100/command.txt")
      name=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['study'])" "$params")
      mkdir -p "$REFERENCE" data/"$name" reports logs
      for f in "$tmp"/reports/reference/h100/*; do  # the products; the README is the checkout's own
        [[ $(basename "$f") == README.md ]] || cp "$f" "$REFERENCE/"
      done
      cp "$tmp/run.log" "$REFERENCE/run.log"
      rm -rf "reports/$name" "data/$name/eval" "logs/$name"
      mv "$tmp/reports/$name" reports/ && mv "$tmp/data/$name/eval" "data/$name/" && mv "$tmp/logs/$name" logs/
      if [[ ! -f $REFERENCE/report.pdf ]]; then
        echo "building the PDF here: python -m pipeline_src report --params $params"
        PIPELINE_QUIET=1 PYTHONPATH=$PWD python -m pipeline_src report --params "$params"
        cp "reports/$name/report.pdf" "reports/$name/report.tex" "$REFERENCE/"
      fi
      echo "$tarball -> $REFERENCE/: $(ls "$REFERENCE" | tr '\n' ' ')"
      ;;
    *)
      echo "error: $tarball is not a bench_<part>.tar.gz or study.tar.gz of bench/device.sh"; exit 1
      ;;
  esac
done
