"""Copy attention (model/copy.py) and n-gram blocking in decoding (model/decode.py)."""
from __future__ import annotations

import pytest
import torch

from pipeline_src.model import ModelConfig, Transformer, beam_search, greedy_decode
from pipeline_src.model.copy import CopyAttention
from pipeline_src.model.decode import beam_search_nbest
from pipeline_src.evaluate.static_decode import beam_search_static

V = 40


def make(seed: int = 0, **overrides) -> Transformer:
    # Xavier token tables (not the default): small entries make an untrained model repeat itself and
    # end sentences at different steps, which these decoding tests need in order to mean anything.
    fields = dict(vocab_size=V, d_model=16, n_heads=2, enc_layers=1, dec_layers=2, d_ff=32, dropout=0.0,
                  copy_attention=True, embed_init="xavier")
    fields.update(overrides)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**fields)).eval()


def source() -> torch.Tensor:
    src = torch.randint(4, V, (3, 9), generator=torch.Generator().manual_seed(1))
    src[0, 6:] = 0                                    # a padded row
    return src


def test_copy_output_is_a_distribution_over_the_vocabulary():
    model, src = make(), source()
    tgt = torch.randint(4, V, (3, 5), generator=torch.Generator().manual_seed(2))
    log_probs = model(src, tgt)
    assert log_probs.shape == (3, 5, V)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 5))
    # cross-entropy reads normalised log-probabilities exactly as logits: log_softmax leaves them be
    torch.testing.assert_close(log_probs.log_softmax(-1), log_probs)


def test_copy_puts_its_mass_on_source_tokens_when_the_gate_says_copy():
    model, src = make(), source()
    with torch.no_grad():
        model.copy.gate.weight.zero_()
        model.copy.gate.bias.fill_(-50.0)            # p_gen ~ 0: copy only
    probs = model(src, torch.full((3, 4), 5)).exp()
    for row in range(3):
        real = set(src[row][src[row] != 0].tolist())
        others = [w for w in range(V) if w not in real]
        assert probs[row][:, sorted(real)].sum(-1).min() > 0.999
        assert probs[row][:, others].max() < 1e-6   # pads of the source are never copied


def test_copy_is_trained_by_the_loss():
    model, src = make().train(), source()
    tgt = torch.randint(4, V, (3, 6), generator=torch.Generator().manual_seed(3))
    loss = torch.nn.functional.cross_entropy(model(src, tgt[:, :-1]).transpose(1, 2), tgt[:, 1:],
                                             label_smoothing=0.1)
    loss.backward()
    for name in ("query", "key", "gate"):
        assert getattr(model.copy, name).weight.grad.abs().sum() > 0, name


def test_copy_decoding_with_cache_equals_without():
    model, src = make(), source()
    assert greedy_decode(model, src, 8) == greedy_decode(model, src, 8, use_cache=False)
    assert (beam_search(model, src, beam_size=3, max_len=8)
            == beam_search(model, src, beam_size=3, max_len=8, use_cache=False))


def test_copy_keys_computed_once_per_sentence_decode_as_recomputed_every_step(monkeypatch):
    """Decoding computes the copy layer's keys of the memory once and gathers them with the rows
    when a sentence finishes; the scores are those of keys recomputed at every step, bit for bit."""
    model, src = make(), source()                     # row 0 is shorter: it stops first
    forward, rows = CopyAttention.forward, []

    def recording(self, logits, h, memory, memory_mask, src, keys=None):
        assert keys is not None and keys.size(0) == memory.size(0)
        rows.append(keys.size(0))
        return forward(self, logits, h, memory, memory_mask, src, keys)

    def recomputing(self, logits, h, memory, memory_mask, src, keys=None):
        return forward(self, logits, h, memory, memory_mask, src)

    kwargs = dict(beam_size=3, max_len_a=1.0, max_len_b=0)
    monkeypatch.setattr(CopyAttention, "forward", recording)
    once = beam_search_nbest(model, src, **kwargs)
    assert rows[0] == 9 and min(rows) < 9          # 3 sentences x 3 beams, then a sentence finished
    monkeypatch.setattr(CopyAttention, "forward", recomputing)
    assert beam_search_nbest(model, src, **kwargs) == once


def test_copy_attention_needs_an_encoder_decoder_and_the_host_beam_search():
    with pytest.raises(ValueError, match="model.copy_attention.*encoder_decoder"):
        ModelConfig(vocab_size=V, arch="decoder_only", copy_attention=True)
    with pytest.raises(ValueError, match="static decoding does not support model.copy_attention"):
        beam_search_static(make(), source(), beam_size=2, max_len_a=0.0, max_len_b=4)


def test_without_copy_the_model_is_unchanged():
    """copy_attention false builds no extra module, so seeds give the models they gave before."""
    plain, default = make(copy_attention=False), make(copy_attention=False)
    assert plain.copy is None
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in default.named_parameters()]
    assert not any(n.startswith("copy.") for n, _ in plain.named_parameters())


def ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram_blocks_every_repeat(copy, n):
    # A tiny vocabulary makes an untrained model repeat itself at once.
    model, src = make(vocab_size=8, copy_attention=copy), torch.randint(4, 8, (4, 6), generator=torch.Generator().manual_seed(4))
    unblocked = greedy_decode(model, src, 24) + beam_search(model, src, beam_size=3, max_len=24)
    assert any(len(set(ngrams(h, n))) < len(ngrams(h, n)) for h in unblocked)   # the test can fail
    blocked = (greedy_decode(model, src, 24, no_repeat_ngram=n)
               + beam_search(model, src, beam_size=3, max_len=24, no_repeat_ngram=n))
    for hyp in blocked:
        assert len(set(ngrams(hyp, n))) == len(ngrams(hyp, n)), hyp


def test_no_repeat_ngram_zero_is_plain_decoding_and_one_is_refused():
    model, src = make(copy_attention=False), source()
    assert beam_search(model, src, beam_size=3, max_len=10, no_repeat_ngram=0) == beam_search(model, src, 3, max_len=10)
    with pytest.raises(ValueError, match="no_repeat_ngram"):
        greedy_decode(model, src, 5, no_repeat_ngram=1)


def test_copy_attention_is_counted_in_the_flops():
    from pipeline_src.model import flops_per_token
    plain, copy = (ModelConfig(vocab_size=V, d_model=16, n_heads=2, copy_attention=c) for c in (False, True))
    D, S, T = 16, 10, 4
    extra = T * (2 * D * D + 2 * 2 * S * D + 2 * 2 * D) + S * 2 * D * D
    assert flops_per_token(copy, S, T) - flops_per_token(plain, S, T) == pytest.approx(extra / T)
