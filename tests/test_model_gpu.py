"""GPU checks for pipeline_src.model: the bf16 autocast training path, the fused SDPA kernels
with padding masks, and KV-cache decoding on CUDA. Skipped where there is no GPU (CI).

Run with -s to see the throughput lines (informative only; nothing asserts a speed).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from pipeline_src.model import ModelConfig, Transformer, beam_search, greedy_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAD, BOS = 0, 2
ARCHS = ("encoder_decoder", "decoder_only", "encoder_only")


def make(arch: str, impl: str, **kw) -> Transformer:
    fields = dict(vocab_size=1000, arch=arch, d_model=128, n_heads=4, enc_layers=2, dec_layers=2, d_ff=512,
                  attention_impl=impl)
    fields.update(kw)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**fields)).cuda()


def batch(B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 1000, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    ids[torch.arange(T)[None, :] >= lengths[:, None]] = PAD            # right padding
    return ids.cuda()


@pytest.mark.parametrize("arch", ARCHS)
def test_sdpa_matches_explicit_on_gpu(arch):
    explicit, fused = make(arch, "explicit").eval(), make(arch, "sdpa").eval()
    src, tgt = batch(8, 37, 1), batch(8, 29, 2)
    src_arg = src if arch == "encoder_decoder" else None
    real = (tgt != PAD)[..., None]
    with torch.no_grad():
        a, b = explicit(src_arg, tgt), fused(src_arg, tgt)
        torch.testing.assert_close(a * real, b * real, atol=2e-3, rtol=0)  # TF32 / kernel differences
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a16, b16 = explicit(src_arg, tgt), fused(src_arg, tgt)
    assert torch.isfinite(a16).all() and torch.isfinite(b16).all()
    assert ((a16.float() - a) * real).abs().max() < 0.5                    # bf16 is close to fp32
    assert ((b16.float() - b) * real).abs().max() < 0.5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_bf16_autocast_training_step(arch, impl):
    model = make(arch, impl, attention_dropout=0.1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    src, tgt = batch(16, 40, 3), batch(16, 33, 4)
    tgt[:, :3] = torch.where(tgt[:, :3] == PAD, 7, tgt[:, :3])
    tgt[1, :5] = PAD                                                       # a left-padded row too
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src if arch == "encoder_decoder" else None, tgt[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_cached_decoding_on_gpu(arch):
    model = make(arch, "sdpa").eval()
    src = batch(16, 20, 5)
    for impl_model in (model,):
        greedy = greedy_decode(impl_model, src, 30)
        assert greedy == greedy_decode(impl_model, src, 30, use_cache=False)
        assert beam_search(impl_model, src, beam_size=1, max_len=30) == greedy
        assert beam_search(impl_model, src, beam_size=4, max_len=30) == \
            beam_search(impl_model, src, beam_size=4, max_len=30, use_cache=False)


def _timed(fn, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_report_throughput(arch):
    """Base-size model (paper Table 3), bf16 autocast: training tokens/s per attention impl and
    decoding time with and without the KV cache."""
    for impl in ("explicit", "sdpa"):
        model = make(arch, impl, vocab_size=8000, d_model=512, n_heads=8, enc_layers=6, dec_layers=6,
                     d_ff=2048).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        src, tgt = batch(64, 64, 6), batch(64, 65, 7)
        tgt[:, 0] = BOS

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src if arch == "encoder_decoder" else None, tgt[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        seconds = _timed(step)
        print(f"\n{arch} {impl}: train {int((tgt[:, 1:] != PAD).sum()) / seconds:,.0f} target tokens/s")
    model.eval()
    src = batch(32, 30, 8)
    for use_cache in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seconds = _timed(lambda: greedy_decode(model, src, 60, use_cache=use_cache), repeats=1)
        print(f"{arch}: greedy 32x60 tokens use_cache={use_cache}: {seconds:.3f} s")
