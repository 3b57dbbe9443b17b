"""Stage `bpe`: filtered task data -> data/<study>/bpe/<task>/<filter_variant>/<bpe_variant>/ (SentencePiece + encoded splits).

* One SentencePiece model per task and data variant (a cell may override `bpe`, e.g. a
  tokenizer ablation: `model_type` bpe | unigram | char | word, `vocab_size`), trained on the filtered train split: src and tgt
  together for translation/summarization (one shared vocabulary, so embeddings can be tied),
  the text for lm. `bpe:` params: vocab_size, character_coverage, max_sentences (training
  texts are subsampled to this many with a fixed seed, in corpus order). Fixed ids
  pad=0, unk=1, bos=2, eos=3. Trained in memory with one thread: the same input and params
  give a byte-identical spm.model.
* Every split is encoded once (batched `datasets.map`; worker processes only with PIPELINE_DATA_PROCS, see data.num_proc_for) into flat
  int32 id arrays + int64 offsets (see pipeline_src/data/tokens.py). Ids carry no BOS/EOS.
* `max_src_tokens` / `max_tgt_tokens` drop train rows longer than that many BPE tokens (the
  original CNN/DailyMail study kept articles under 1640). `<split>.index.npy` maps each kept
  sequence to its row in the filtered parquet, so references stay aligned.
"""
from __future__ import annotations

import io
import re
import time
from pathlib import Path

import numpy as np

from ..common import (StageError, atomic_dir, atomic_write_bytes, atomic_write_json, atomic_write_text, progress,
                     provenance, save_array)
from ..study.config import ConfigError
from ..study.paths import output_path
from . import SPLITS, log, num_proc_for, quiet_datasets, read_parquet
from .tokens import BOS, EOS, PAD, SPECIAL_PIECES, UNK, sides_for

MAX_SENTENCE_BYTES = 1 << 16  # longer training lines are cut at whitespace (BPE merges never cross it)
SAMPLE_SEED = 0
ENCODE_BATCH = 1000


def _training_lines(texts: list[str]):
    """Lines SentencePiece trains on: each text split at newlines, over-long lines chunked."""
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            if len(line) * 4 <= MAX_SENTENCE_BYTES or len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES:
                yield line
                continue
            chunk, size = [], 0
            for word in line.split():
                b = len(word.encode("utf-8")) + 1
                if chunk and size + b > MAX_SENTENCE_BYTES:
                    yield " ".join(chunk)
                    chunk, size = [], 0
                chunk.append(word)
                size += b
            if chunk:
                yield " ".join(chunk)


def train_spm(texts: list[str], *, vocab_size: int, character_coverage: float, max_sentences: int,
              task: str = "?", study_path: str = "params", model_type: str = "bpe") -> tuple[bytes, dict]:
    """Train a SentencePiece model in memory. Returns (model bytes, training statistics).
    BPE keeps vocab_size exact (hard limit, as before); for unigram, char and word it is an
    upper bound (a char model has one piece per character; unigram and word stop at what the
    text supports), and the size actually reached is in stats.json."""
    import sentencepiece as spm

    n_texts = len(texts)
    if n_texts > max_sentences:
        rng = np.random.default_rng(SAMPLE_SEED)
        texts = [texts[i] for i in np.sort(rng.choice(n_texts, size=max_sentences, replace=False))]
    lines = list(_training_lines(texts))
    if not lines:
        raise StageError(f"bpe {task}: the train split has no text to train BPE on")
    n_bytes = sum(len(line.encode("utf-8")) for line in lines)
    buf = io.BytesIO()
    t0 = time.time()
    bar = progress(lines, desc=f"bpe {task} training", unit="line")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(bar), model_writer=buf, model_type=model_type, vocab_size=vocab_size,
            character_coverage=character_coverage, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            **SPECIAL_PIECES, input_sentence_size=0, shuffle_input_sentence=False, num_threads=1,
            max_sentence_length=MAX_SENTENCE_BYTES, hard_vocab_limit=model_type == "bpe", minloglevel=2)
    except RuntimeError as e:
        msg = str(e)
        m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", msg)
        if m:
            raise StageError(f"bpe {task}: {study_path}: tasks.{task}.bpe.vocab_size = {m.group(1)} is more than "
                             f"SentencePiece can make from this train split (at most {m.group(2)}); lower it") from None
        m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", msg)
        if m:
            raise StageError(f"bpe {task}: {study_path}: tasks.{task}.bpe.vocab_size = {m.group(1)} is below the "
                             f"{m.group(2)} characters + special pieces the train split needs; raise it or lower "
                             f"tasks.{task}.bpe.character_coverage") from None
        raise StageError(f"bpe {task}: SentencePiece training failed: {' '.join(msg.split())[:300]}") from None
    finally:
        bar.close()
    seconds = max(time.time() - t0, 1e-9)
    return buf.getvalue(), {"texts": n_texts, "texts_used": len(texts), "lines": len(lines),
                            "bytes": n_bytes, "seconds": seconds, "mb_per_s": n_bytes / 1e6 / seconds}


