"""Data stages: download (Hub / offline mirror / demo generators), filter, bpe, and shared helpers.

    download.py   stage `download`: one dataset -> raw Parquet splits and a manifest
    demo.py       deterministic synthetic corpora for the demo study
    filter.py     stage `filter`: a task's raw rows -> normalised, filtered splits
    bpe.py        stage `bpe`: SentencePiece model and encoded splits of a task's data variant
    tokens.py     reading what `bpe` wrote: the SentencePiece model and the encoded splits

Helpers here are used by `download.py`, `filter.py` and `bpe.py`: deterministic Parquet
writing, file hashing, dotted field access into Arrow tables, and the one-line stage log.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from ..common import reading
from ..study.config import SPLITS  # noqa: F401  (re-exported for the data stages)

# Splits with at least this many rows may be processed with `datasets.map(num_proc=...)`.
MULTIPROC_MIN_ROWS = 50_000
PROCS_ENV = "PIPELINE_DATA_PROCS"


def num_proc_for(n_rows: int) -> int | None:
    """Worker processes for a batched `datasets.map` over n_rows (None = in-process).

    In-process unless the environment sets PIPELINE_DATA_PROCS=N > 1. Measured with
    bench/bench_data.py on 580k rows, datasets' worker processes made filtering about 2x and
    encoding 1.1-1.2x slower, on 2 cores and on 16 alike: the per-row work (microseconds) is
    less than shipping rows to the workers and back, and SentencePiece already encodes each
    batch on every core with threads of its own."""
    value = os.environ.get(PROCS_ENV, "").strip()
    try:
        n = int(value) if value else 1
    except ValueError:
        raise ValueError(f"{PROCS_ENV}={value!r}: not a whole number") from None
    return n if n > 1 and n_rows >= MULTIPROC_MIN_ROWS else None


def log(stage: str, message: str) -> None:
    """The one summary line a stage prints at the end (stderr, so stdout stays clean)."""
    print(f"[{stage}] {message}", file=sys.stderr, flush=True)


def quiet_datasets() -> None:
    """Keep the `datasets` library to errors only; hide its bars when PIPELINE_QUIET=1."""
    import datasets

    datasets.logging.set_verbosity_error()
    if os.environ.get("PIPELINE_QUIET") == "1":
        datasets.disable_progress_bars()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_parquet(table, path: str | Path) -> None:
    """Byte-deterministic Parquet: one contiguous chunk, fixed codec, no schema metadata
    (the Hugging Face features JSON is dropped; the Arrow schema itself is kept)."""
    import pyarrow.parquet as pq

    table = table.replace_schema_metadata(None).combine_chunks()
    pq.write_table(table, str(path), compression="zstd", compression_level=3, use_dictionary=True,
                   write_statistics=True, row_group_size=1 << 20)


def read_parquet(path: str | Path):
    import pyarrow.parquet as pq

    with reading(path):
        return pq.read_table(str(path))


def field_column(table, dotted: str):
    """The column a field mapping names: `en`, or `translation.en` reaching into a struct.
    Raises KeyError(message) when any part of the path is absent."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first, *rest = dotted.split(".")
    if first not in table.column_names:
        raise KeyError(f"no column {first!r} (columns: {', '.join(table.column_names) or 'none'})")
    col = table.column(first)
    for i, part in enumerate(rest):
        names = [f.name for f in col.type] if pa.types.is_struct(col.type) else []
        if part not in names:
            where = ".".join([first, *rest[:i]])
            raise KeyError(f"column {where!r} has no field {part!r} (it is {col.type})")
        col = pc.struct_field(col, part)
    return col


def dataset_fields(ds) -> dict:
    """The field mapping of a dataset: params `fields:`, over the generator's default schema."""
    if ds.generator:
        from .demo import GENERATOR_FIELDS

        return {**GENERATOR_FIELDS[ds.generator], **dict(ds.fields)}
    return dict(ds.fields)


# --------------------------------------------------------------------------- language-model text


def split_lines(value) -> list[str]:
    """The lines of one lm row, as a text file reader sees them: split at \\n (\\r\\n and \\r
    too, like Python's universal newlines), one final newline ending the last line rather than
    opening an empty one; an empty row is one blank line. A WikiText row is one line of
    wiki.*.tokens (blank lines are empty rows); a PTB row is one sentence."""
    text = "" if value is None else str(value)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.endswith("\n"):
        text = text[:-1]
    return text.split("\n")


def lm_word_count(values) -> dict:
    """The per-word perplexity denominator of an lm split, counted as published PTB and WikiText
    results count it (Mikolov's PTB files, Merity et al.'s WikiText; e.g. AWD-LSTM's data.py reads
    every line of the file as `line.split() + ['<eos>']`): every whitespace-separated token, WikiText
    ` = Heading = ` lines included, plus one <eos> per line, blank lines included.
    PTB test: 78,669 + 3,761 = 82,430; WikiText-2 test: 245,569 (raw and tokenised releases alike:
    the raw one only keeps the words the tokenised one maps to <unk>, one token for one)."""
    tokens = lines = 0
    for value in _texts(values):
        for line in split_lines(value):
            tokens += len(line.split())
            lines += 1
    return {"whitespace_tokens": tokens, "lines": lines, "words": tokens + lines}


def _texts(values, step: int = 1 << 16):
    """The values of a list or an Arrow column, an Arrow column a slice at a time (a large
    corpus is never turned into one Python list)."""
    if not hasattr(values, "slice"):
        yield from values
        return
    for start in range(0, len(values), step):
        yield from values.slice(start, step).to_pylist()
