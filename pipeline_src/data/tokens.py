"""Reading what the `bpe` stage wrote: the SentencePiece model and the encoded splits.

Layout of data/<study>/bpe/<task>/ (see pipeline_src/data/bpe.py):
  spm.model, spm.vocab                     SentencePiece BPE, fixed ids PAD/UNK/BOS/EOS = 0/1/2/3
  <split>.<side>.ids.npy      int32        every sequence of the split concatenated (no BOS/EOS)
  <split>.<side>.offsets.npy  int64 (n+1)  sequence i = ids[offsets[i]:offsets[i+1]]
  <split>.index.npy           int64 (n)    row of the filtered split each sequence comes from
  stats.json
`side` is `src` / `tgt` (translation, summarization) or `text` (lm). Trainers add BOS/EOS.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..common import reading

PAD, UNK, BOS, EOS = 0, 1, 2, 3
# The unknown piece is spelt "<UNK>", not SentencePiece's default "<unk>": PTB and WikiText
# (non-raw) contain the literal word "<unk>", and a piece with the same spelling makes
# SentencePiece drop the characters "<" and ">" from its alphabet (they would decode as " ⁇ ").
SPECIAL_PIECES = {"pad_piece": "<pad>", "unk_piece": "<UNK>", "bos_piece": "<s>", "eos_piece": "</s>"}


def sides_for(kind: str) -> tuple[str, ...]:
    return ("text",) if kind == "lm" else ("src", "tgt")


def load_arrays(bpe_dir: str | Path, split: str, side: str, mmap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets) of one split and side; ids memory-mapped by default."""
    bpe_dir = Path(bpe_dir)
    ids_path, offsets_path = bpe_dir / f"{split}.{side}.ids.npy", bpe_dir / f"{split}.{side}.offsets.npy"
    with reading(ids_path):
        ids = np.load(ids_path, mmap_mode="r" if mmap else None)
    with reading(offsets_path):
        offsets = np.load(offsets_path)
        if len(offsets) and offsets[-1] != len(ids):  # a torn id array can still be a valid .npy
            raise ValueError(f"the offsets end at {offsets[-1]}, the ids file holds {len(ids)}")
    return ids, offsets


def load_sequences(bpe_dir: str | Path, split: str, side: str) -> list[np.ndarray]:
    """Every sequence of a split and side, as int32 views into the (memory-mapped) id array."""
    ids, offsets = load_arrays(bpe_dir, split, side)
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def load_index(bpe_dir: str | Path, split: str) -> np.ndarray:
    """Row of the filtered split (data/<study>/filtered/<task>/<split>.parquet) of each sequence."""
    with reading(Path(bpe_dir) / f"{split}.index.npy"):
        return np.load(Path(bpe_dir) / f"{split}.index.npy")


def load_spm(bpe_dir: str | Path):
    import sentencepiece as spm

    with reading(Path(bpe_dir) / "spm.model"):
        return spm.SentencePieceProcessor(model_file=str(Path(bpe_dir) / "spm.model"))