def vocab_text(sp) -> str:
    """spm.vocab in SentencePiece's own format: piece <tab> score, one per id."""
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))


# --------------------------------------------------------------------------- encoding

_SP_CACHE: dict = {}


def _encode_batch(batch, model_file: str, column: str):
    sp = _SP_CACHE.get(model_file)
    if sp is None:
        import sentencepiece as spm

        sp = _SP_CACHE[model_file] = spm.SentencePieceProcessor(model_file=model_file)
    return {"ids": sp.encode(batch[column], out_type=int)}


def encode_texts(table, column: str, model_file: str, desc: str = "encode") -> tuple[np.ndarray, np.ndarray]:
    """Encode one text column -> (int32 ids of all rows concatenated, int64 offsets of length n+1).
    Batched `datasets.map`, in-process unless PIPELINE_DATA_PROCS asks for workers (the output
    keeps row order either way)."""
    import datasets
    import pyarrow as pa

    ds = datasets.Dataset(datasets.table.InMemoryTable(pa.table({column: table.column(column)})))
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))})
    ds = ds.map(_encode_batch, batched=True, batch_size=ENCODE_BATCH, num_proc=num_proc_for(len(ds)),
                fn_kwargs={"model_file": model_file, "column": column}, remove_columns=[column],
                features=features, load_from_cache_file=False, desc=desc)
    col = ds.data.table.column("ids").combine_chunks()
    if isinstance(col, pa.ChunkedArray):  # pyarrow versions differ on the return type
        col = col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks)
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    values = values[offsets[0]:offsets[-1]]
    return np.ascontiguousarray(values), offsets - offsets[0]


