"""Scaled dot-product attention and multi-head attention (paper §3.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V                        (Eq. 1)
    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
        head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)                        (§3.2.2)

Masks are boolean with True = "this query may attend to this key", shaped to
broadcast against the (B, H, T_q, T_k) score matrix: (B, 1, 1, T_k) for key padding,
(B, 1, T_q, T_k) for padding combined with causality. An additive float mask (0 = allowed,
very negative = forbidden) is also accepted; the model converts its masks to that form once
per pass (additive_mask) rather than in every layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .positions import RotaryEmbedding


def mask_value(dtype: torch.dtype) -> float:
    """The score given to a forbidden key.

    Finite rather than -inf: a row with no allowed key at all (a pad query in a left-padded
    causal sequence) then gets uniform weights instead of 0/0 = NaN, and NaN in a pad row
    would leak into real rows through the next layer's (masked, but still multiplied) keys.
    Half of the dtype's minimum so that adding it to any real score cannot overflow to -inf.
    exp(mask_value - max_score) is exactly 0, so allowed rows are unaffected.
    """
    return torch.finfo(dtype).min / 2


def additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Boolean (True = may attend) -> float mask with 0 where allowed, mask_value elsewhere,
    in the dtype the scores will have (see compute_dtype). Converting once per pass rather
    than per attention call matters when decoding, where such small kernels dominate."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, mask_value(dtype))


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype attention scores will have for input x: autocast's when it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                                 dropout_p: float = 0.0, impl: str = "explicit",
                                 need_weights: bool = False, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    """Eq. 1 on q (B, H, T_q, d_k), k (B, H, T_k, d_k), v (B, H, T_k, d_v) -> (B, H, T_q, d_v).

    impl "explicit" writes the softmax out; "sdpa" calls torch's fused kernel, which never
    materialises the (T_q, T_k) weights, so asking for the weights always takes the
    explicit path. Both see the identical additive mask, hence identical semantics.
    is_causal (mask must be None, T_q == T_k): query i sees keys 0..i and nothing is padded;
    SDPA then needs no mask tensor at all and may pick the flash kernel.
    Returns (output, weights or None).
    """
    if is_causal:
        if mask is not None:
            raise ValueError("scaled_dot_product_attention: is_causal takes no mask")
        if impl == "sdpa" and not need_weights:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True), None
        T = q.size(-2)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    mask = additive_mask(mask, q.dtype)
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if impl == "sdpa" and not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None
    # Dividing by sqrt(d_k) keeps the logits' variance ~1 so softmax does not saturate (§3.2.1).
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))         # (B, H, T_q, T_k)
    if mask is not None:
        scores = scores + mask
    weights = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights


def append_kv(cache: dict, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Write this step's keys/values (B, H, T, d) into the layer's cache in place and return the
    whole cached (B, H, n + T, d) as views. The buffers are preallocated with room for 32 more
    positions, so a decoding step writes T positions instead of copying the whole past with a
    torch.cat (one reallocation every 32 steps). cache["k"]/["v"] are the filled part, cache["n"] its length.

    A static cache (evaluate/static_decode.py: "capacity" and "write_at" set) never changes shape: its
    zero-initialised buffers hold `capacity` positions, this call's K/V go to the positions in
    the device tensor write_at, and the whole buffers are returned (the mask hides unused slots)."""
    if "write_at" in cache:
        if "k_buf" not in cache:
            B, H, _, d = k.shape
            cache["k_buf"], cache["v_buf"] = (t.new_zeros(B, H, cache["capacity"], d) for t in (k, v))
        cache["k_buf"].index_copy_(2, cache["write_at"], k)
        cache["v_buf"].index_copy_(2, cache["write_at"], v)
        return cache["k_buf"], cache["v_buf"]
    n, T = cache.get("n", 0), k.size(2)
    buf = cache.get("k_buf")
    if buf is None or n + T > buf.size(2):
        capacity = n + T + 32  # beam search re-gathers the buffer every step: little slack
        k_buf, v_buf = (t.new_empty(t.size(0), t.size(1), capacity, t.size(3)) for t in (k, v))
        if n:
            k_buf[:, :, :n], v_buf[:, :, :n] = cache["k"], cache["v"]
        cache["k_buf"], cache["v_buf"] = k_buf, v_buf
    cache["k_buf"][:, :, n:n + T] = k
    cache["v_buf"][:, :, n:n + T] = v
    cache["n"] = n + T
    cache["k"], cache["v"] = cache["k_buf"][:, :, :n + T], cache["v_buf"][:, :, :n + T]
    return cache["k"], cache["v"]


