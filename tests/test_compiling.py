"""Compilation of the training step (pipeline_src/train/compiling.py), traced with torch's "eager"
backend: dynamo's tracing, guards and recompilations are the real ones, only no kernels are
generated (code generation is the GPU's business and bench/bench_compile.py's)."""
import pytest
import torch

from pipeline_src.train.compiling import compile_for_training, compile_mode, compiled_graphs, eager, token_loss
from pipeline_src.model import ModelConfig, Transformer
from pipeline_src.train.trainer import sequence_loss

V = 50


def _model(arch="encoder_decoder"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=4, enc_layers=2, dec_layers=3, d_ff=64, dropout=0.0,
                      arch=arch, max_len=64)
    return Transformer(cfg)


def _batch(rows, length, arch="encoder_decoder", seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (rows, length), generator=g)
    ids[0, -3:] = 0  # some padding
    return {"src": ids if arch == "encoder_decoder" else None, "tgt_in": ids, "tgt_out": ids.roll(1, dims=1)}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["layers", "model"])
@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_compiled_step_gives_the_eager_loss_and_gradients(scope, arch):
    reference, compiled = _model(arch), _model(arch)
    step_fn, loss_fn = compile_for_training(compiled, scope, None, backend="eager")
    for rows, length in [(4, 8), (3, 12)]:
        batch = _batch(rows, length, arch)
        want = sequence_loss(reference, batch, 0.1)
        got = sequence_loss(step_fn, batch, 0.1, loss_fn=loss_fn)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want)
        for (name, a), b in zip(reference.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=name)
    # compiling the layers in place leaves the checkpoint format alone
    assert list(compiled.state_dict()) == list(reference.state_dict())


def test_automatic_dynamic_shapes_stop_compiling_after_the_second_shape():
    """The warm-up bound: with compile_dynamic null, a third, fourth, ... batch shape reuses the
    graphs compiled for the second; with false every new shape compiles every region again."""
    counts = {}
    for dynamic in (None, False):
        torch._dynamo.reset()
        model = _model()
        step_fn, loss_fn = compile_for_training(model, "layers", dynamic, backend="eager")
        start, after = compiled_graphs(), []
        for rows, length in [(8, 8), (6, 10), (5, 13), (4, 16), (3, 21)]:
            sequence_loss(step_fn, _batch(rows, length), 0.1, loss_fn=loss_fn).backward()
            after.append(compiled_graphs() - start)
        counts[dynamic] = after
    auto, static = counts[None], counts[False]
    assert auto[1] == auto[-1] > 0, auto                       # nothing new after the second shape
    assert static == [static[0] * (i + 1) for i in range(5)], static  # every shape: every region again
    # encoder layer, decoder layer and loss: one graph each per compilation; the layers of a stack share theirs
    assert static[0] == 3


def test_validation_under_eager_compiles_nothing():
    model = _model()
    step_fn, loss_fn = compile_for_training(model, "layers", None, backend="eager")
    sequence_loss(step_fn, _batch(4, 8), 0.1, loss_fn=loss_fn).backward()
    before = compiled_graphs()
    with torch.no_grad(), eager():
        model.eval()
        sequence_loss(model, _batch(7, 9), loss_fn=token_loss)  # a new shape, no grad, eval mode
    assert compiled_graphs() == before


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="train.compile_scope"):
        compile_for_training(_model(), "everything")


def test_a_cpu_compiles_only_with_compile_on_cpu():
    # train.compile alone leaves a CPU study's numbers as they are; CUDA graphs never on a CPU
    assert compile_mode(True, False, True, "cpu") == (False, False)
    assert compile_mode(True, True, True, "cpu") == (True, False)
    assert compile_mode(True, False, True, "cuda") == (True, True)
    assert compile_mode(True, False, False, "cuda") == (True, False)
    assert compile_mode(False, True, True, "cuda") == (False, False)
