"""Decoding speed: greedy and beam search (beam 4), with vs without the key/value cache.

A randomly initialised encoder-decoder (d256/3+3 on CPU; d64/2+2 with --quick) decodes a batch
of random source sentences to exactly --out-len (64) target tokens: a forward hook on the output
projection sets the EOS logit to -inf, so no hypothesis ever ends early and
greedy_decode / beam_search (max_len=out-len, length penalty 0.6) run every step; the lengths are
checked. use_cache=True reuses each layer's keys/values (O(t) per step), use_cache=False re-runs
the whole prefix (O(t^2)). Cached and uncached runs alternate, median of --reps repetitions; on
GPU under bf16 autocast with torch.cuda.synchronize around each timing. Also reported: the share
of sentences whose output is identical with and without the cache.

On GPU one untimed run per case comes first ("first run s"): SDPA's cuDNN backend builds a plan
for every new (batch, length) shape, which a decode loop meets at every step (--no-cudnn-sdp).

Target: the cache makes beam 4 at least 4x faster (sentences/s).

A second table compares the implementations of cached beam search (same hypotheses): host
(decode.beam_search: drops finished sentences, reads back every step), static
(static_decode.beam_search_static: fixed shapes, on-device bookkeeping) and, on CUDA, graphs
(static with the decoder step replayed as a CUDA graph).

    python bench/bench_decode.py [--quick] [--device cpu|cuda] [--batch 16] [--out-len 64]
"""
from __future__ import annotations

import argparse
import time

from common import OUT_DIR, autocast, md_table, median, sync, torch_setup, write_report

import torch

from pipeline_src.data.tokens import BOS, EOS, PAD
from pipeline_src.model import ModelConfig, Transformer, beam_search, greedy_decode
from pipeline_src.evaluate.static_decode import beam_search_static

TARGET = 4.0
FULL = dict(d_model=256, n_heads=4, enc_layers=3, dec_layers=3, d_ff=1024)
QUICK = dict(d_model=64, n_heads=4, enc_layers=2, dec_layers=2, d_ff=256)


