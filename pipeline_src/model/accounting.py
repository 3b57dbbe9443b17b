"""Parameter and FLOP counts, for tables and for model FLOPs utilisation (MFU).

FLOPs follow the usual convention (Kaplan et al. 2020; PaLM appendix B): a multiply-add is
2 FLOPs, only matrix multiplications are counted (embedding lookups, LayerNorm, softmax,
biases and residual adds are lower order), and attention's score matrix is counted in
full (no discount for the causal mask, which the kernels do not fully exploit either).
Training costs 3x the forward pass (backward = 2x forward).
"""
from __future__ import annotations

import torch.nn as nn

from .config import ModelConfig


def count_parameters(model: nn.Module) -> int:
    """Unique trainable parameters: model.parameters() yields a shared (tied) tensor once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def flops_per_token(cfg: ModelConfig, src_len: int, tgt_len: int) -> float:
    """Forward FLOPs of one training forward pass divided by the number of target tokens.

    With D = d_model, F = d_ff, V = vocab_size, S = src_len, T = tgt_len, one layer costs per
    token it processes, over a sequence of n tokens:

        projections  2 * 4D^2       (W^Q, W^K, W^V, W^O)
        FFN          2 * 2DF        (W_1, W_2)
        attention    2 * 2nD        (Q K^T and weights @ V, each n*D multiply-adds per query)

    encoder_decoder: the encoder runs over S tokens (n = S); each decoder layer runs over T
    tokens with self-attention (n = T) plus cross-attention: Q and O projections 2 * 2D^2 and
    attention over the memory 2 * 2SD per target token, and K, V projections of the memory
    2 * 2D^2 per *source* token. The output projection 2DV is paid per target token.

    Copy attention (copy.py) adds, per target token, its query 2D^2, its scores and context over
    the memory 2 * 2SD and its gate 2 * 2D, and per source token its key projection 2D^2.

    decoder_only / encoder_only: one stack over the single sequence of n = S + T tokens (the
    caller decides whether the separator counts in S), with the output projection at all n
    positions because the model produces logits everywhere; the total is divided by T.
    """
    D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    S, T = src_len, tgt_len
    if T <= 0:
        raise ValueError(f"flops_per_token: tgt_len ({T}) must be positive")

    def layer(n: int) -> float:   # self-attention + FFN layer, per token, sequence length n
        return 2 * 4 * D * D + 2 * 2 * D * F + 2 * 2 * n * D

    if cfg.arch == "encoder_decoder":
        encoder = cfg.enc_layers * S * layer(S)
        cross = cfg.dec_layers * (T * (2 * 2 * D * D + 2 * 2 * S * D) + S * 2 * 2 * D * D)
        decoder = cfg.dec_layers * T * layer(T) + cross
        total = encoder + decoder + T * 2 * D * V
        if cfg.copy_attention:
            total += T * (2 * D * D + 2 * 2 * S * D + 2 * 2 * D) + S * 2 * D * D
    else:
        n = S + T
        n_layers = cfg.dec_layers if cfg.arch == "decoder_only" else cfg.enc_layers
        total = n_layers * n * layer(n) + n * 2 * D * V
    return float(total) / T


def batch_training_flops(cfg: ModelConfig, src_shape: tuple[int, int] | None, tgt_shape: tuple[int, int]) -> float:
    """Training FLOPs (3x forward) of one batch at its real, padded shapes: what the kernels
    computed, as opposed to flops_per_token's figure at the maximum lengths.

    encoder_decoder: src (B,S) and decoder input (B,T). decoder_only / encoder_only: src_shape
    None and the single sequence (B,L) that holds source and target (train/batching.py), every
    position of which goes through every layer and the output projection.
    """
    rows, length = tgt_shape
    src_len = src_shape[1] if src_shape is not None else 0
    if length <= 0 or rows <= 0:
        return 0.0
    return 3.0 * rows * length * flops_per_token(cfg, src_len, length)
