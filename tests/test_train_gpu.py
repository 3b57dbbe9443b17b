"""CUDA-only checks of the training input path and attention fast paths. Skipped without a GPU (CI)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline_src.train import batching
from pipeline_src.model import ModelConfig, Transformer
from pipeline_src.train.step_meter import StepMeter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_prefetcher_pins_batches_and_the_copy_matches():
    stream = ((0, i, {"src": None, "tgt_in": torch.full((4, 8), i), "tgt_out": torch.full((4, 8), i)}) for i in range(5))
    for _, i, batch in batching.Prefetcher(stream, depth=2, pin=True):
        assert batch["tgt_in"].is_pinned()
        on_gpu = batching.to_device(batch, torch.device("cuda"))
        assert torch.equal(on_gpu["tgt_in"].cpu(), batch["tgt_in"])


def test_is_causal_path_matches_masked_path_under_bf16():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=1000, arch="decoder_only", d_model=128, n_heads=4, dec_layers=2,
                                    d_ff=512, attention_impl="sdpa")).cuda().eval()
    tgt = torch.randint(4, 1000, (8, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = model(None, tgt), model(None, tgt, unpadded=True)
    assert (a.float() - b.float()).abs().max() < 0.1


def test_step_meter_reads_the_pending_steps_in_one_go():
    meter = StepMeter(torch.device("cuda"))
    batch = {"src": None, "tgt_in": torch.ones(2, 4, dtype=torch.long)}
    for step in range(1, 4):
        meter.start_step([batch])
        meter.end_step(step, torch.tensor(float(step), device="cuda"), torch.tensor(0.5, device="cuda"), 8)
    steps, rate = meter.read()
    assert [s[:2] for s in steps] == [(1, 1.0), (2, 2.0), (3, 3.0)] and rate > 0 and meter.pad_fraction == 0
    assert len(meter.shapes) == 1 and np.isfinite(meter.warmup_s)


@pytest.mark.parametrize("graphs", [False, True])
def test_layer_compiled_step_with_inductor_matches_eager(graphs):
    """compile_scope layers / compile_dynamic null with inductor (and CUDA graphs): the loss and
    gradients of a bf16 step match the eager model's, and a third shape compiles nothing new."""
    from pipeline_src.train.compiling import compile_for_training, compiled_graphs
    from pipeline_src.train.trainer import sequence_loss

    def model():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=1000, d_model=128, n_heads=4, enc_layers=2, dec_layers=2,
                                       d_ff=512, dropout=0.0, attention_impl="sdpa")).cuda()

    torch._dynamo.reset()
    reference, compiled = model(), model()
    step_fn, loss_fn = compile_for_training(compiled, "layers", None, graphs)
    counts = []
    for rows, length in [(16, 16), (12, 24), (8, 40)]:
        ids = torch.randint(4, 1000, (rows, length), device="cuda")
        batch = {"src": ids, "tgt_in": ids, "tgt_out": ids.roll(1, dims=1)}
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = sequence_loss(step_fn, batch, 0.1, loss_fn=loss_fn)
            want = sequence_loss(reference, batch, 0.1)
        got.backward()
        want.backward()
        assert abs(float(got) - float(want)) <= 1e-2 * abs(float(want))
        for a, b in zip(reference.parameters(), compiled.parameters()):
            assert torch.allclose(b.grad, a.grad, rtol=0.05, atol=1e-3)
            a.grad = b.grad = None
        counts.append(compiled_graphs())
    assert counts[2] == counts[1]
