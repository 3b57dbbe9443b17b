#!/usr/bin/env bash
# Put what a node job made (workflow/node/node.sh) where the repository keeps it. From the repository
# root of the checkout the bundle was made from:
#
#   bash workflow/node/unpack.sh results-study-gpu.tar.gz results-bench-a.tar.gz ...
#
#   results-study-<name>  -> reports/<name>, logs/<name>, data/<name>/eval and every run's records
#                            (ignored by git: the study's outputs, as if it had run here), and
#                            reports/reference/* (the products a study's run.sh gathered; the
#                            checkout's own READMEs are kept). A study that stopped before its
#                            PDF (no TeX on the node) gets it here, from the same products, by the
#                            same report stage. A study that failed is refused, its log shown.
#   results-bench-<part>  -> bench/results/<RESULTS_NAME, default node>/ (each benchmark's .md/.json
#                            and the console log), with the lines of benchmarks that failed shown
#   results-run           -> shown (its node.log), nothing is placed
# The archives of `node.sh parts` are not for this script: `python -m pipeline_src parts build`
# builds the report from them (it says so if given one).
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ -d .venv/bin ]] && export PATH="$PWD/.venv/bin:$PATH"
RESULTS=${RESULTS_DIR:-bench/results/${RESULTS_NAME:-node}}
(( $# )) || { echo "usage: bash workflow/node/unpack.sh results-<job>.tar.gz..." >&2; exit 2; }

for tarball in "$@"; do
  [[ -f $tarball ]] || { echo "error: $tarball not found"; exit 1; }
  tmp=$(mktemp -d)
  tar -xzf "$tarball" -C "$tmp"
  dir=$(ls "$tmp")
  src=$tmp/$dir
  status=$(cat "$src/exit_status" 2>/dev/null || echo "?")
  case $dir in
    study-*)
      name=${dir#study-}
      if [[ $status != 0 ]]; then
        echo "error: $tarball: the study $name failed on the node (exit status $status); the end of its log:"
        tail -n 30 "$src/node.log"
        rm -rf "$tmp"; exit 1
      fi
      params=$(cat "$src/params.txt")
      rm -rf "reports/$name" "logs/$name" "data/$name/eval"
      mkdir -p reports logs "data/$name"
      [[ -d $src/reports/$name ]] && mv "$src/reports/$name" reports/
      [[ -d $src/logs/$name ]] && mv "$src/logs/$name" logs/
      [[ -d $src/data/$name/eval ]] && mv "$src/data/$name/eval" "data/$name/"
      [[ -d $src/data/$name/runs ]] && mkdir -p "data/$name/runs" && cp -r "$src/data/$name/runs/." "data/$name/runs/"
      if [[ -d $src/reports/reference ]]; then  # the products; the READMEs are the checkout's own
        (cd "$src/reports/reference" && find . -type f ! -name README.md) | while read -r f; do
          mkdir -p "reports/reference/$(dirname "$f")" && cp "$src/reports/reference/$f" "reports/reference/$f"
        done
      fi
      if [[ ! -f reports/$name/report.pdf ]]; then
        echo "building the PDF here: python -m pipeline_src report --params $params"
        PIPELINE_QUIET=1 PYTHONPATH=$PWD python -m pipeline_src report --params "$params"
        ref=$(grep -l -- "--config params=$params" reports/reference/*/command.txt 2>/dev/null | head -n 1 || true)
        [[ -n $ref ]] && cp "reports/$name/report.pdf" "reports/$name/report.tex" "$(dirname "$ref")/"
      fi
      # how fast its runs went, alone and together (bench/study_throughput.py)
      python bench/study_throughput.py --study "$name" --out "$RESULTS" \
        --source "$(basename "$tarball"), $(date -u -r "$tarball" +%FT%TZ)" | tail -n 1 || true
      echo "$tarball -> reports/$name, logs/$name, data/$name/{eval,runs}$( [[ -d $src/reports/reference ]] && echo ', reports/reference/')"
      ;;
    bench-*)
      mkdir -p "$RESULTS"
      cp -r "$src/." "$RESULTS/"
      rm -f "$RESULTS/exit_status"
      mv "$RESULTS/node.log" "$RESULTS/${dir}_node.log"
      echo "$tarball -> $RESULTS/: $(cd "$src" && ls | tr '\n' ' ')"
      grep -h "^!! " "$RESULTS"/*.log 2>/dev/null || true
      ;;
    run)
      echo "$tarball (exit status $status):"
      cat "$src/node.log"
      ;;
    *)
      if [[ -f $src/part.json ]]; then  # node.sh parts: the report is built from all the parts together
        echo "error: $tarball is a part of a study (bash node.sh parts); build the report from all of its parts:"
        echo "  python -m pipeline_src parts build $(dirname "$tarball") --params $(python -c "import json, sys; print(json.load(open(sys.argv[1]))['params_file'])" "$src/part.json")"
      else
        echo "error: $tarball is not a results tarball of workflow/node/node.sh"
      fi
      rm -rf "$tmp"; exit 1
      ;;
  esac
  rm -rf "$tmp"
done
