"""Token embeddings and the four ways of telling the model where a token is.

Self-attention is permutation-equivariant: without position information the
encoder cannot tell "dog bites man" from "man bites dog". The options are

  sinusoidal  fixed sin/cos table added to the embeddings   (paper §3.5)
  learned     a trained table added to the embeddings       (paper Table 3, row E)
  none        nothing (ablation: a bag-of-tokens encoder)
  rope        rotary embeddings applied to q and k inside attention (Su et al. 2021)

Positions are given explicitly as integer tensors (B, T) rather than assumed to
be arange(T): a left-padded row's first real token must get position 0, and a
token decoded incrementally must get its absolute position, not 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig


def positions_from_mask(key_mask: Tensor) -> Tensor:
    """(B, T) bool True=real token -> (B, T) long position of each token among the real ones.

    Counting only real tokens makes left and right padding give the same positions to
    the same words; pad slots get a harmless clamped value (they are masked as keys).
    """
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


class TokenEmbedding(nn.Module):
    """Lookup table scaled by sqrt(d_model) (paper §3.4).

    The scale matters when the table is tied to the output projection. Even with it,
    Xavier-sized entries stay small for a large vocabulary: std sqrt(2 / (V + d)) * sqrt(d),
    about 0.16-0.22 for V = 10k, d = 128-256, against 0.71 for the sinusoids, so positions
    outweigh tokens at the start. init "normal" (the default) draws N(0, d^-1/2), as fairseq
    and tensor2tensor do with this scale: unit size after it; a deeper post-LN language
    model trained with it where Xavier's stayed at the unigram loss (bench/probe_embed_init.py).
    """

    def __init__(self, vocab_size: int, d_model: int, init: str = "normal"):
        super().__init__()
        table = torch.empty(vocab_size, d_model)
        if init == "normal":
            nn.init.normal_(table, 0.0, d_model ** -0.5)
        else:  # Xavier-uniform like every other matrix (as in The Annotated Transformer)
            nn.init.xavier_uniform_(table)
        self.weight = nn.Parameter(table)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, D)
        return F.embedding(ids, self.weight) * self.scale


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...)   (paper §3.5).

    A fixed table, so it is a non-persistent buffer: it is rebuilt on load rather than
    stored in checkpoints.
    """

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]               # (L, 1)
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
        angles = pos * inv_freq                                                  # (L, ceil(D/2))
        table = torch.zeros(max_len, d_model, dtype=torch.float64)
        table[:, 0::2] = torch.sin(angles)
        table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
        self.register_buffer("table", table.float(), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:  # (B, T) long -> (B, T, D)
        return self.table[positions]


class LearnedPositions(nn.Module):
    """A trainable (max_len, d_model) table; the paper found it "nearly identical" (Table 3, E).
    Drawn like the token table (init "normal": N(0, d^-1/2), as fairseq's learned positions;
    "xavier": uniform), and not scaled."""

    def __init__(self, d_model: int, max_len: int, init: str = "normal"):
        super().__init__()
        table = torch.empty(max_len, d_model)
        if init == "normal":
            nn.init.normal_(table, 0.0, d_model ** -0.5)
        else:
            nn.init.xavier_uniform_(table)
        self.weight = nn.Parameter(table)

    def forward(self, positions: Tensor) -> Tensor:  # (B, T) long -> (B, T, D)
        return F.embedding(positions, self.weight)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each (x_i, x_{i+d/2}) pair of q and k by angle pos * theta_i.

    Then q_m . k_n depends on positions only through m - n, so attention sees relative
    offsets and nothing is added to the residual stream. This uses the "half-split" pairing
    (GPT-NeoX); it is equivalent to RoFormer's interleaved pairing up to a fixed
    permutation of the head dimensions, which the projections can absorb.
    Angles are computed on the fly, so RoPE has no max_len.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # theta_i
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, T, d_k), positions (B, T) -> x rotated, same shape and dtype."""
        dtype = torch.promote_types(x.dtype, torch.float32)             # rotate in >= fp32
        angles = positions[:, None, :, None].to(dtype) * self.inv_freq.to(dtype)   # (B, 1, T, d_k/2)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.to(dtype).chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.to(x.dtype)


def additive_positions(cfg: ModelConfig) -> nn.Module | None:
    """The module whose output is added to the token embeddings, or None (for "none" and "rope")."""
    if cfg.pos_encoding == "sinusoidal":
        return SinusoidalPositions(cfg.d_model, cfg.max_len)
    if cfg.pos_encoding == "learned":
        return LearnedPositions(cfg.d_model, cfg.max_len, cfg.embed_init)
    return None
