"""Copy attention: the pointer-generator output layer (See et al. 2017, §2.2) on the decoder.

A summary reuses many of its article's words. A plain Transformer must learn to reproduce a
source token through its output projection; with copy attention it can also point at it:

    a_t     = softmax(q(h_t) . k(m_s) / sqrt(D))          over the real source tokens s  (T, S)
    c_t     = sum_s a_t,s m_s                             the context it points at        (T, D)
    p_gen   = sigmoid(w . [h_t ; c_t] + b)                 generate (1) or copy (0)        (T, 1)
    P(w)    = p_gen P_vocab(w) + (1 - p_gen) sum_{s: src_s = w} a_t,s

h_t is the last decoder layer's output, m the encoder memory. Source and target share one
subword vocabulary, so a copied token is an ordinary vocabulary id (no extended vocabulary for
out-of-vocabulary words, which BPE does not have). The layer returns log P(w): everything
downstream (cross-entropy with label smoothing, log_softmax in decoding) gives the same result
on normalised log-probabilities as on logits, so the rest of the model is unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

# P(w) is a mixture of probabilities; this floor keeps log P finite where both parts underflow.
_TINY = 1e-30


class CopyAttention(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.query = nn.Linear(d_model, d_model, bias=False)
        self.key = nn.Linear(d_model, d_model, bias=False)
        self.gate = nn.Linear(2 * d_model, 1)

    def keys(self, memory: Tensor) -> Tensor:
        """k(m) (B, S, D): what each step's query is matched against. Decoding computes it once per
        sentence (decode.py, as the cross-attention K/V) and passes it back in as `keys`."""
        return self.key(memory.float())

    def forward(self, logits: Tensor, h: Tensor, memory: Tensor, memory_mask: Tensor, src: Tensor,
                keys: Tensor | None = None) -> Tensor:
        """logits (B, T, V) of the output projection, h (B, T, D) decoder states, memory (B, S, D),
        memory_mask (B, S) bool True = real source token, src (B, S) source ids, keys = keys(memory)
        if already computed -> log P (B, T, V)."""
        h, memory = h.float(), memory.float()                                  # mixing in fp32
        keys = self.keys(memory) if keys is None else keys                     # (B, S, D)
        scores = self.query(h) @ keys.transpose(1, 2) / math.sqrt(h.size(-1))  # (B, T, S)
        scores = scores.masked_fill(~memory_mask[:, None, :], float("-inf"))
        attn = scores.softmax(dim=-1)                                          # (B, T, S)
        context = attn @ memory                                                # (B, T, D)
        p_gen = torch.sigmoid(self.gate(torch.cat((h, context), dim=-1)))      # (B, T, 1)
        probs = p_gen * logits.float().softmax(dim=-1)                         # (B, T, V)
        index = src[:, None, :].expand(-1, h.size(1), -1)                      # (B, T, S)
        probs = probs.scatter_add(2, index, (1.0 - p_gen) * attn)
        return probs.clamp_min(_TINY).log()


__all__ = ["CopyAttention"]