def _select(ids: np.ndarray, offsets: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.diff(offsets)
    new_ids = ids[np.repeat(keep, lengths)]
    new_offsets = np.concatenate([[0], np.cumsum(lengths[keep])]).astype(np.int64)
    return new_ids, new_offsets


# --------------------------------------------------------------------------- stage


def run(study, task: str, filter_variant: str = "default", bpe_variant: str | None = None) -> None:
    t_start = time.time()
    if task not in study.all_tasks:
        raise ConfigError(f"{study.path}: tasks.{task}: unknown or disabled task (enabled: {', '.join(study.tasks)})")
    t = study.task(task)
    if bpe_variant is None:  # the task's own tokenizer on the task's own filtered set
        bpe_variant = study.data_variant(task, t.baseline_cell)[1] if filter_variant == "default" else None
    cfg = study.bpe_config(task, filter_variant, bpe_variant)  # the task's bpe section, or a cell's override of it
    filtered = Path(output_path("filter", "filtered", study=study.name, task=task, filter_variant=filter_variant))
    out = Path(output_path("bpe", "bpe", study=study.name, task=task, filter_variant=filter_variant,
                           bpe_variant=bpe_variant))
    if not (filtered / "stats.json").is_file():
        raise StageError(f"bpe {task}: filtered data not found at {filtered}; run "
                         f"`python -m pipeline_src filter --params {study.path} --task {task} --filter-variant {filter_variant}` first")
    quiet_datasets()
    sides = sides_for(t.kind)
    splits = [s for s in SPLITS if (filtered / f"{s}.parquet").is_file()]
    splits += sorted(p.stem for p in filtered.glob("*.parquet") if p.stem not in splits)
    if "train" not in splits:
        raise StageError(f"bpe {task}: file {filtered / 'train.parquet'} not found; rerun filter --task {task}")
    tables = {s: read_parquet(filtered / f"{s}.parquet") for s in splits}
    for s, tbl in tables.items():
        missing = [c for c in sides if c not in tbl.column_names]
        if missing:
            raise StageError(f"bpe {task}: split {s}: file {filtered / (s + '.parquet')}: no column "
                             f"{missing[0]!r} (columns: {', '.join(tbl.column_names)}); rerun filter --task {task}")

    train_texts = [x for side in sides for x in tables["train"].column(side).to_pylist()]
    model, train_stats = train_spm(train_texts, vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage,
                                   max_sentences=cfg.max_sentences, task=task, study_path=study.path,
                                   model_type=cfg.model_type)
    del train_texts
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    stats = {"task": task, "variant": f"{filter_variant}/{bpe_variant}", "model_type": cfg.model_type, "kind": t.kind,
             "vocab_size": sp.get_piece_size(),
             "special_ids": {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS},
             "training": {k: v for k, v in train_stats.items() if k not in ("seconds", "mb_per_s")},
             "mb_per_s": round(train_stats["mb_per_s"], 3), "tokens": {}, "sequences": {}, "dropped": []}
    limits = {"src": cfg.max_src_tokens, "tgt": cfg.max_tgt_tokens, "text": cfg.max_src_tokens}
    with atomic_dir(out) as tmp:
        atomic_write_bytes(tmp / "spm.model", model)
        atomic_write_text(tmp / "spm.vocab", vocab_text(sp))
        model_file = str(tmp / "spm.model")
        for split in progress(splits, desc=f"bpe {task} encode", unit="split"):
            tbl = tables[split]
            n = tbl.num_rows
            arrays = {side: encode_texts(tbl, side, model_file, desc=f"bpe {task} {split}.{side}") for side in sides}
            keep = np.ones(n, dtype=bool)
            if split == "train":
                for side in sides:
                    if limits[side] is None:
                        continue
                    key = "max_src_tokens" if side in ("src", "text") else "max_tgt_tokens"
                    before = int(keep.sum())
                    keep &= np.diff(arrays[side][1]) <= limits[side]
                    after = int(keep.sum())
                    stats["dropped"].append({"split": split, "rule": key, "before": before, "after": after})
                    if after == 0:
                        raise StageError(f"bpe {task}: split {split}: file {filtered / (split + '.parquet')}: rule {key} "
                                         f"removed every row ({before} -> 0); raise tasks.{task}.bpe.{key}")
            if not keep.all():
                arrays = {side: _select(*arrays[side], keep) for side in sides}
            index = np.flatnonzero(keep).astype(np.int64)
            save_array(tmp / f"{split}.index.npy", index)
            stats["tokens"][split] = {}
            for side, (ids, offsets) in arrays.items():
                save_array(tmp / f"{split}.{side}.ids.npy", ids.astype(np.int32, copy=False))
                save_array(tmp / f"{split}.{side}.offsets.npy", offsets.astype(np.int64, copy=False))
                stats["tokens"][split][side] = int(len(ids))
            stats["sequences"][split] = int(len(index))
        stats["provenance"] = provenance(study, stage="bpe", task=task)
        atomic_write_json(tmp / "stats.json", stats)
    rows = ", ".join(f"{s} {n}" for s, n in stats["sequences"].items())
    log("bpe", f"{task}: vocab {stats['vocab_size']}, trained on {train_stats['bytes'] / 1e6:.2f} MB at "
               f"{train_stats['mb_per_s']:.2f} MB/s; encoded {rows} rows in {time.time() - t_start:.1f} s -> {out}")
