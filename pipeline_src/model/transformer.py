"""The full model: embeddings -> encoder and/or decoder stack -> output projection (paper §3).

Three architectures share every component:

  encoder_decoder  the paper's model: encoder over the source, decoder with causal
                   self-attention and cross-attention over the encoder memory
  decoder_only     one causal stack (no cross-attention); seq2seq is done by feeding
                   "source <bos> target" as one sequence
  encoder_only     one bidirectional stack; as a language model it sees the token it is
                   predicting, which is the deliberate "leaking" ablation

Masks are built boolean (True = may attend) and turned into additive float masks once per
pass. Pad tokens (== pad_id) are masked as keys everywhere. Positions count real tokens only
(see positions_from_mask), so a sequence gets the same positions whether it is left-padded,
right-padded or not padded at all.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from .attention import additive_mask, compute_dtype
from .config import ModelConfig
from .copy import CopyAttention
from .layers import Decoder, Encoder
from .positions import TokenEmbedding, additive_positions, positions_from_mask


def causal_mask(n_new: int, n_total: int, device: torch.device | None = None) -> Tensor:
    """(n_new, n_total) bool: the last n_new positions of a length-n_total sequence may attend
    to themselves and everything before them (§3.2.3: "prevent leftward information flow").
    With a KV cache the n_total - n_new earlier keys come from the cache."""
    return torch.ones(n_new, n_total, dtype=torch.bool, device=device).tril(diagonal=n_total - n_new)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tgt_embed = TokenEmbedding(cfg.vocab_size, d, cfg.embed_init)
        # With a shared vocabulary, one table serves source, target and output (§3.4).
        untied_src = cfg.arch == "encoder_decoder" and not cfg.tie_embeddings
        self.src_embed = TokenEmbedding(cfg.vocab_size, d, cfg.embed_init) if untied_src else None
        self.positions = additive_positions(cfg)   # one table shared by both stacks; None for none/rope
        self.embed_dropout = nn.Dropout(cfg.dropout)  # on the sum of embeddings and positions (§5.4)
        self.encoder = Encoder(cfg, cfg.enc_layers) if cfg.arch != "decoder_only" else None
        self.decoder = (Decoder(cfg, cfg.dec_layers, cross=cfg.arch == "encoder_decoder")
                        if cfg.arch != "encoder_only" else None)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.copy = CopyAttention(d) if cfg.copy_attention else None
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        # Xavier-uniform for every matrix, zero biases, as the reference implementations
        # (tensor2tensor, The Annotated Transformer, torch.nn.Transformer) do; the embedding
        # tables already did so when built. Modules are visited in construction order, so a
        # fixed torch.manual_seed gives a fixed model.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def leaks_future(self) -> bool:
        """True when the model, used as a language model, can see the token it predicts."""
        return self.cfg.arch == "encoder_only"

    # --- embeddings -------------------------------------------------------------------------

    def embed(self, ids: Tensor, side: str = "tgt", positions: Tensor | None = None) -> Tensor:
        """(B, T) ids -> (B, T, D) = Dropout(Embedding(ids) * sqrt(d_model) + PE(positions)).

        positions default to those of ids read as a complete sequence."""
        table = self.src_embed if side == "src" and self.src_embed is not None else self.tgt_embed
        x = table(ids)
        if self.positions is not None:
            if positions is None:
                positions = positions_from_mask(ids != self.cfg.pad_id)
            x = x + self.positions(positions)
        x = self.embed_dropout(x)
        # model.residual_dtype "compute": the residual stream starts in autocast's dtype (bf16)
        return x.to(compute_dtype(x)) if self.cfg.residual_dtype == "compute" else x

    # --- the two halves ---------------------------------------------------------------------

    def encode(self, src: Tensor, unpadded: bool = False) -> tuple[Tensor, Tensor]:
        """src (B, S) ids -> (memory (B, S, D), src_key_mask (B, S) bool True = real token).

        Bidirectional: every token attends to every real token. For encoder_only this is the
        whole model minus the output projection. unpadded: the caller knows src holds no pad
        (asking the tensor would stall the host), so no mask is needed."""
        if self.encoder is None:
            raise ValueError(f"model.arch {self.cfg.arch} has no encoder")
        key_mask = src != self.cfg.pad_id
        x = self.embed(src, "src" if self.cfg.arch == "encoder_decoder" else "tgt")
        mask = None if unpadded else additive_mask(key_mask[:, None, None, :], compute_dtype(x))  # (B, 1, 1, S)
        memory = self.encoder(x, mask, positions_from_mask(key_mask))
        return memory, key_mask

    def decode(self, tgt: Tensor, memory: Tensor | None = None, memory_mask: Tensor | None = None,
               cache: list[dict] | None = None, start: int = 0, unpadded: bool = False,
               src: Tensor | None = None, copy_keys: Tensor | None = None) -> Tensor:
        """Logits for positions start.. of the target sequence tgt (B, T) -> (B, T - start, V).

        tgt is always the whole sequence so far (masks and positions depend on all of it), but
        only tgt[:, start:] is run through the stack: with a cache from new_cache() the keys and
        values of tgt[:, :start] were stored by earlier calls. Without a cache, start must be 0.
        encoder_only runs its bidirectional stack here (no cache possible: every new token
        changes every earlier position's representation).
        With model.copy_attention the result is log-probabilities (copy.py) and the call needs
        the memory, its mask and the source ids src (B, S) at every step, cached or not; copy_keys
        (self.copy.keys(memory)) spares recomputing the copy layer's keys of the memory.
        unpadded (no cache): tgt holds no pad, so self-attention is plain causal attention with
        no mask tensor (SDPA's is_causal path, flash-capable); the result is the same."""
        cfg = self.cfg
        if cache is None and start != 0:
            raise ValueError("decode: start > 0 needs the cache that holds tgt[:, :start]")
        if cfg.arch == "encoder_only":
            if cache is not None:
                raise ValueError("model.arch encoder_only is bidirectional and cannot use a KV cache")
            h, _ = self.encode(tgt, unpadded)
            return self.lm_head(h)
        T = tgt.size(1)
        key_mask = tgt != cfg.pad_id                                          # (B, T)
        positions = positions_from_mask(key_mask)[:, start:]                  # (B, T_new)
        if cfg.arch == "encoder_decoder" and memory is None and not (cache and "k" in cache[0]["cross"]):
            raise ValueError("model.arch encoder_decoder needs the encoder memory to decode")
        x = self.embed(tgt[:, start:], "tgt", positions)                      # (B, T_new, D)
        dtype = compute_dtype(x)
        if unpadded and cache is None:
            self_mask = None                                                  # causal, nothing padded
        else:
            self_mask = additive_mask(key_mask[:, None, None, :] & causal_mask(T - start, T, tgt.device),
                                      dtype)                                  # (B, 1, T_new, T)
        cross_mask = (additive_mask(memory_mask[:, None, None, :], dtype)
                      if memory_mask is not None else None)                   # (B, 1, 1, S)
        h = self.decoder(x, self_mask, positions, memory, cross_mask, cache)
        logits = self.lm_head(h)                                              # (B, T_new, V)
        if self.copy is None:
            return logits
        if memory is None or memory_mask is None or src is None:
            raise ValueError("model.copy_attention needs the encoder memory, its mask and the source ids "
                             "at every decoding step")
        return self.copy(logits, h, memory, memory_mask, src, copy_keys)

    def decode_static(self, ids: Tensor, positions: Tensor, self_mask: Tensor, memory: Tensor | None,
                      cross_mask: Tensor | None, cache: list[dict]) -> Tensor:
        """Logits (N, T, V) of new tokens ids (N, T) at `positions`, against a static cache
        (evaluate/static_decode.py) that the call writes at its write_at slots; self_mask (N, 1, T, L)
        additive over all L cache slots. Everything is given, nothing inferred from the ids, so
        every decoding step has the same shapes (what a CUDA graph needs)."""
        if self.copy is not None:
            raise ValueError("static decoding does not support model.copy_attention: use eval.decoding host")
        x = self.embed(ids, "tgt", positions)
        return self.lm_head(self.decoder(x, self_mask, positions, memory, cross_mask, cache))

    def new_cache(self) -> list[dict]:
        """Empty per-layer key/value caches for incremental decoding with decode()."""
        if self.decoder is None:
            raise ValueError(f"model.arch {self.cfg.arch} cannot decode incrementally")
        return self.decoder.new_cache()

    # --- public entry points ----------------------------------------------------------------

    def forward(self, src: Tensor | None, tgt: Tensor, unpadded: bool = False) -> Tensor:
        """encoder_decoder: src (B,S) ids, tgt (B,T) decoder input ids -> logits (B,T,V).
        decoder_only: src must be None, tgt (B,T) -> causal logits (B,T,V).
        encoder_only: src must be None, tgt (B,T) -> bidirectional logits (B,T,V) (for LM this
        SEES THE FUTURE; it is allowed deliberately as a 'leaking' ablation).
        Pad positions (== pad_id) are masked as keys everywhere. unpadded=True promises that
        tgt holds no pad (language-model windows): attention then runs without mask tensors."""
        if self.cfg.arch == "encoder_decoder":
            if src is None:
                raise ValueError("model.arch encoder_decoder needs src")
            memory, memory_mask = self.encode(src)
            return self.decode(tgt, memory, memory_mask, unpadded=unpadded, src=src)
        if src is not None:
            raise ValueError(f"model.arch {self.cfg.arch} takes src=None (put everything in tgt)")
        return self.decode(tgt, unpadded=unpadded)

    @torch.no_grad()
    def attention_weights(self, src: Tensor | None, tgt: Tensor) -> dict[str, Tensor]:
        """Runs forward once in eval mode and returns {'encoder.0.self': (B,H,S,S),
        'decoder.0.self': (B,H,T,T), 'decoder.0.cross': (B,H,T,S), ...} for every layer.
        (encoder_only's single stack is 'encoder', decoder_only's is 'decoder'.)"""
        named = {}
        for stack_name in ("encoder", "decoder"):
            stack = getattr(self, stack_name)
            for i, layer in enumerate(stack.layers if stack is not None else []):
                named[f"{stack_name}.{i}.self"] = layer.self_attn
                if getattr(layer, "cross_attn", None) is not None:
                    named[f"{stack_name}.{i}.cross"] = layer.cross_attn
        was_training = self.training
        self.eval()
        try:
            for attn in named.values():
                attn.store_weights = True
            self(src, tgt)
            return {name: attn.last_weights for name, attn in named.items()}
        finally:
            for attn in named.values():
                attn.store_weights, attn.last_weights = False, None
            self.train(was_training)


__all__ = ["Transformer", "causal_mask"]
