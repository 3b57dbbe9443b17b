"""The one record that fully determines a model's architecture.

Every ablation in the study is a field here, so a model is reproducible from
(config, seed) alone. Defaults are the paper's base model (Vaswani et al. 2017,
Table 3, "base"): d_model 512, 8 heads, 6+6 layers, d_ff 2048, P_drop 0.1.
"""
from __future__ import annotations

from dataclasses import dataclass

ARCHS = ("encoder_decoder", "decoder_only", "encoder_only")
POS_ENCODINGS = ("sinusoidal", "learned", "none", "rope")
NORMS = ("post", "pre")
ACTIVATIONS = ("relu", "gelu")
ATTENTION_IMPLS = ("explicit", "sdpa")
RESIDUAL_DTYPES = ("float32", "compute")
EMBED_INITS = ("xavier", "normal")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    arch: str = "encoder_decoder"      # "encoder_decoder" | "decoder_only" | "encoder_only"
    d_model: int = 512
    n_heads: int = 8
    enc_layers: int = 6                 # used by encoder_decoder and encoder_only
    dec_layers: int = 6                 # used by encoder_decoder and decoder_only
    d_ff: int = 2048
    dropout: float = 0.1                # residual/sublayer-output and embedding dropout (paper P_drop)
    attention_dropout: float = 0.0      # dropout on attention probabilities
    pos_encoding: str = "sinusoidal"    # "sinusoidal" | "learned" | "none" | "rope"
    max_len: int = 1024                 # longest sequence for learned positions / sinusoid table
    residual: bool = True               # False removes every skip connection
    norm: str = "post"                  # "post" (paper) | "pre"
    activation: str = "relu"            # "relu" | "gelu"
    tie_embeddings: bool = True         # share src/tgt embeddings and output projection (shared vocab)
    copy_attention: bool = False        # encoder_decoder: pointer-generator output (copy.py)
    attention_impl: str = "explicit"    # "explicit" (written-out softmax(QK^T/sqrt(d_k))V) | "sdpa"
    # "compute": under autocast, the residual stream (embeddings, sub-layer sums, LayerNorm outputs)
    # is kept in autocast's dtype (bf16) instead of fp32, halving the bytes of the memory-bound
    # add + dropout + LayerNorm kernels; LayerNorm still computes in fp32. No effect without autocast.
    residual_dtype: str = "float32"     # "float32" | "compute"
    # The token (and learned-position) tables' initial entries: "normal", N(0, d_model^-1/2) as
    # fairseq and tensor2tensor draw them, which the sqrt(d_model) scale brings to unit size beside
    # the sinusoids' 0.71 (positions.py), or "xavier" (uniform, like every other matrix, as in The
    # Annotated Transformer: tokens enter at ~0.16 per dimension, and deeper post-LN models fail).
    embed_init: str = "normal"          # "normal" | "xavier"
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"model.{name} ({value!r}) must be one of {', '.join(allowed)}")

        def at_least(name: str, low: int) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"model.{name} ({value!r}) must be an integer >= {low}")

        choice("arch", ARCHS)
        choice("pos_encoding", POS_ENCODINGS)
        choice("norm", NORMS)
        choice("activation", ACTIVATIONS)
        choice("attention_impl", ATTENTION_IMPLS)
        choice("residual_dtype", RESIDUAL_DTYPES)
        choice("embed_init", EMBED_INITS)
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            at_least(name, 1)
        # A stack the chosen architecture actually uses must have at least one layer.
        at_least("enc_layers", 1 if self.arch != "decoder_only" else 0)
        at_least("dec_layers", 1 if self.arch != "encoder_only" else 0)
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"model.{name} ({value!r}) must be in [0, 1)")
        for name in ("residual", "tie_embeddings", "copy_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name} ({getattr(self, name)!r}) must be true or false")
        if self.copy_attention and self.arch != "encoder_decoder":
            raise ValueError(f"model.copy_attention points into a source: it needs model.arch encoder_decoder, "
                             f"not {self.arch}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.pos_encoding == "rope" and self.head_dim % 2:
            raise ValueError(f"model.d_model / model.n_heads ({self.head_dim}) must be even "
                             f"for model.pos_encoding rope")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"model.{name} ({value}) must be in [0, model.vocab_size={self.vocab_size})")
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError(f"model.pad_id, model.bos_id, model.eos_id ({self.pad_id}, {self.bos_id}, "
                             f"{self.eos_id}) must be distinct")

    @property
    def head_dim(self) -> int:
        """d_k = d_v = d_model / h (paper §3.2.2)."""
        return self.d_model // self.n_heads
