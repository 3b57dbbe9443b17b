"""A from-scratch Transformer (Vaswani et al. 2017) with the study's ablation switches.

    config.py       ModelConfig: every architectural choice, validated
    positions.py    token embeddings and sinusoidal / learned / rotary positions
    attention.py    scaled dot-product and multi-head attention, with a KV cache
    layers.py       feed-forward, encoder and decoder layers and stacks
    transformer.py  the model: encoder_decoder, decoder_only or encoder_only
    copy.py         copy attention: the pointer-generator output layer (summaries)
    decode.py       greedy and beam-search decoding (in static shapes for the GPU: evaluate/static_decode.py)
    accounting.py   parameter and FLOP counts
"""
from .accounting import batch_training_flops, count_parameters, flops_per_token
from .config import ModelConfig
from .decode import beam_search, greedy_decode
from .transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "greedy_decode", "beam_search", "count_parameters", "flops_per_token",
           "batch_training_flops"]