def reorder_kv(cache: dict, rows: Tensor) -> None:
    """New row i of a layer's cache is old row rows[i] (beam search): one gather of each buffer
    (copying back into the old buffer instead measured slower on CPU)."""
    if "k_buf" not in cache:  # cross-attention: K/V of the memory, computed once
        for name in ("k", "v"):
            if name in cache:
                cache[name] = cache[name][rows]
        return
    n = cache["n"]
    for name in ("k", "v"):
        buf = cache[f"{name}_buf"] = cache[f"{name}_buf"][rows]
        cache[name] = buf[:, :, :n]


class MultiHeadAttention(nn.Module):
    """h heads computed as one batched matmul: project once, then view D as (h, d_k).

    Self-attention fuses W^Q, W^K, W^V into one (D, 3D) projection; cross-attention fuses
    only W^K, W^V, because its keys and values come from the encoder memory, which is
    projected once and then reused for every decoding step.
    Weight layout matches torch.nn.MultiheadAttention's in_proj_weight ([Q; K; V] rows).
    """

    def __init__(self, cfg: ModelConfig, cross: bool = False):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim, self.cross = cfg.n_heads, cfg.head_dim, cross
        self.impl, self.attention_dropout = cfg.attention_impl, cfg.attention_dropout
        if cross:
            self.q_proj = nn.Linear(d, d)
            self.kv_proj = nn.Linear(d, 2 * d)
        else:
            self.qkv_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)                                    # W^O
        # Rotary positions only make sense between positions of one sequence, never across
        # the source/target boundary, so cross-attention gets none.
        self.rope = RotaryEmbedding(cfg.head_dim) if cfg.pos_encoding == "rope" and not cross else None
        self.store_weights = False            # set to keep the last attention map (for figures)
        self.last_weights: Tensor | None = None

    def _heads(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, H, T, d_k)
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None,
                positions: Tensor | None = None, cache: dict | None = None, is_causal: bool = False) -> Tensor:
        """x (B, T, D) queries; context (B, S, D) memory for cross-attention (ignored when its
        K/V are already cached); positions (B, T) for RoPE; cache: a dict owned by this layer
        for incremental decoding. Self-attention appends this call's K/V to it; cross-attention
        fills it once. is_causal: see scaled_dot_product_attention. Returns (B, T, D)."""
        B, T, D = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x))
            if cache is not None and "k" in cache:
                k, v = cache["k"], cache["v"]
            else:
                k, v = (self._heads(t) for t in self.kv_proj(context).split(D, dim=-1))
                if cache is not None:
                    cache["k"], cache["v"] = k, v
        else:
            q, k, v = (self._heads(t) for t in self.qkv_proj(x).split(D, dim=-1))
            if self.rope is not None:
                # Rotate before caching: a cached key keeps the position it was written at.
                q, k = self.rope(q, positions), self.rope(k, positions)
            if cache is not None:
                k, v = append_kv(cache, k, v)                               # (B, H, T_past + T, d_k)
        dropout_p = self.attention_dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, self.impl, self.store_weights,
                                                   is_causal)
        if self.store_weights:
            self.last_weights = weights.detach()
        out = out.transpose(1, 2).reshape(B, T, D)                         # Concat(head_1..head_h)
        return self.out_proj(out)
