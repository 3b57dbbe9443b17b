"""Greedy and beam-search decoding with a key/value cache.

Generating token t+1 only needs the new token's query against the keys and values of
tokens 0..t, and those never change in a causal model, so each decoder layer caches them:
the self-attention cache grows by one position per step, written in place into a preallocated
buffer (attention.append_kv) and the cross-attention K/V of the
encoder memory are computed once. A step then costs O(t) instead of re-running O(t^2)
attention over the whole prefix. use_cache=False does the full recomputation (tests,
benchmarks, and encoder_only, whose bidirectional states change with every new token).

Input conventions:
  encoder_decoder  src (B, S) padded source ids; the decoder starts from bos_id.
  decoder_only     src (B, S) padded source ids; the model is fed "src, bos_id" (bos is the
  encoder_only     separator) and continues that sequence. Padding may sit anywhere in src,
                   even between the source and bos: pads are masked as keys and positions
                   count real tokens only, so a padded row computes exactly what the
                   unpadded one would, and every row's newest token is in the last column.
Outputs are the generated target ids, without bos and without eos. pad and bos are never
generated (their logits are set to -inf before the softmax).
no_repeat_ngram n >= 2 bans any token that would complete an n-gram the row has already generated
(Paulus et al. 2018's trigram blocking for summaries, fairseq's --no-repeat-ngram-size); 0 is off.
Length limit per sentence: max_len if given, else floor(max_len_a * src_len + max_len_b),
where src_len counts the sentence's non-pad source tokens; for learned/sinusoidal positions
it is also clipped so no position exceeds the model's max_len.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .attention import reorder_kv
from .transformer import Transformer


class _DecodeState:
    """The growing token sequences of N decoding rows, with their encoder memory and cache."""

    def __init__(self, model: Transformer, src: Tensor, use_cache: bool, no_repeat_ngram: int = 0):
        cfg = model.cfg
        if no_repeat_ngram == 1 or no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram ({no_repeat_ngram}) must be 0 (off) or >= 2")
        self.model = model
        self.no_repeat_ngram = no_repeat_ngram
        B = src.size(0)
        bos = torch.full((B, 1), cfg.bos_id, dtype=src.dtype, device=src.device)
        if cfg.arch == "encoder_decoder":
            self.memory, self.memory_mask = model.encode(src)         # (B, S, D), (B, S)
            self.src = src if cfg.copy_attention else None             # copy attention points into it
            # the copy layer's keys of the memory: fixed per sentence, like the cross-attention K/V
            self.copy_keys = model.copy.keys(self.memory) if cfg.copy_attention else None   # (B, S, D)
            self.tokens = bos
        else:
            self.memory = self.memory_mask = self.src = self.copy_keys = None
            self.tokens = torch.cat((src, bos), dim=1)
        self.prefix_len = self.tokens.size(1)
        self.cache = model.new_cache() if use_cache and cfg.arch != "encoder_only" else None
        self.n_cached = 0   # tokens[:, :n_cached] already have their K/V in the cache

    @property
    def generated(self) -> Tensor:  # (N, t)
        return self.tokens[:, self.prefix_len:]

    def next_log_probs(self) -> Tensor:
        """(N, V) float32 log-probabilities of the next token, pad and bos excluded."""
        logits = self.model.decode(self.tokens, self.memory, self.memory_mask, self.cache, self.n_cached,
                                   src=self.src, copy_keys=self.copy_keys)
        if self.cache is not None:
            self.n_cached = self.tokens.size(1)
        logits = logits[:, -1].float()
        cfg = self.model.cfg
        logits[:, [cfg.pad_id, cfg.bos_id]] = float("-inf")
        self._ban_repeats(logits)
        return logits.log_softmax(dim=-1)

    def _ban_repeats(self, logits: Tensor) -> None:
        """Sets to -inf every token that would repeat an n-gram of its row (n = no_repeat_ngram)."""
        n, generated = self.no_repeat_ngram, self.generated                   # (N, t)
        if n == 0 or generated.size(1) < n:
            return
        earlier = generated.unfold(1, n - 1, 1)[:, :-1]                        # (N, t-n+1, n-1) with a successor
        followers = generated[:, n - 1:]                                       # (N, t-n+1) those successors
        repeats = (earlier == generated[:, None, -(n - 1):]).all(dim=-1)       # (N, t-n+1) same as the last n-1
        rows, cols = repeats.nonzero(as_tuple=True)
        logits[rows, followers[rows, cols]] = float("-inf")

    def append(self, tokens: Tensor) -> None:  # (N,)
        self.tokens = torch.cat((self.tokens, tokens[:, None]), dim=1)

    def reorder(self, rows: Tensor, within_sentence: bool = False) -> None:
        """Keep / duplicate / permute rows: new row i is old row rows[i] (beam search).

        within_sentence: every new row comes from a row of its own sentence (an ordinary beam
        step). The beams of one sentence share its encoder memory and cross-attention K/V, so
        those rows are already right and copying them would only cost time (a quarter of a
        cached beam search on CPU)."""
        self.tokens = self.tokens[rows]
        if self.memory is not None and not within_sentence:
            self.memory, self.memory_mask = self.memory[rows], self.memory_mask[rows]
            self.src = self.src[rows] if self.src is not None else None
            self.copy_keys = self.copy_keys[rows] if self.copy_keys is not None else None
        for layer_cache in self.cache or []:
            for part_name, part in layer_cache.items():
                if part_name == "cross" and within_sentence:
                    continue
                reorder_kv(part, rows)


def length_limits(model: Transformer, src: Tensor, max_len: int | None, max_len_a: float,
                  max_len_b: int) -> Tensor:
    """(B,) long: the most target tokens each sentence may generate (eos not counted)."""
    cfg = model.cfg
    src_len = (src != cfg.pad_id).sum(dim=1)
    if max_len is not None:
        limits = torch.full_like(src_len, max_len)
    else:
        limits = torch.floor(max_len_a * src_len.double() + max_len_b).long()
    if cfg.pos_encoding in ("learned", "sinusoidal"):
        # The last fed token sits at position (prefix tokens) + limit - 1, which must be < max_len.
        prefix = 1 if cfg.arch == "encoder_decoder" else src_len + 1
        room = cfg.max_len - prefix + 1
        limits = torch.minimum(limits, torch.as_tensor(room, device=limits.device).expand_as(limits))
    return limits.clamp(min=0)


def _as_lists(tokens: Tensor, limits: Tensor, eos_id: int) -> list[list[int]]:
    """Cut each row at its first eos and its length limit."""
    out = []
    for row, limit in zip(tokens.tolist(), limits.tolist()):
        row = row[:limit]
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


@torch.no_grad()
def greedy_decode(model: Transformer, src: Tensor, max_len: int, use_cache: bool = True,
                  no_repeat_ngram: int = 0) -> list[list[int]]:
    """Pick the most probable token at every step; each row stops at eos or after max_len tokens."""
    was_training = model.training
    model.eval()
    try:
        eos = model.cfg.eos_id
        limits = length_limits(model, src, max_len, 0.0, 0)
        state = _DecodeState(model, src, use_cache, no_repeat_ngram)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for t in range(int(limits.max()) if src.size(0) else 0):
            done |= limits <= t
            if bool(done.all()):
                break
            token = state.next_log_probs().argmax(dim=-1)            # (B,)
            token = token.masked_fill(done, eos)                     # finished rows idle on eos
            state.append(token)
            done |= token == eos
        return _as_lists(state.generated, limits, eos)
    finally:
        model.train(was_training)


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016, Eq. 14): lp(Y) = ((5 + |Y|) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(model: Transformer, src: Tensor, beam_size: int = 4, length_penalty: float = 0.6,
                max_len: int | None = None, max_len_a: float = 1.2, max_len_b: int = 10,
                use_cache: bool = True, no_repeat_ngram: int = 0) -> list[list[int]]:
    """The best hypothesis per sentence (see beam_search_nbest)."""
    nbest = beam_search_nbest(model, src, beam_size, length_penalty, max_len, max_len_a, max_len_b, use_cache,
                              no_repeat_ngram)
    return [hyps[0][1] for hyps in nbest]


@torch.no_grad()
def beam_search_nbest(model: Transformer, src: Tensor, beam_size: int = 4, length_penalty: float = 0.6,
                      max_len: int | None = None, max_len_a: float = 1.2, max_len_b: int = 10,
                      use_cache: bool = True, no_repeat_ngram: int = 0) -> list[list[tuple[float, list[int]]]]:
    """Beam search over the flattened (sentence, beam) rows. Returns, per sentence, every
    finished hypothesis as (log p(Y) / lp(|Y|), token ids), best first.

    Each step every live beam proposes its extensions; of the best 2K candidates per sentence,
    those ending in eos within the top K are finished (scored by log p(Y) / lp(|Y|), with |Y|
    counting the eos), and the best K not ending in eos live on. A sentence stops when it has K
    finished hypotheses or reaches its length limit (live beams are then finished as they are).
    With K = 1 this is exactly greedy decoding.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size ({beam_size}) must be >= 1")
    was_training = model.training
    model.eval()
    try:
        eos, K, device = model.cfg.eos_id, beam_size, src.device
        B = src.size(0)
        limits = length_limits(model, src, max_len, max_len_a, max_len_b).tolist()
        state = _DecodeState(model, src, use_cache, no_repeat_ngram)
        state.reorder(torch.arange(B, device=device).repeat_interleave(K))      # row b*K + k
        # Only beam 0 starts alive, so the K identical initial beams do not fill the beam.
        scores = torch.full((B, K), float("-inf"), device=device)             # (A, K) log p so far
        scores[:, 0] = 0.0
        active = list(range(B))            # the sentence of each group of K rows (bookkeeping on the host)
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]

        def finish(b: int, hyp: list[int], score: float, length: int) -> None:
            finished[b].append((score / gnmt_length_penalty(length, length_penalty), hyp))

        t = 0
        while active:
            # Sentences at their length limit finish their live beams as they are.
            at_limit = [a for a, b in enumerate(active) if limits[b] <= t]
            if at_limit:
                generated, live = state.generated.tolist(), scores.tolist()
                for a in at_limit:
                    for k in range(K):
                        if math.isfinite(live[a][k]):
                            finish(active[a], generated[a * K + k], live[a][k], t)
            # Drop sentences that are done: at their limit, or with K finished hypotheses.
            keep = [a for a, b in enumerate(active) if limits[b] > t and len(finished[b]) < K]
            if len(keep) < len(active):
                if not keep:
                    break
                kept = torch.tensor(keep, device=device)
                scores = scores[kept]
                state.reorder((kept[:, None] * K + torch.arange(K, device=device)).flatten())
                active = [active[a] for a in keep]
            A = len(active)
            log_probs = state.next_log_probs()                                   # (A*K, V)
            V = log_probs.size(-1)
            candidates = (scores[:, :, None] + log_probs.view(A, K, V)).view(A, K * V)
            top_scores, top_ids = candidates.topk(min(2 * K, K * V), dim=1)      # (A, 2K)
            origin, token = top_ids // V, top_ids % V
            ends = token == eos
            hits = (ends[:, :K] & top_scores[:, :K].isfinite()).nonzero().tolist()
            if hits:
                generated, origins, hit_scores = state.generated.tolist(), origin.tolist(), top_scores.tolist()
                for a, j in hits:
                    finish(active[a], generated[a * K + origins[a][j]], hit_scores[a][j], t + 1)
            # Each beam contributes at most one eos candidate, so >= K candidates remain.
            scores, pick = top_scores.masked_fill(ends, float("-inf")).topk(K, dim=1)   # (A, K)
            state.reorder((torch.arange(A, device=device)[:, None] * K + origin.gather(1, pick)).flatten(),
                          within_sentence=True)
            state.append(token.gather(1, pick).flatten())
            t += 1
        # sorted() is stable, so equal scores keep the order in which they finished.
        return [sorted(hyps, key=lambda h: -h[0]) for hyps in finished]
    finally:
        model.train(was_training)
