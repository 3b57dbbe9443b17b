"""Turn encoded splits into padded tensors: token-budget batches with length bucketing.

A batch is a dict of LongTensors:
  encoder_decoder  src (B,S)  tgt_in (B,T)  tgt_out (B,T)        loss on tgt_out != PAD
  decoder_only     src None   tgt_in (B,L)  tgt_out (B,L)        L = S + 1 + T: source, BOS, target;
                                                                  loss only where the target is predicted
  language model   src None   tgt_in (B,L)  tgt_out (B,L)        contiguous windows of the token stream
Batch order is a pure function of (seed, epoch), so the data position needed to resume exactly
is just (epoch, index into that epoch's batch list).

Static shapes (train.length_buckets > 0): every sequence is padded up to a fixed grid of lengths
and every batch of a bucket has the same number of rows, so a GPU step meets only a few distinct
shapes (torch.compile compiles each once; see seq2seq_bucket_batches). A batch plan is then
(indices, length, rows); with dynamic shapes it is (indices, None, None).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..study.config import bucket_length  # noqa: F401  (the grid lives beside the positions check)
from ..data.tokens import BOS, EOS, PAD, load_sequences


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


def _padded_len(data: Seq2SeqData, i: int, arch: str) -> int:
    """Columns example i occupies in a batch (see collate_seq2seq)."""
    if arch == "decoder_only":
        return len(data.src[i]) + len(data.tgt[i]) + 1
    return max(len(data.src[i]), len(data.tgt[i]) + 1)


def seq2seq_bucket_batches(data: Seq2SeqData, batch_tokens: int, arch: str, per_octave: int, seed: int | None,
                           epoch: int = 0) -> list[tuple[list[int], int | tuple[int, int], int]]:
    """Static-shape batch plans (indices, length, rows): each example goes to the bucket of its
    length rounded up by bucket_length; a bucket of n examples is cut into the fewest batches of
    at most batch_tokens // length rows, all with the same row count (the last is filled with
    empty rows). Bucket membership depends on lengths only, so every epoch has the same shapes,
    one per bucket; only the order of examples within buckets and of the batches is shuffled.

    encoder_decoder: length is (source columns, target columns), each the grid length of the
    bucket's longest source / target, so a long article does not pad its short summary."""
    n = len(data)
    lengths = np.array([bucket_length(_padded_len(data, i, arch), per_octave) for i in range(n)], dtype=np.int64)
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    order = rng.permutation(n) if rng is not None else np.arange(n)
    plans = []
    for length in np.unique(lengths):
        members = order[lengths[order] == length]
        shape = int(length)
        if arch == "encoder_decoder":
            shape = (bucket_length(max(len(data.src[i]) for i in members), per_octave),
                     bucket_length(max(len(data.tgt[i]) + 1 for i in members), per_octave))
        cap = max(1, batch_tokens // int(length))
        n_batches = -(-len(members) // cap)
        rows = -(-len(members) // n_batches)
        plans += [(members[b * rows:(b + 1) * rows].tolist(), shape, rows) for b in range(n_batches)]
    if rng is not None:
        plans = [plans[i] for i in rng.permutation(len(plans))]
    return plans


def pad_rows(rows: list[np.ndarray], length: int | None = None, n_rows: int | None = None) -> torch.Tensor:
    """Right-padded (n_rows, length) tensor; defaults: as many rows as given, the longest row."""
    length = length or max(len(r) for r in rows)
    out = np.full((n_rows or len(rows), length), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def collate_seq2seq(data: Seq2SeqData, idx: list[int], arch: str, length: int | tuple[int, int] | None = None,
                    rows: int | None = None) -> dict:
    """length/rows: pad to that static shape (empty rows are all PAD, so they carry no loss);
    encoder_decoder takes (source, target) lengths."""
    if arch == "decoder_only":
        # One causal sequence: source (ends in EOS), BOS as separator, target, EOS.
        seqs = [np.concatenate([data.src[i], [BOS], data.tgt[i], [EOS]]) for i in idx]
        inp = pad_rows([s[:-1] for s in seqs], length, rows)
        out = pad_rows([s[1:] for s in seqs], length, rows)
        for row, i in enumerate(idx):  # no loss on predicting the source or the separator
            out[row, : len(data.src[i])] = PAD
        return {"src": None, "tgt_in": inp, "tgt_out": out}
    src_len, tgt_len = length if isinstance(length, tuple) else (length, length)
    return {
        "src": pad_rows([data.src[i] for i in idx], src_len, rows),
        "tgt_in": pad_rows([np.concatenate([[BOS], data.tgt[i]]) for i in idx], tgt_len, rows),
        "tgt_out": pad_rows([np.concatenate([data.tgt[i], [EOS]]) for i in idx], tgt_len, rows),
    }


def pad_slots(batch: dict) -> tuple[int, int]:
    """(PAD slots, all slots) of the model's inputs: the compute spent on padding."""
    inputs = [t for t in (batch["src"], batch["tgt_in"]) if t is not None]
    return sum(int((t == PAD).sum()) for t in inputs), sum(t.numel() for t in inputs)


# ---------------------------------------------------------------------------------------------
# Language modelling


def lm_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Start offsets of windows of seq_len+1 tokens overlapping by one, so every token after
    the first is predicted exactly once (the last window may be short)."""
    return np.arange(0, max(1, len(stream) - 1), seq_len)


def lm_batches(n_windows: int, rows: int, seed: int | None, epoch: int = 0) -> list[list[int]]:
    order = np.arange(n_windows) if seed is None else np.random.default_rng([seed, epoch]).permutation(n_windows)
    return [order[i: i + rows].tolist() for i in range(0, n_windows, rows)]


def collate_lm(stream: np.ndarray, starts: np.ndarray, idx: list[int], seq_len: int, rows: int | None = None) -> dict:
    """rows: pad to the static shape (rows, seq_len). `unpadded` marks a batch of full windows
    only: the model may then use plain causal attention with no mask (is_causal SDPA)."""
    chunks = [stream[starts[i]: starts[i] + seq_len + 1] for i in idx]
    length = seq_len if rows else None
    unpadded = all(len(c) == seq_len + 1 for c in chunks) and (rows or len(idx)) == len(idx)
    return {"src": None, "tgt_in": pad_rows([c[:-1] for c in chunks], length, rows),
            "tgt_out": pad_rows([c[1:] for c in chunks], length, rows), "unpadded": unpadded}


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# The training stream and its prefetcher


def batch_stream(plans_for_epoch, collate, epoch: int, index: int):
    """Yields (epoch, index of the next batch, collated batch) forever, from data position
    (epoch, index): the position a resumed run saved. plans_for_epoch(e) -> that epoch's plans;
    collate(plan) -> batch. A pure function of its arguments, so a background thread may run it."""
    while True:
        plans = plans_for_epoch(epoch)
        for i in range(index, len(plans)):
            yield epoch, i + 1, collate(plans[i])
        epoch, index = epoch + 1, 0


class Prefetcher:
    """Runs an iterator in a background thread `depth` items ahead, pinning each batch's tensors
    (pin=True) so the copy to the GPU can run asynchronously (to_device uses non_blocking). The
    items are the iterator's own, in its order: training sees the same batches with or without it."""

    _END = object()

    def __init__(self, iterator, depth: int = 2, pin: bool = False):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iterator, pin), daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, iterator, pin: bool) -> None:
        try:
            for item in iterator:
                if pin:  # item = (..., batch dict)
                    item = item[:-1] + ({k: (v.pin_memory() if isinstance(v, torch.Tensor) else v)
                                         for k, v in item[-1].items()},)
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
            return
        self._put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def close(stream) -> None:
    """Stop a Prefetcher's thread; a plain generator needs nothing."""
    if isinstance(stream, Prefetcher):
        stream.close()
