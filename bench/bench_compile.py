"""Compile warm-up of the training step: what `train.compile_scope` and `train.compile_dynamic`
cost before the first fast step, over the batch shapes a real cell meets.

The model is the GPU study's (d256, 6+6 layers, 8 heads, d_ff 1024, vocabulary 8k); a step is
forward + label-smoothed loss + backward through pipeline_src.train.compiling.compile_for_training,
exactly as the train stage runs it (bf16 autocast on CUDA). Shapes follow the bucket grid of
train.length_buckets 8 (config.bucket_length) from length 16 to 64, rows = batch_tokens // length,
--shapes of them, evenly spread.

Each variant runs in a fresh process twice: once with an empty inductor cache (a fresh machine:
"cold") and once more with the cache the first run left ("warm cache": what every later job of a
study on the same machine pays, because jobs share torch's on-disk cache). Per variant:
graphs compiled (torch._dynamo's unique_graphs), warm-up = sum over shapes of (first step -
steady step), the first shape's and the mean later shape's first-step seconds, and the steady
step time (median of 3 steps per shape, averaged over shapes) against the eager one.

    python bench/bench_compile.py [--quick] [--shapes 6] [--variants layers/auto,model/static,...] [--cuda-graphs]

--quick: a tiny model and torch's "eager" backend (tracing and recompilation only, no code
generation): a smoke test of the bench, not a measurement.
Target: a real cell's whole compile warm-up <= 60 s (cold), so compiling pays within one job.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import OUT_DIR, autocast, md_table, median, sync, torch_setup, write_report

VARIANTS = ["eager", "layers/auto", "layers/static", "model/auto", "model/static"]
MODEL = dict(d_model=256, n_heads=8, enc_layers=6, dec_layers=6, d_ff=1024, dropout=0.1)
QUICK_MODEL = dict(d_model=32, n_heads=2, enc_layers=2, dec_layers=2, d_ff=64, dropout=0.1)
VOCAB = 8000


def shapes(n: int, batch_tokens: int) -> list[tuple[int, int]]:
    from pipeline_src.study.config import bucket_length
    grid = sorted({bucket_length(length, 8) for length in range(16, 65)})
    picked = [grid[round(i * (len(grid) - 1) / max(n - 1, 1))] for i in range(n)]
    return [(batch_tokens // length, length) for length in picked]


def worker(args) -> dict:
    """One variant in this process: per shape, the first step and 3 steady steps."""
    import torch
    from pipeline_src.train.compiling import compile_for_training, compiled_graphs, token_loss
    from pipeline_src.data.tokens import BOS, EOS, PAD
    from pipeline_src.model import ModelConfig, Transformer
    from pipeline_src.train.trainer import sequence_loss

    device = torch_setup(args)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, max_len=128,
                      **(QUICK_MODEL if args.quick else MODEL))
    model = Transformer(cfg).to(device)
    step_fn, loss_fn, graphs = model, token_loss, False
    if args.worker != "eager":
        scope, how = args.worker.split("/")
        graphs = args.cuda_graphs and device.type == "cuda"
        step_fn, loss_fn = compile_for_training(model, scope, None if how == "auto" else False, graphs,
                                                backend="eager" if args.quick else "inductor")

    def step(batch) -> float:
        sync(device)
        tick = time.perf_counter()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device):
            loss = sequence_loss(step_fn, batch, 0.1, loss_fn=loss_fn)
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - tick

    rows = []
    for n_rows, length in shapes(args.shapes, args.batch_tokens):
        ids = torch.randint(4, VOCAB, (n_rows, length), device=device)
        batch = {"src": ids, "tgt_in": ids.roll(1, dims=1), "tgt_out": ids}
        first = step(batch)
        steady = median([step(batch) for _ in range(3)])
        rows.append({"rows": n_rows, "length": length, "first_s": first, "steady_s": steady})
    return {"variant": args.worker, "graphs_compiled": compiled_graphs(), "shapes": rows}


def run_variant(variant: str, args, cache_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--shapes", str(args.shapes),
           "--batch-tokens", str(args.batch_tokens), "--device", args.device]
    cmd += ["--quick"] * args.quick + ["--cuda-graphs"] * args.cuda_graphs
    cmd += ["--threads", str(args.threads)] * bool(args.threads) + ["--no-cudnn-sdp"] * args.no_cudnn_sdp
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    tick = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: variant {variant} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - tick
    shapes_ = result["shapes"]
    result["warmup_s"] = sum(s["first_s"] - s["steady_s"] for s in shapes_)
    result["first_shape_s"] = shapes_[0]["first_s"]
    result["later_shape_s"] = (sum(s["first_s"] for s in shapes_[1:]) / (len(shapes_) - 1)) if len(shapes_) > 1 else None
    result["steady_ms"] = 1000 * sum(s["steady_s"] for s in shapes_) / len(shapes_)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", type=int, default=6, help="batch shapes of the bucket grid to step through")
    ap.add_argument("--batch-tokens", type=int, help="rows x length per batch (default 16384 CUDA, 4096 CPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: eager, SCOPE/auto, SCOPE/static")
    ap.add_argument("--cuda-graphs", action="store_true", help="torch.compile mode reduce-overhead (CUDA only)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-cudnn-sdp", action="store_true")
    ap.add_argument("--name", default="compile_warmup")
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch_tokens is None:
        import torch
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        args.batch_tokens = 512 if args.quick else 16384 if cuda else 4096
    if args.worker:
        print(json.dumps(worker(args)))
        return

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    results, table = [], []
    eager_ms = None
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
            cold = run_variant(variant, args, cache)
            warm = run_variant(variant, args, cache) if variant != "eager" else None
        results.append({"variant": variant, "cold": cold, "warm_cache": warm})
        if variant == "eager":
            eager_ms = cold["steady_ms"]
        table.append([variant, cold["graphs_compiled"], cold["warmup_s"], cold["first_shape_s"], cold["later_shape_s"],
                      warm["warmup_s"] if warm else None, cold["steady_ms"],
                      cold["steady_ms"] / eager_ms if eager_ms else None])
        print(f"{variant}: {cold['graphs_compiled']} graphs, warm-up {cold['warmup_s']:.1f} s cold"
              + (f", {warm['warmup_s']:.1f} s with a warm cache" if warm else ""), flush=True)
    body = md_table(["variant (scope/shapes)", "graphs compiled", "warm-up s (cold cache)", "first shape s",
                     "each later shape s", "warm-up s (warm cache)", "steady ms/step", "vs eager"], table)
    body += ("\n\nshapes (rows x length): " + ", ".join(f"{r}x{l}" for r, l in shapes(args.shapes, args.batch_tokens))
             + f"; model {QUICK_MODEL if args.quick else MODEL}, vocabulary {VOCAB}"
             + (", CUDA graphs (reduce-overhead)" if args.cuda_graphs else "") + "\n")
    write_report(args.name, "Compile warm-up of the training step over the bucket shapes", {"results": results},
                 body, quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
