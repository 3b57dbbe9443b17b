#!/usr/bin/env bash
# The GPU-speed measurements (issue 11) for a lent GPU, in three parts that each fit one 10-minute
# device call. From the repository root, with the project's packages importable:
#
#   bash bench/gpu_session.sh a   # beam-search implementations (host / static / CUDA graphs);
#                                 # one real Multi30k cell: eager, and compile + CUDA graphs
#   bash bench/gpu_session.sh b   # K real cells sharing the GPU (K = 4, 8, 2): aggregate tok/s and MFU
#   bash bench/gpu_session.sh c   # compile warm-up per train.compile_scope / compile_dynamic over 6
#                                 # bucket shapes (+ CUDA graphs); the d512 step with a bf16 residual stream
#
# On a lent machine (bare: no datasets, rouge-score, jsonschema, Snakemake, no mirror), prepare here
# first with `bash bench/gpu_carry.sh`, carry [".whl", ".mirror"], and start the command with the
# prefix it prints.
# Every benchmark prints its table and writes .md/.json (machine, versions, command in the header)
# under $DEST (default bench/results/h100; on the device machine pass DEST=$OUT to get them back).
# BUDGET_S (default 45) is each real cell's training budget.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-bench/results/h100}
BUDGET=${BUDGET_S:-45}
export PIPELINE_QUIET=1 PYTHONUNBUFFERED=1
mkdir -p "$DEST"
run() { echo "+ python $*"; python "$@"; }
python -c "import torch, sys; torch.cuda.is_available() or sys.exit('error: no CUDA device')"

case "${1:-}" in
  a)
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
    run bench/bench_compile.py --shapes 6 --variants eager,layers/auto,layers/static --name compile_warmup --out "$DEST"
    run bench/bench_compile.py --shapes 6 --variants layers/auto --cuda-graphs --name compile_warmup_graphs --out "$DEST"
    run bench/bench_train_step.py --configs d512/6+6 --batch 256 --compile --variants ours-sdpa ours-sdpa-bf16-residual \
      --name train_step_d512_b256_compile_bf16_residual --out "$DEST"
    run bench/bench_train_step.py --configs d512/6+6 --batch 256 --compile --compile-scope layers \
      --variants ours-sdpa ours-sdpa-bf16-residual --name train_step_d512_b256_compile_layers --out "$DEST"
    ;;
  *)
    echo "usage: bash bench/gpu_session.sh a|b|c" >&2
    exit 2
    ;;
esac
