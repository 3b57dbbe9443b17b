#!/usr/bin/env bash
# The GPU benchmarks, in four parts of under ten minutes each. From the repository root, with the
# project's packages importable and a CUDA device:
#
#   bash bench/gpu_benchmarks.sh a   # the CUDA-only tests; beam-search implementations (host / static / CUDA graphs);
#                                    # one real Multi30k cell: eager, and compile + CUDA graphs
#   bash bench/gpu_benchmarks.sh b   # K real cells sharing the GPU (K = 4, 8, 2): aggregate tok/s and MFU
#   bash bench/gpu_benchmarks.sh c   # compile warm-up per train.compile_scope / compile_dynamic over 6
#                                    # bucket shapes (+ CUDA graphs); the d512 step with a bf16 residual stream
#   bash bench/gpu_benchmarks.sh d   # summarization decoding at the study's scale: the evaluate stage's decoder
#                                    # over 2,000 CNN/DailyMail-length articles, beam 4 (host / static / graphs)
#
# On a GPU node without internet: `bash bundle/node.sh bench a` (workflow/node/node.sh) runs a part
# with the bundle's packages and packs what it wrote.
# Every benchmark prints its table and writes .md/.json (machine, versions, command in the header)
# under $DEST (default bench/results/h100), and the console goes to $DEST/session_<part>.log.
# BUDGET_S (default 45) is each real cell's training budget. PART_BUDGET_S (default 540) bounds the
# whole part: each benchmark gets a `timeout` of what is left, one that fails or times out is
# logged and the next one still runs, and none starts with < 30 s left.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-bench/results/h100}
BUDGET=${BUDGET_S:-45}
DEADLINE=$(( $(date +%s) + ${PART_BUDGET_S:-540} ))
export PIPELINE_QUIET=1 PYTHONUNBUFFERED=1
mkdir -p "$DEST"
exec > >(tee -a "$DEST/session_${1:-none}.log") 2>&1
run() {  # run [--cap SECONDS] ARGS...: python ARGS under what is left of the part's budget (or the cap)
  local cap=0
  [[ $1 == --cap ]] && { cap=$2; shift 2; }
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 30 )); then echo "!! SKIPPED (${left}s left of the part's budget): python $*"; return; fi
  (( cap > 0 && cap < left )) && left=$cap
  echo "+ python $*   [$(date -u +%T), limit ${left}s]"
  timeout -s INT -k 15 "$left" python "$@"
  local rc=$?
  (( rc == 0 )) || echo "!! FAILED rc=$rc$( (( rc == 124 || rc == 130 )) && echo ' (out of time)'): python $*"
}
[[ ${REQUIRE_CUDA:-1} == 0 ]] || python -c "import torch, sys; torch.cuda.is_available() or sys.exit('error: no CUDA device')" || exit 1

case "${1:-}" in
  a)
    # the CUDA-only tests first (sdpa vs explicit, bf16 step, cached decoding, inductor + CUDA graphs)
    run --cap 180 -m pytest -q -p no:cacheprovider tests/test_model_gpu.py tests/test_train_gpu.py
    # Multi30k-sized decoding batch (the GPU study's eval.batch_size is 250)
    run bench/bench_decode.py --no-cudnn-sdp --batch 250 --out "$DEST/decode_b250"
    run bench/bench_real_cell.py --budget-s "$BUDGET" --decoding static --name real_cell_eager_static --out "$DEST"
    run bench/bench_real_cell.py --budget-s "$BUDGET" --compile --cuda-graphs --decoding graphs \
      --name real_cell_compile_graphs --out "$DEST"
    ;;
  b)
    run bench/bench_real_cell.py --budget-s "$BUDGET" --jobs 4 --compile --cuda-graphs --decoding graphs \
      --name real_cell_jobs4_compile_graphs --out "$DEST"
    run bench/bench_real_cell.py --budget-s "$BUDGET" --jobs 8 --compile --cuda-graphs --decoding graphs \
      --name real_cell_jobs8_compile_graphs --out "$DEST"
    run bench/bench_real_cell.py --budget-s "$BUDGET" --jobs 2 --compile --cuda-graphs --decoding graphs \
      --name real_cell_jobs2_compile_graphs --out "$DEST"
    ;;
  c)
    # the isolated-step MFU target first (compile of the whole model took ~1 min a variant on the H100);
    # then the compile warm-up over 6 shapes, whose cold compilations may not all fit the part
    run bench/bench_train_step.py --configs d512/6+6 --batch 256 --compile --variants ours-sdpa ours-sdpa-bf16-residual \
      --name train_step_d512_b256_compile_bf16_residual --out "$DEST"
    run bench/bench_compile.py --shapes 6 --variants eager,layers/auto,layers/static --name compile_warmup --out "$DEST"
    run bench/bench_train_step.py --configs d512/6+6 --batch 256 --compile --compile-scope layers \
      --variants ours-sdpa ours-sdpa-bf16-residual --name train_step_d512_b256_compile_layers --out "$DEST"
    run bench/bench_compile.py --shapes 6 --variants layers/auto --cuda-graphs --name compile_warmup_graphs --out "$DEST"
    ;;
  d)
    # the fast implementations first: the host one is the launch-bound baseline, kept if time allows
    run bench/bench_decode_articles.py --impls graphs,static --name decode_articles_cnndm --out "$DEST"
    run bench/bench_decode_articles.py --impls host,graphs --name decode_articles_cnndm_host --out "$DEST"
    ;;
esac
