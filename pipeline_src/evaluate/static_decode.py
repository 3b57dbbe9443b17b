"""Beam search in static shapes, for the GPU: same result as model.decode.beam_search.

model.decode.beam_search follows each sentence on the host: it drops finished sentences, grows the
key/value cache, and reads the step's finished hypotheses back every step. On a GPU that makes
decoding launch- and sync-bound (bench/results/h100/decode_b64.md: the cache barely helps). Here
every step has the same shapes and stays on the device:

  * rows: B sentences x K beams, all kept to the end; a finished sentence's rows keep computing
    and are ignored (its `done` flag masks every update);
  * the cache: fixed capacity L = prefix + longest length limit, written in place at the step's
    slot (model.attention.append_kv's static mode); a key mask over all L slots hides the unwritten ones;
  * bookkeeping: only each sentence's best hypothesis so far is kept (its normalised score,
    tokens and length), updated with tensor ops; the host looks at `done` every 8 steps only.

With cuda_graphs=True the decoder step (embedding, every layer, output projection, log-softmax)
is captured once as a CUDA graph and replayed: one launch per step instead of hundreds.

Ties and order follow model.decode.beam_search_nbest exactly (a later hypothesis replaces the best only
with a strictly higher score; within a step the lower candidate index wins), so the two agree
token for token up to floating-point rounding: attention here sums over all L slots, the
dynamic version over the filled ones (tests/test_model.py compares them).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..model.attention import additive_mask, compute_dtype
from ..model.decode import gnmt_length_penalty, length_limits
from ..model.positions import positions_from_mask
from ..model.transformer import Transformer

CHECK_EVERY = 8  # steps between host reads of "are all sentences done?"


def _next_log_probs(logits: Tensor, banned: Tensor) -> Tensor:
    """(N, V) float32 log-probabilities of the next token from logits (N, T, V); the banned ids
    (pad, bos: a device tensor, since a graph capture allows no host-to-device copy) never win."""
    return logits[:, -1].float().index_fill_(1, banned, float("-inf")).log_softmax(dim=-1)


class _Step:
    """The decoder step on static buffers: feed token (N, 1) at slot write_at, return (N, V)
    log-probabilities of the next token. Optionally captured and replayed as a CUDA graph."""

    def __init__(self, model: Transformer, cache: list[dict], key_ok: Tensor, cross_mask: Tensor | None,
                 banned: Tensor, dtype: torch.dtype, cuda_graphs: bool):
        self.model, self.cache, self.key_ok, self.cross_mask, self.dtype = model, cache, key_ok, cross_mask, dtype
        self.banned = banned
        N = key_ok.size(0)
        self.write_at = torch.zeros(1, dtype=torch.long, device=key_ok.device)  # the slot; shared with the cache
        self.token = torch.zeros(N, 1, dtype=torch.long, device=key_ok.device)
        self.position = torch.zeros(N, 1, dtype=torch.long, device=key_ok.device)
        self.use_graph, self.graph, self.out = cuda_graphs and key_ok.is_cuda, None, None

    def _run(self) -> Tensor:
        self.key_ok.index_fill_(1, self.write_at, True)                     # the new token is a key too
        mask = additive_mask(self.key_ok[:, None, None, :], self.dtype)     # (N, 1, 1, L)
        logits = self.model.decode_static(self.token, self.position, mask, None, self.cross_mask, self.cache)
        return _next_log_probs(logits, self.banned)

    def __call__(self, token: Tensor, position: Tensor, slot: int) -> Tensor:
        self.token.copy_(token[:, None])
        self.position.copy_(position[:, None])
        self.write_at.fill_(slot)
        if not self.use_graph:
            return self._run()
        if self.graph is None:
            # Warm up on a side stream (allocations, kernel selection), then capture. Both rewrite
            # the same slot with the same values the real replay writes, so they change nothing.
            # Autocast's weight cache must be off while capturing (the graph would keep its copies).
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.autocast("cuda", dtype=self.dtype, enabled=self.dtype != torch.float32,
                                                          cache_enabled=False):
                for _ in range(2):
                    self._run()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.autocast("cuda", dtype=self.dtype,
                                                              enabled=self.dtype != torch.float32, cache_enabled=False):
                self.out = self._run()
        self.graph.replay()
        return self.out


def _reorder_rows(cache: list[dict], gen: Tensor, rows: Tensor) -> None:
    """Beam reordering in place (a captured graph holds these buffers' addresses). The beams of one
    sentence share its cross-attention K/V, key mask and positions, so only the self-attention
    cache and the generated tokens move."""
    for layer in cache:
        for name in ("k_buf", "v_buf"):
            buf = layer["self"][name]
            buf.copy_(buf.index_select(0, rows))
    gen.copy_(gen.index_select(0, rows))


@torch.no_grad()
def beam_search_static(model: Transformer, src: Tensor, beam_size: int = 4, length_penalty: float = 0.6,
                       max_len: int | None = None, max_len_a: float = 1.2, max_len_b: int = 10,
                       cuda_graphs: bool = False) -> list[list[int]]:
    """The best hypothesis per sentence, as model.decode.beam_search (encoder_decoder and decoder_only)."""
    cfg = model.cfg
    if cfg.arch == "encoder_only":
        raise ValueError("beam_search_static: encoder_only has no causal decoder (use model.decode.beam_search)")
    if beam_size < 1:
        raise ValueError(f"beam_size ({beam_size}) must be >= 1")
    was_training = model.training
    model.eval()
    try:
        return _search(model, src, beam_size, length_penalty, max_len, max_len_a, max_len_b, cuda_graphs)
    finally:
        model.train(was_training)


def _prefill(model, src, K, T_max, cuda_graphs):
    """The beams' prefix (source and bos, or bos alone) in one pass, filling fresh caches with room
    for T_max more tokens. Returns (caches, the one-token step, first next-token log-probs (N, V),
    real prefix tokens per row (N,), prefix length P)."""
    cfg, device, B = model.cfg, src.device, src.size(0)
    N = B * K
    expand = torch.arange(B, device=device).repeat_interleave(K)                 # row b*K + k -> sentence b
    bos = torch.full((B, 1), cfg.bos_id, dtype=src.dtype, device=device)
    if cfg.arch == "encoder_decoder":
        memory, memory_mask = model.encode(src)                                  # (B, S, D), (B, S)
        memory = memory[expand]
        cross_bool = memory_mask[expand][:, None, None, :]
        prefix = bos[expand]                                                     # (N, 1)
    else:
        memory, cross_bool = None, None
        prefix = torch.cat((src, bos), dim=1)[expand]                            # (N, S + 1)
    P = prefix.size(1)
    L = P + T_max
    real = prefix != cfg.pad_id
    key_ok = torch.zeros(N, L, dtype=torch.bool, device=device)
    key_ok[:, :P] = real
    write_at = torch.arange(P, device=device)
    cache = model.new_cache()
    for layer in cache:
        layer["self"].update(capacity=L, write_at=write_at)

    dtype = compute_dtype(model.lm_head.weight)                                  # autocast's, or the weights'
    causal = torch.ones(P, L, dtype=torch.bool, device=device).tril()
    prefix_mask = additive_mask(key_ok[:, None, None, :] & causal, dtype)         # (N, 1, P, L)
    cross_mask = additive_mask(cross_bool, dtype) if cross_bool is not None else None
    logits = model.decode_static(prefix, positions_from_mask(real), prefix_mask, memory, cross_mask, cache)
    banned = torch.tensor([cfg.pad_id, cfg.bos_id], device=device)
    log_probs = _next_log_probs(logits, banned)                                  # (N, V)

    step = _Step(model, cache, key_ok, cross_mask, banned, dtype, cuda_graphs)
    for layer in cache:
        layer["self"]["write_at"] = step.write_at                               # steps write one slot
    n_prefix = real.sum(dim=1)                                                   # (N,) real prefix tokens
    return cache, step, log_probs, n_prefix, P


def _search(model, src, K, alpha, max_len, max_len_a, max_len_b, cuda_graphs) -> list[list[int]]:
    cfg, device, B = model.cfg, src.device, src.size(0)
    if B == 0:
        return []
    limits = length_limits(model, src, max_len, max_len_a, max_len_b)            # (B,)
    T_max = int(limits.max())                                                    # the one sync up front
    N = B * K
    cache, step, log_probs, n_prefix, P = _prefill(model, src, K, T_max, cuda_graphs)
    V = log_probs.size(-1)
    # Normalised scores in float64, as the host version divides Python floats: equal rankings.
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
    scores = torch.full((B, K), float("-inf"), device=device)                  # log p of each live beam
    scores[:, 0] = 0.0                         # only beam 0 starts alive (the K starts are identical)
    gen = torch.zeros(N, max(T_max, 1), dtype=torch.long, device=device)        # generated tokens per row
    best_score = torch.full((B,), float("-inf"), dtype=torch.float64, device=device)  # best finished hypothesis
    best_tokens = torch.zeros(B, max(T_max, 1), dtype=torch.long, device=device)
    best_len = torch.zeros(B, dtype=torch.long, device=device)
    n_finished = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    sentence = torch.arange(B, device=device)

    def offer(candidates: Tensor, origin: Tensor, length: int, allowed: Tensor) -> None:
        """Finished hypotheses candidates (B, C) (normalised scores, -inf = none) of rows
        b*K + origin[b, c], each `length` long: the first best of a sentence replaces its best
        hypothesis if strictly better."""
        top, c = candidates.max(dim=1)                                           # first maximum
        better = allowed & (top > best_score)
        rows = sentence * K + origin.gather(1, c[:, None]).squeeze(1)
        best_score.copy_(torch.where(better, top, best_score))
        best_tokens.copy_(torch.where(better[:, None], gen.index_select(0, rows), best_tokens))
        best_len.copy_(torch.where(better, torch.full_like(best_len, length), best_len))

    beams = torch.arange(K, device=device).expand(B, K)
    for t in range(T_max + 1):
        # Sentences at their length limit finish their live beams as they are (length t).
        at_limit = ~done & (limits <= t)
        live = at_limit[:, None] & scores.isfinite()
        offer(torch.where(live, scores.double() / gnmt_length_penalty(t, alpha), neg_inf), beams, t, at_limit)
        n_finished += live.sum(dim=1)
        done |= at_limit | (n_finished >= K)
        if t == T_max or (t % CHECK_EVERY == 0 and bool(done.all())):
            break
        candidates = (scores[:, :, None] + log_probs.view(B, K, V)).view(B, K * V)
        top_scores, top_ids = candidates.topk(min(2 * K, K * V), dim=1)          # (B, 2K)
        origin, token = top_ids // V, top_ids % V
        ends = token == cfg.eos_id
        # Candidates ending in eos within the top K finish (length t + 1 with the eos).
        hits = ends[:, :K] & top_scores[:, :K].isfinite() & ~done[:, None]
        offer(torch.where(hits, top_scores[:, :K].double() / gnmt_length_penalty(t + 1, alpha), neg_inf),
              origin[:, :K], t, ~done)
        n_finished += hits.sum(dim=1)
        # The best K candidates not ending in eos live on (each beam adds at most one eos).
        scores, pick = top_scores.masked_fill(ends, float("-inf")).topk(K, dim=1)
        rows = (sentence[:, None] * K + origin.gather(1, pick)).flatten()
        _reorder_rows(cache, gen, rows)
        new_token = token.gather(1, pick).flatten()                               # (N,)
        gen[:, t] = new_token
        log_probs = step(new_token, n_prefix + t, P + t)
    lengths = best_len.tolist()
    return [row[:n] for row, n in zip(best_tokens.tolist(), lengths)]
