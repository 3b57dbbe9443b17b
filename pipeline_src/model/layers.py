"""Encoder and decoder layers and the stacks built from them (paper §3.1, §3.3).

Each sub-layer (attention or feed-forward) is wrapped the same way. The paper's
post-LN form is

    x = LayerNorm(x + Dropout(Sublayer(x)))                                  (§3.1, §5.4)

and the pre-LN form (Xiong et al. 2020), easier to train deep or without warm-up, is

    x = x + Dropout(Sublayer(LayerNorm(x)))     ... then one final LayerNorm per stack,

because otherwise the last layer's residual stream would reach the output un-normalised.
With residual=False the "x +" disappears everywhere, which is the ablation.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import MultiHeadAttention
from .config import ModelConfig


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that returns its input's dtype. Autocast computes layer_norm in fp32 and
    returns fp32; with model.residual_dtype "compute" the residual stream is bf16 and must stay
    so. For an fp32 input this is nn.LayerNorm exactly."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).to(x.dtype)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position alone   (Eq. 2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.activation = F.relu if cfg.activation == "relu" else F.gelu

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        return self.linear2(self.activation(self.linear1(x)))


class _Layer(nn.Module):
    """The residual + LayerNorm + dropout wrapping shared by encoder and decoder layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.residual = cfg.residual
        # "We apply dropout to the output of each sub-layer, before it is added to the
        # sub-layer input and normalized" (§5.4).
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: Tensor, norm: LayerNorm, fn) -> Tensor:
        if self.pre_norm:
            y = self.dropout(fn(norm(x)))
            return x + y if self.residual else y
        y = self.dropout(fn(x))
        return norm(x + y if self.residual else y)


class EncoderLayer(_Layer):
    """Self-attention over the whole (unmasked) sequence, then the FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.d_model)
        self.norm2 = LayerNorm(cfg.d_model)

    def forward(self, x: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        x = self._sublayer(x, self.norm1, lambda h: self.self_attn(h, mask=mask, positions=positions))
        return self._sublayer(x, self.norm2, self.ffn)


class DecoderLayer(_Layer):
    """Masked self-attention, then attention over the encoder memory (§3.2.3), then the FFN.

    Without cross-attention (cross=False) this is a GPT-style decoder-only block.
    """

    def __init__(self, cfg: ModelConfig, cross: bool = True):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg, cross=True) if cross else None
        self.ffn = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.d_model)
        self.norm2 = LayerNorm(cfg.d_model) if cross else None
        self.norm3 = LayerNorm(cfg.d_model)

    def forward(self, x: Tensor, self_mask: Tensor | None, positions: Tensor, memory: Tensor | None = None,
                cross_mask: Tensor | None = None, cache: dict | None = None) -> Tensor:
        self_cache = cache["self"] if cache is not None else None
        # self_mask None: no padding anywhere, so plain causal attention needs no mask tensor.
        x = self._sublayer(x, self.norm1, lambda h: self.self_attn(
            h, mask=self_mask, positions=positions, cache=self_cache, is_causal=self_mask is None))
        if self.cross_attn is not None:
            cross_cache = cache["cross"] if cache is not None else None
            x = self._sublayer(x, self.norm2, lambda h: self.cross_attn(
                h, context=memory, mask=cross_mask, cache=cross_cache))
        return self._sublayer(x, self.norm3, self.ffn)


class Encoder(nn.Module):
    """N identical encoder layers (+ a final LayerNorm for pre-LN)."""

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(n_layers))
        self.final_norm = LayerNorm(cfg.d_model) if cfg.norm == "pre" else None

    def forward(self, x: Tensor, mask: Tensor, positions: Tensor) -> Tensor:  # (B, S, D) -> (B, S, D)
        for layer in self.layers:
            x = layer(x, mask, positions)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(nn.Module):
    """N identical decoder layers (+ a final LayerNorm for pre-LN)."""

    def __init__(self, cfg: ModelConfig, n_layers: int, cross: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross) for _ in range(n_layers))
        self.final_norm = LayerNorm(cfg.d_model) if cfg.norm == "pre" else None

    def new_cache(self) -> list[dict]:
        """One empty key/value cache per layer, for incremental decoding."""
        return [{"self": {}, "cross": {}} for _ in self.layers]

    def forward(self, x: Tensor, self_mask: Tensor, positions: Tensor, memory: Tensor | None = None,
                cross_mask: Tensor | None = None, cache: list[dict] | None = None) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, self_mask, positions, memory, cross_mask, cache[i] if cache is not None else None)
        return self.final_norm(x) if self.final_norm is not None else x