def build_model(dims: dict, vocab: int, impl: str, device) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, dropout=0.1, pad_id=PAD, bos_id=BOS, eos_id=EOS, attention_impl=impl, **dims)
    model = Transformer(cfg).to(device).eval()
    never = torch.tensor([EOS], device=device)
    # EOS can never win: every output runs to max_len (hook output replaces the logits).
    model.lm_head.register_forward_hook(lambda mod, inp, out: out.index_fill(-1, never, float("-inf")))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="d64/2+2, small batch, 2 repetitions (smoke test)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, help="sentences per call (default 16 CPU, 64 GPU, 8 quick)")
    ap.add_argument("--src-len", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=64, help="target tokens generated per sentence")
    ap.add_argument("--vocab", type=int, help="default 8000 (quick 1000)")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--reps", type=int, help="timed repetitions per case (default 3, quick 1)")
    ap.add_argument("--warmup", type=int, help="untimed full runs per case (default 1 on GPU, 0 on CPU)")
    ap.add_argument("--impl", default="sdpa", choices=["sdpa", "explicit"], help="model.attention_impl")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="CUDA: keep SDPA off its cuDNN backend")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 with --quick)")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args()
    device = torch_setup(args)
    gpu = device.type == "cuda"
    dims = QUICK if args.quick else FULL
    B = args.batch or (8 if args.quick else 64 if gpu else 16)
    vocab = args.vocab or (1000 if args.quick else 8000)
    reps = args.reps or (2 if args.quick else 3)
    model = build_model(dims, vocab, args.impl, device)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, vocab, (B, args.src_len), generator=g).to(device)

    def run(method: str, cache: bool):
        with autocast(device):
            if method == "greedy":
                return greedy_decode(model, src, max_len=args.out_len, use_cache=cache)
            return beam_search(model, src, beam_size=args.beam, length_penalty=0.6, max_len=args.out_len,
                               use_cache=cache)

    with autocast(device):          # warm-up (kernel selection, allocator) outside the timings
        greedy_decode(model, src[:2], max_len=4)
        beam_search(model, src[:2], beam_size=2, max_len=4)
    warmup = args.warmup if args.warmup is not None else int(gpu)
    rows, results = [], []
    for method in ("greedy", f"beam {args.beam}"):
        times, outputs, cold = {True: [], False: []}, {}, {True: None, False: None}
        for _ in range(warmup):  # GPU: every (batch, length) shape once, so per-shape kernel plans are built
            for cache in (True, False):
                sync(device)
                tick = time.perf_counter()
                run(method.split()[0], cache)
                sync(device)
                cold[cache] = cold[cache] or time.perf_counter() - tick
        for _ in range(reps):
            for cache in (True, False):          # interleaved: load drift hits both alike
                sync(device)
                tick = time.perf_counter()
                outputs[cache] = run(method.split()[0], cache)
                sync(device)
                times[cache].append(time.perf_counter() - tick)
        lengths = {len(o) for c in (True, False) for o in outputs[c]}
        if lengths != {args.out_len}:
            raise SystemExit(f"{method}: output lengths {sorted(lengths)}, expected only {args.out_len}")
        same = sum(a == b for a, b in zip(outputs[True], outputs[False])) / B
        t_cache, t_full = median(times[True]), median(times[False])
        speedup = t_full / t_cache
        met = speedup >= TARGET if method.startswith("beam") else None
        for cache, t in ((True, t_cache), (False, t_full)):
            rows.append([method, "yes" if cache else "no", f"{t:.3f}", f"{cold[cache]:.3f}" if cold[cache] else None,
                         f"{B / t:.2f}",
                         f"{B * args.out_len / t:,.0f}", f"{speedup:.2f}×" if cache else "",
                         f"{same:.0%}" if cache else "", {True: "yes", False: "NO", None: "–"}[met] if cache else ""])
        results.append({"method": method, "s_cache": t_cache, "s_no_cache": t_full, "times_cache": times[True],
                        "times_no_cache": times[False], "first_run_s_cache": cold[True],
                        "first_run_s_no_cache": cold[False], "sentences_per_s_cache": B / t_cache,
                        "sentences_per_s_no_cache": B / t_full, "speedup": speedup, "identical_outputs": same,
                        "target_met": met})

    # Beam search implementations, all cached; interleaved, median of reps after one untimed run each.
    impls = {"host": lambda: beam_search(model, src, beam_size=args.beam, length_penalty=0.6, max_len=args.out_len),
             "static": lambda: beam_search_static(model, src, beam_size=args.beam, length_penalty=0.6,
                                                  max_len=args.out_len)}
    if gpu:
        impls["graphs"] = lambda: beam_search_static(model, src, beam_size=args.beam, length_penalty=0.6,
                                                     max_len=args.out_len, cuda_graphs=True)
    impl_times, impl_out, impl_cold = {k: [] for k in impls}, {}, {}
    for rep in range(reps + 1):
        for name_, fn in impls.items():
            sync(device)
            tick = time.perf_counter()
            with autocast(device):
                impl_out[name_] = fn()
            sync(device)
            (impl_times[name_] if rep else impl_cold.setdefault(name_, [])).append(time.perf_counter() - tick)
    impl_rows, impl_results = [], []
    t_host = median(impl_times["host"])
    for name_ in impls:
        t = median(impl_times[name_])
        same = sum(a == b for a, b in zip(impl_out[name_], impl_out["host"])) / B
        impl_rows.append([f"beam {args.beam} {name_}", f"{t:.3f}", f"{impl_cold[name_][0]:.3f}", f"{B / t:.2f}",
                          f"{t_host / t:.2f}×", f"{same:.0%}"])
        impl_results.append({"impl": name_, "s": t, "times": impl_times[name_], "first_run_s": impl_cold[name_][0],
                             "sentences_per_s": B / t, "speedup_vs_host": t_host / t, "identical_to_host": same})

    name = f"d{dims['d_model']}/{dims['enc_layers']}+{dims['dec_layers']}"
    where = " (bf16 autocast)" if gpu else f", {torch.get_num_threads()} threads"
    md = (f"{name} (heads {dims['n_heads']}, d_ff {dims['d_ff']}, vocab {vocab}, attention {args.impl}), random "
          f"weights, {B} sentences × {args.src_len} source tokens → exactly {args.out_len} output tokens each (EOS "
          f"suppressed); median of {reps} after {warmup} untimed; device {device}{where}. "
          f"Target: cache ≥ {TARGET:.0f}× faster for beam {args.beam}.\n\n"
          + md_table(["decoder", "KV cache", "s / batch", "first run s", "sentences/s", "tokens/s", "speed-up",
                      "same output", "target met"], rows) + "\n\n"
          + "Cached beam search, by implementation (the first run includes any graph capture):\n\n"
          + md_table(["decoder", "s / batch", "first run s", "sentences/s", "speed-up vs host", "same output"],
                     impl_rows) + "\n")
    write_report("decode", "Decoding: greedy and beam search, with vs without KV cache",
                 {"device": str(device), "model": dict(dims, vocab_size=vocab, attention_impl=args.impl), "batch": B,
                  "src_len": args.src_len, "out_len": args.out_len, "beam": args.beam, "reps": reps,
                  "target_speedup_beam": TARGET, "results": results,
                  "beam_implementations": impl_results}, md, quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
