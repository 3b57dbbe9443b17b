"""Training-step time: our from-scratch Transformer vs torch.nn.Transformer, same dims and batch.

One step = zero_grad + forward + label-smoothed loss (pipeline_src.train.trainer.sequence_loss) + backward
+ AdamW step, as pipeline_src/train/trainer.py does it (fused AdamW on CUDA, foreach on CPU, no host sync
inside the step), timed between torch.cuda.synchronize() calls on GPU (bf16 autocast, TF32).
Both models share everything but the encoder/decoder stacks: our TokenEmbedding (x sqrt(d)),
sinusoidal positions, embedding dropout, the tied output projection and the loss. The reference is
nn.Transformer(batch_first=True, norm_first=False) with the same d_model/heads/layers/d_ff/dropout,
minus what ours does not compute: its final stack LayerNorms (our post-LN stacks have none), its
dropout inside the FFN, and attention dropout (ours defaults to 0), so both do the same work.
Variants run interleaved in one process (ours-sdpa, ours-explicit, ref, repeat), and each reports
the median of >= 10 timed steps after warm-up. "head share" is the output projection's part of the
FLOPs: work both models share, which bounds how far below 1 the ratio can go.
On GPU a fourth variant, ours-sdpa-bf16-residual, is ours-sdpa with model.residual_dtype "compute"
(the residual stream and LayerNorm outputs in bf16 rather than fp32 under autocast).

Targets: ours/ref step-time ratio <= 0.85 on CPU; on GPU, MFU >= 45 % for d512/6+6, where
MFU = 3 * flops_per_token * target tokens/s / measured bf16 matmul peak.

    python bench/bench_train_step.py [--quick] [--compile [--compile-scope model|layers]] [--profile] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import time

from common import OUT_DIR, autocast, md_table, median, peak_bf16_flops, sync, torch_setup, write_report

import torch
import torch.nn as nn

from pipeline_src.data.tokens import BOS, EOS, PAD
from pipeline_src.model import ModelConfig, Transformer, flops_per_token
from pipeline_src.model.positions import SinusoidalPositions, TokenEmbedding, positions_from_mask
from pipeline_src.train.compiling import compile_for_training, token_loss
from pipeline_src.train.trainer import sequence_loss

CONFIGS = {  # name: (d_model, heads, enc_layers, dec_layers); d_ff = 4 d_model
    "d128/2+2": (128, 4, 2, 2), "d256/3+3": (256, 4, 3, 3), "d512/6+6": (512, 8, 6, 6)}
QUICK_CONFIGS = {"d64/1+1": (64, 4, 1, 1), "d128/2+2": (128, 4, 2, 2)}
CPU_TARGET, MFU_TARGET = 0.85, 0.45


class Reference(nn.Module):
    """torch.nn.Transformer between our embeddings and our tied output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        nn.init.xavier_uniform_(self.embed.weight)
        self.positions = SinusoidalPositions(cfg.d_model, cfg.max_len)
        self.dropout = nn.Dropout(cfg.dropout)
        self.core = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.enc_layers, cfg.dec_layers, cfg.d_ff,
                                   cfg.dropout, batch_first=True, norm_first=False)
        self.core.encoder.norm = self.core.decoder.norm = None
        for m in self.core.modules():
            if isinstance(m, nn.MultiheadAttention):
                m.dropout = cfg.attention_dropout
            if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                m.dropout = nn.Identity()   # torch's extra dropout inside the FFN: ours has none
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight

    def _embed(self, ids):
        real = ids != self.cfg.pad_id
        return self.dropout(self.embed(ids) + self.positions(positions_from_mask(real))), ~real

    def forward(self, src, tgt, unpadded: bool = False):  # (unpadded: our model's hint; no use here)
        xs, src_pad = self._embed(src)
        xt, tgt_pad = self._embed(tgt)
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)   # True = masked
        h = self.core(xs, xt, tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                      memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.lm_head(h)


def make_batch(B: int, S: int, T: int, vocab: int, device, seed: int = 0) -> dict:
    """Random full-length sentences (keys are still masked against PAD, as in training)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, S), generator=g)
    tgt = torch.randint(4, vocab, (B, T + 1), generator=g)
    tgt[:, 0] = BOS
    return {"src": src.to(device), "tgt_in": tgt[:, :-1].contiguous().to(device),
            "tgt_out": tgt[:, 1:].contiguous().to(device)}


def make_step(built, batch, device):
    """One timed training step as pipeline_src/train/trainer.py does it: fused AdamW on CUDA (foreach
    on CPU), token count from the host-side batch, so nothing waits on the GPU mid-step."""
    model, loss_fn = built
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=not fused, fused=fused)
    n_tokens = int((batch["tgt_out"] != PAD).sum())

    def step() -> float:
        sync(device)
        tick = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast(device):
            loss = sequence_loss(model, batch, label_smoothing=0.1, loss_fn=loss_fn)
        (loss / n_tokens).backward()
        opt.step()
        sync(device)
        return time.perf_counter() - tick
    return step


def build(kind: str, cfg: ModelConfig, device, compile_: bool, mode: str | None = None, scope: str = "model"):
    """(the model a step runs, its loss function). --compile-scope layers compiles ours as the
    train stage does (pipeline_src/train/compiling.py: one layer per stack and the loss; one static
    shape here); the reference is always compiled whole."""
    torch.manual_seed(0)
    model = (Reference(cfg) if kind == "ref" else Transformer(cfg)).to(device).train()
    if not compile_:
        return model, token_loss
    if kind == "ours" and scope == "layers":
        return compile_for_training(model, "layers", False, graphs=mode == "reduce-overhead")
    return torch.compile(model, mode=mode), token_loss


def profile(name, step, n: int = 3, top: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile as prof
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with prof(activities=acts, record_shapes=False) as p:
        for _ in range(n):
            step()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return f"\n### profile: {name} ({n} steps, sorted by {key})\n\n```\n" + \
        p.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=int(os.environ.get("BENCH_NAME_WIDTH", 40))) + "\n```\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small configs and batch, few steps (smoke test)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", nargs="*", help=f"subset of {list(CONFIGS)}")
    ap.add_argument("--batch", type=int, help="sentences per batch (default 32 CPU, 64 GPU, 16 quick)")
    ap.add_argument("--seq", type=int, help="source = target length (default 32 CPU, 128 GPU, 16 quick)")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--steps", type=int, help="timed steps per variant (default 10, quick 4)")
    ap.add_argument("--warmup", type=int, help="untimed steps per variant (default 3, quick 1)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 with --quick)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every variant")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--compile-scope", default="model", choices=["model", "layers"],
                    help="ours compiled whole (as in the committed H100 figures) or as train.compile_scope layers")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="CUDA: keep SDPA off its cuDNN backend")
    ap.add_argument("--profile", action="store_true", help="append torch.profiler top ops per variant")
    ap.add_argument("--top", type=int, default=12, help="rows per profile table")
    ap.add_argument("--variants", nargs="*", help="subset of ours-sdpa ours-explicit ours-sdpa-bf16-residual "
                                                  "torch.nn.Transformer (default all; the bf16 residual on GPU only)")
    ap.add_argument("--name", default="train_step", help="report name under --out")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--out", default=str(OUT_DIR), help="directory for train_step.json/.md")
    args = ap.parse_args()
    args.compile = args.compile or bool(args.compile_mode)   # a mode implies compiling
    device = torch_setup(args)
    gpu = device.type == "cuda"
    known = {**QUICK_CONFIGS, **CONFIGS}
    configs = {k: known[k] for k in (args.configs or (QUICK_CONFIGS if args.quick else CONFIGS))}
    B = args.batch or (16 if args.quick else 64 if gpu else 32)
    L = args.seq or (16 if args.quick else 128 if gpu else 32)
    steps = args.steps or (4 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    vocab = 1000 if args.quick and args.vocab == 8000 else args.vocab
    peak = peak_bf16_flops(device) if gpu else None
    # (model, attention_impl, model.residual_dtype); a bf16 residual stream needs autocast: GPU only by default
    variants = {"ours-sdpa": ("ours", "sdpa", "float32"), "ours-explicit": ("ours", "explicit", "float32"),
                "ours-sdpa-bf16-residual": ("ours", "sdpa", "compute"), "torch.nn.Transformer": ("ref", "sdpa", "float32")}
    default = [v for v in variants if gpu or variants[v][2] == "float32"]
    variants = {v: variants[v] for v in (args.variants or default)}

    rows, results, profiles = [], [], ""
    for name, (d, h, ne, nd) in configs.items():
        cfg_kw = dict(vocab_size=vocab, d_model=d, n_heads=h, enc_layers=ne, dec_layers=nd, d_ff=4 * d,
                      dropout=args.dropout, pad_id=PAD, bos_id=BOS, eos_id=EOS)
        batch = make_batch(B, L, L, vocab, device)
        fpt = flops_per_token(ModelConfig(**cfg_kw), L, L)
        step_fns = {v: make_step(build(kind, ModelConfig(**cfg_kw, attention_impl=impl, residual_dtype=residual),
                                       device, args.compile, args.compile_mode, args.compile_scope),
                                 batch, device) for v, (kind, impl, residual) in variants.items()}
        times = {v: [] for v in variants}
        for rep in range(warmup + steps):       # interleaved A/B/C: load drifts hit every variant alike
            for v, fn in step_fns.items():
                t = fn()
                if rep >= warmup:
                    times[v].append(t)
        ref_t = median(times["torch.nn.Transformer"]) if "torch.nn.Transformer" in times else None
        for v in variants:
            t = median(times[v])
            tok_s = B * L / t
            mfu = 3 * fpt * tok_s / peak if peak else None
            ratio = t / ref_t if ref_t else None
            met = None if v.startswith("torch") else (
                (ratio <= CPU_TARGET if ratio else None) if not gpu else (mfu >= MFU_TARGET if name == "d512/6+6" else None))
            results.append({"config": name, "variant": v, "median_s": t, "min_s": min(times[v]),
                            "times_s": times[v], "tokens_per_s": tok_s, "ratio_vs_ref": ratio, "mfu": mfu,
                            "flops_per_token": fpt, "target_met": met})
            rows.append([name, v, f"{2 * d * vocab / fpt:.0%}", f"{t * 1e3:.1f}", f"{min(times[v]) * 1e3:.1f}",
                         f"{tok_s:,.0f}", f"{ratio:.2f}×" if ratio else None, f"{100 * mfu:.1f} %" if mfu else None,
                         {True: "yes", False: "NO", None: "–"}[met]])
        if args.profile:
            for v, fn in step_fns.items():
                profiles += profile(f"{name} {v}", fn, top=args.top)

    target = (f"target: ours/ref ≤ {CPU_TARGET}× on CPU" if not gpu
              else f"target: MFU ≥ {MFU_TARGET:.0%} for d512/6+6 (measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s)")
    setup = (f"batch {B} sentences × {L} source + {L} target tokens, vocab {vocab}, dropout {args.dropout}, label smoothing 0.1, "
             f"AdamW; {warmup} warm-up + {steps} timed steps per variant, interleaved; device {device}"
             f"{' (bf16 autocast)' if gpu else f', {torch.get_num_threads()} threads'}"
             f"{', torch.compile' if args.compile else ''}"
             f"{f' (mode {args.compile_mode})' if args.compile_mode else ''}"
             f"{', ours compiled per layer + loss' if args.compile and args.compile_scope == 'layers' else ''}"
             f"{', cuDNN SDPA off' if args.no_cudnn_sdp else ''}; {target}. tokens/s counts target tokens.")
    md = setup + "\n\n" + md_table(["config", "model", "head share", "median ms/step", "min ms", "tokens/s", "÷ ref",
                                    "MFU", "target met"], rows) + "\n" + profiles
    write_report(args.name, "Training step: ours vs torch.nn.Transformer",
                 {"device": str(device), "batch": B, "seq_len": L, "vocab": vocab, "steps": steps, "warmup": warmup,
                  "threads": torch.get_num_threads(), "compile": args.compile,
                  "compile_mode": args.compile_mode, "compile_scope": args.compile_scope,
                  "cudnn_sdp": not args.no_cudnn_sdp, "peak_bf16_flops": peak, "cpu_target_ratio": CPU_TARGET,
                  "mfu_target": MFU_TARGET, "results": results}, md, quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
