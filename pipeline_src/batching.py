"""Turn encoded splits into padded tensors: token-budget batches with length bucketing.

A batch is a dict of LongTensors:
  encoder_decoder  src (B,S)  tgt_in (B,T)  tgt_out (B,T)        loss on tgt_out != PAD
  decoder_only     src None   tgt_in (B,L)  tgt_out (B,L)        L = S + 1 + T: source, BOS, target;
                                                                  loss only where the target is predicted
  language model   src None   tgt_in (B,L)  tgt_out (B,L)        contiguous windows of the token stream
Batch order is a pure function of (seed, epoch), so the data position needed to resume exactly
is just (epoch, index into that epoch's batch list).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .data.tokens import BOS, EOS, PAD, load_sequences


@dataclass
class Seq2SeqData:
    src: list[np.ndarray]  # source ids, EOS appended, truncated
    tgt: list[np.ndarray]  # target ids (no BOS/EOS)

    def __len__(self):
        return len(self.src)


def load_seq2seq(bpe_dir, split: str, max_src_len: int, max_tgt_len: int, limit: int | None = None) -> Seq2SeqData:
    src = load_sequences(bpe_dir, split, "src")
    tgt = load_sequences(bpe_dir, split, "tgt")
    if limit is not None:
        src, tgt = src[:limit], tgt[:limit]
    src = [np.append(s[: max_src_len - 1], EOS).astype(np.int64) for s in src]
    tgt = [np.asarray(t[: max_tgt_len - 1], dtype=np.int64) for t in tgt]
    return Seq2SeqData(src, tgt)


def load_lm_stream(bpe_dir, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The split as one token stream with EOS closing every line; also each line's end offset."""
    lines = load_sequences(bpe_dir, split, "text")
    lengths = np.fromiter((len(x) + 1 for x in lines), dtype=np.int64, count=len(lines))
    stream = np.empty(int(lengths.sum()), dtype=np.int64)
    pos = 0
    for x in lines:
        stream[pos: pos + len(x)] = x
        stream[pos + len(x)] = EOS
        pos += len(x) + 1
    return stream, np.cumsum(lengths)


# ---------------------------------------------------------------------------------------------
# Sequence-to-sequence


def _example_len(data: Seq2SeqData, i: int, arch: str) -> int:
    if arch == "decoder_only":
        return len(data.src[i]) + len(data.tgt[i]) + 2
    return max(len(data.src[i]), len(data.tgt[i]) + 1)


def seq2seq_batches(data: Seq2SeqData, batch_tokens: int, arch: str, seed: int | None, epoch: int = 0) -> list[list[int]]:
    """Lists of example indices whose padded size (rows x longest) stays within batch_tokens.

    Examples are sorted by length inside shuffled buckets of ~100 batches, so padding is small
    but batches still differ from epoch to epoch. seed=None keeps file order (evaluation).
    """
    n = len(data)
    lengths = np.array([_example_len(data, i, arch) for i in range(n)])
    if seed is None:
        order = np.arange(n)
    else:
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(n)
        bucket = max(1, 100 * max(1, batch_tokens // max(1, int(lengths.mean()))))
        order = np.concatenate([chunk[np.argsort(lengths[chunk], kind="stable")]
                                for chunk in np.array_split(order, max(1, n // bucket))])
    batches, current, longest = [], [], 0
    for i in order:
        ln = int(lengths[i])
        if current and max(longest, ln) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(int(i))
        longest = max(longest, ln)
    if current:
        batches.append(current)
    if seed is not None:
        rng.shuffle(batches)
    return batches


def pad_rows(rows: list[np.ndarray]) -> torch.Tensor:
    out = np.full((len(rows), max(len(r) for r in rows)), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def collate_seq2seq(data: Seq2SeqData, idx: list[int], arch: str) -> dict:
    if arch == "decoder_only":
        # One causal sequence: source (ends in EOS), BOS as separator, target, EOS.
        seqs = [np.concatenate([data.src[i], [BOS], data.tgt[i], [EOS]]) for i in idx]
        inp = pad_rows([s[:-1] for s in seqs])
        out = pad_rows([s[1:] for s in seqs])
        for row, i in enumerate(idx):  # no loss on predicting the source or the separator
            out[row, : len(data.src[i])] = PAD
        return {"src": None, "tgt_in": inp, "tgt_out": out}
    return {
        "src": pad_rows([data.src[i] for i in idx]),
        "tgt_in": pad_rows([np.concatenate([[BOS], data.tgt[i]]) for i in idx]),
        "tgt_out": pad_rows([np.concatenate([data.tgt[i], [EOS]]) for i in idx]),
    }


# ---------------------------------------------------------------------------------------------
# Language modelling


def lm_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Start offsets of windows of seq_len+1 tokens overlapping by one, so every token after
    the first is predicted exactly once (the last window may be short)."""
    return np.arange(0, max(1, len(stream) - 1), seq_len)


def lm_batches(n_windows: int, rows: int, seed: int | None, epoch: int = 0) -> list[list[int]]:
    order = np.arange(n_windows) if seed is None else np.random.default_rng([seed, epoch]).permutation(n_windows)
    return [order[i: i + rows].tolist() for i in range(0, n_windows, rows)]


def collate_lm(stream: np.ndarray, starts: np.ndarray, idx: list[int], seq_len: int) -> dict:
    chunks = [stream[starts[i]: starts[i] + seq_len + 1] for i in idx]
    return {"src": None, "tgt_in": pad_rows([c[:-1] for c in chunks]), "tgt_out": pad_rows([c[1:] for c in chunks])}


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
