"""Stage `filter`: raw rows of a task's dataset -> data/<study>/filtered/<task>/<variant>/.

Output: `<split>.parquet` with normalised columns (`src`, `tgt` [, `id`] for translation and
summarization; `text` for lm) and `stats.json` with the before/after row count of every rule
(for the report's data table).

Per split, in this order:
  * field mapping (params `datasets.<name>.fields`; `translation.en` reaches into a struct),
    whitespace stripped at both ends; lm: one row per line (`split_lines`, as a text file
    reader splits them);
  * translation/summarization: `drop_empty` (every split);
  * lm: validation and test are kept whole, every line, blank lines and WikiText headings
    included: published per-word perplexities (PTB, WikiText) are over the whole split, and
    `stats.json` records each split's denominator counted on the raw rows (`words`, see
    data.lm_word_count). On `splits_to_filter` (only train, for lm): `drop_empty` drops blank
    lines, `drop_headings` (text_format wikitext) the ` = Heading = ` lines, then the rules below;
  * only on `splits_to_filter` (default: train; test sets stay comparable):
    `min_src_len`, `max_src_len`, `min_tgt_len`, `max_tgt_len` (in `unit`: words or chars;
    lm uses the src limits on its text), `max_ratio` (either direction, as Moses'
    clean-corpus-n / fairseq: drop when len(src)/len(tgt) or len(tgt)/len(src) > max_ratio),
    `dedup` (exact duplicate (src, tgt) pairs, first kept), `sample_fraction` then
    `sample_size` (uniform without replacement, seeded by `sample_seed` and the split; smaller
    samples are nested in larger ones; the kept rows stay in corpus order);
  * validation and test, translation/summarization: `sample_eval: {validation: N, test: N}` keeps
    a uniform random subset of N rows (corpus order kept), the rows every cell and the Lead-3
    baseline are scored on.
A cell may override any of these (`cells.<c>.filter`, e.g. a data-size ablation); each distinct
override is one filter variant, data/<study>/filtered/<task>/<variant>/.
Field mapping and length counting run as a batched `datasets.map` (worker processes only
with PIPELINE_DATA_PROCS, see num_proc_for); the rules themselves are vectorised numpy masks over those lengths.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from ..common import StageError, atomic_dir, atomic_write_json, progress, provenance
from ..study.config import ConfigError
from ..study.paths import output_path
from . import (SPLITS, dataset_fields, field_column, lm_word_count, log, num_proc_for, quiet_datasets, read_parquet,
               split_lines, write_parquet)

HEADING_RE = re.compile(r"^(=+) .*\S.* \1$")
BATCH = 1000


def _length(texts, unit: str) -> list[int]:
    if unit == "chars":
        return [len(t) for t in texts]
    return [len(t.split()) for t in texts]


def _clean(values) -> list[str]:
    return ["" if v is None else str(v).strip() for v in values]


def _pair_batch(batch, unit: str):
    """translation / summarization: normalised src/tgt [id] + lengths (batched datasets.map)."""
    src, tgt = _clean(batch["src"]), _clean(batch["tgt"])
    out = {"src": src, "tgt": tgt, "src_len": _length(src, unit), "tgt_len": _length(tgt, unit)}
    if "id" in batch:
        out["id"] = _clean(batch["id"])
    return out


def _lines_batch(batch, unit: str, wikitext: bool):
    """lm: one output row per line of each input row, with its length and heading flag."""
    text, length, heading = [], [], []
    for value in batch["text"]:
        for line in split_lines(value):
            line = line.strip()
            text.append(line)
            length.append(len(line) if unit == "chars" else len(line.split()))
            heading.append(bool(wikitext and HEADING_RE.match(line)))
    return {"text": text, "src_len": length, "heading": heading}


class _Rules:
    """Sequential row rules over one split: a keep-mask plus before/after counts of rows and of
    source length units (words or characters: how much text a length cut removes)."""

    def __init__(self, task: str, dataset: str, split: str, origin: str, n: int, src_len: np.ndarray):
        self.task, self.dataset, self.split, self.origin = task, dataset, split, origin
        self.keep = np.ones(n, dtype=bool)
        self.src_len = src_len
        self.records: list[dict] = []

    def apply(self, rule: str, drop: np.ndarray | None = None, keep: np.ndarray | None = None,
              hint: str = "") -> None:
        before, units_before = int(self.keep.sum()), int(self.src_len[self.keep].sum())
        if drop is not None:
            self.keep &= ~drop
        if keep is not None:
            self.keep &= keep
        after = int(self.keep.sum())
        self.records.append({"split": self.split, "rule": rule, "before": before, "after": after,
                             "src_units_before": units_before, "src_units_after": int(self.src_len[self.keep].sum())})
        if after == 0:
            raise StageError(f"filter {self.task}: dataset {self.dataset}: split {self.split}: file {self.origin}: "
                             f"rule {rule} removed every row ({before} -> 0){hint}")


def _sample(rules: _Rules, cfg, split: str, hint) -> None:
    """Keep a uniform random subset: the first k rows of one fixed random order of the rows that
    passed the other rules. The order depends only on `sample_seed` and the split (never on a
    training seed), so subsets are nested: the 10 % sample is part of the 30 % sample, which is
    part of the full set, for a data-size learning curve. The kept rows stay in corpus order."""
    idx = np.flatnonzero(rules.keep)
    rng = np.random.default_rng([cfg.sample_seed, SPLITS.index(split) if split in SPLITS else 99])
    order = idx[rng.permutation(len(idx))]
    k = len(idx)
    for rule, size in (("sample_fraction", None if cfg.sample_fraction >= 1.0 else
                        max(1, int(round(len(idx) * cfg.sample_fraction)))),
                       ("sample_size", cfg.sample_size)):
        if size is None:
            continue
        k = min(k, size)
        chosen = np.zeros_like(rules.keep)
        chosen[order[:k]] = True
        rules.apply(rule, keep=chosen, hint=hint(rule))


def _sample_eval(rules: _Rules, cfg, split: str) -> None:
    """A uniform random subset of `sample_eval[split]` rows of an evaluation split, in corpus
    order (a fixed order that depends only on sample_seed and the split, as _sample's)."""
    idx = np.flatnonzero(rules.keep)
    size = cfg.sample_eval[split]
    if size >= len(idx):
        return
    rng = np.random.default_rng([cfg.sample_seed, 1000 + (SPLITS.index(split) if split in SPLITS else 99)])
    chosen = np.zeros_like(rules.keep)
    chosen[idx[rng.permutation(len(idx))[:size]]] = True
    rules.apply(f"sample_eval ({split})", keep=chosen)


def _dedup_mask(data, columns: list[str], keep: np.ndarray) -> np.ndarray:
    """Rows (among those still kept) that repeat an earlier kept row exactly in `columns`."""
    import pyarrow as pa

    kept_idx = np.flatnonzero(keep)
    frame = data.select(columns).take(pa.array(kept_idx)).to_pandas()
    dup = np.zeros(len(keep), dtype=bool)
    dup[kept_idx[frame.duplicated(keep="first").to_numpy()]] = True
    return dup


def filter_split(table, *, task: str, dataset: str, kind: str, split: str, origin: str, fields: dict,
                 cfg, text_format: str, apply_rules: bool):
    """Filter one split. Returns (pyarrow table with normalised columns, list of rule records)."""
    import datasets
    import pyarrow as pa

    n_raw = table.num_rows
    if n_raw == 0:
        raise StageError(f"filter {task}: dataset {dataset}: split {split}: file {origin}: the split is empty (no rows)")
    roles = ("text",) if kind == "lm" else ("src", "tgt", "id")
    cols = {}
    for role in roles:
        if role not in fields:
            if role == "id":
                continue
            raise StageError(f"filter {task}: dataset {dataset}: split {split}: file {origin}: no field mapping for "
                             f"{role!r} (set datasets.{dataset}.fields.{role})")
        try:
            cols[role] = field_column(table, fields[role])
        except KeyError as e:
            raise StageError(f"filter {task}: dataset {dataset}: split {split}: file {origin}: field "
                             f"{role}={fields[role]!r} not found: {e.args[0]}") from None
    mapped = pa.table({role: col for role, col in cols.items()})
    ds = datasets.Dataset(datasets.table.InMemoryTable(mapped))
    num_proc = num_proc_for(n_raw)
    if kind == "lm":
        fn, kwargs = _lines_batch, {"unit": cfg.unit, "wikitext": text_format == "wikitext"}
    else:
        fn, kwargs = _pair_batch, {"unit": cfg.unit}
    ds = ds.map(fn, batched=True, batch_size=BATCH, num_proc=num_proc, fn_kwargs=kwargs,
                remove_columns=ds.column_names, load_from_cache_file=False,
                desc=f"filter {task} {split}")
    data = ds.data.table
    n = data.num_rows
    src_len = data.column("src_len").to_numpy()
    rules = _Rules(task, dataset, split, origin, n, src_len)

    def hint(key: str) -> str:
        return f"; loosen tasks.{task}.filter.{key}"

    if kind == "lm":
        rules.records.append({"split": split, "rule": "split_lines", "before": n_raw, "after": n})
        # Validation and test (never in an lm task's splits_to_filter, see config) keep every line.
        if apply_rules and cfg.drop_empty:
            rules.apply("drop_empty", drop=src_len == 0, hint=hint("drop_empty"))
        if apply_rules and cfg.drop_headings:
            rules.apply("drop_headings", drop=data.column("heading").to_numpy(zero_copy_only=False),
                        hint=hint("drop_headings"))
    else:
        tgt_len = data.column("tgt_len").to_numpy()
        if cfg.drop_empty:
            rules.apply("drop_empty", drop=(src_len == 0) | (tgt_len == 0), hint=hint("drop_empty"))
    if apply_rules:
        rules.apply("min_src_len", drop=src_len < cfg.min_src_len, hint=hint("min_src_len"))
        if cfg.max_src_len is not None:
            rules.apply("max_src_len", drop=src_len > cfg.max_src_len, hint=hint("max_src_len"))
        if kind != "lm":
            rules.apply("min_tgt_len", drop=tgt_len < cfg.min_tgt_len, hint=hint("min_tgt_len"))
            if cfg.max_tgt_len is not None:
                rules.apply("max_tgt_len", drop=tgt_len > cfg.max_tgt_len, hint=hint("max_tgt_len"))
            if cfg.max_ratio is not None:
                s, t = np.maximum(src_len, 1), np.maximum(tgt_len, 1)
                rules.apply("max_ratio", drop=(s > cfg.max_ratio * t) | (t > cfg.max_ratio * s),
                            hint=hint("max_ratio"))
        if cfg.dedup:
            keys = ["text"] if kind == "lm" else ["src", "tgt"]
            rules.apply("dedup", drop=_dedup_mask(data, keys, rules.keep), hint=hint("dedup"))
        if cfg.sample_fraction < 1.0 or cfg.sample_size is not None:
            _sample(rules, cfg, split, hint)
    if split in cfg.sample_eval:
        _sample_eval(rules, cfg, split)
    out_cols = ["text"] if kind == "lm" else ["src", "tgt"] + (["id"] if "id" in data.column_names else [])
    kept = pa.array(np.flatnonzero(rules.keep))
    return data.select(out_cols).take(kept), rules.records


def run(study, task: str, filter_variant: str = "default") -> None:
    t0 = time.time()
    if task not in study.all_tasks:
        raise ConfigError(f"{study.path}: tasks.{task}: unknown or disabled task (enabled: {', '.join(study.tasks)})")
    t = study.task(task)
    cfg = study.filter_config(task, filter_variant)  # the task's filter, or a cell's override of it
    ds = study.datasets[t.dataset]
    raw = Path(output_path("download", "raw", study=study.name, dataset=t.dataset))
    out = Path(output_path("filter", "filtered", study=study.name, task=task, filter_variant=filter_variant))
    if not (raw / "manifest.json").is_file():
        raise StageError(f"filter {task}: raw data of dataset {t.dataset} not found at {raw}; run "
                         f"`python -m pipeline_src download --params {study.path} --dataset {t.dataset}` first")
    quiet_datasets()
    fields = dataset_fields(ds)
    splits = [s for s in list(ds.splits) if (raw / f"{s}.parquet").is_file()]
    for s in ds.splits:
        if s not in splits:
            raise StageError(f"filter {task}: dataset {t.dataset}: split {s}: file {raw / (s + '.parquet')} not found; "
                             f"rerun download --dataset {t.dataset}")
    records, rows, n_in, words = [], {}, 0, {}
    with atomic_dir(out) as tmp:
        for split in progress(splits, desc=f"filter {task}", unit="split"):
            origin = str(raw / f"{split}.parquet")
            table = read_parquet(origin)
            n_in += table.num_rows
            if t.kind == "lm":  # the per-word denominator, counted on the raw rows
                words[split] = lm_word_count(field_column(table, fields["text"]))
            kept, recs = filter_split(
                table, task=task, dataset=t.dataset, kind=t.kind, split=split, origin=origin, fields=fields,
                cfg=cfg, text_format=ds.text_format,
                apply_rules=split in cfg.splits_to_filter)
            write_parquet(kept, tmp / f"{split}.parquet")
            records += recs
            rows[split] = kept.num_rows
        atomic_write_json(tmp / "stats.json", {
            "task": task, "variant": filter_variant, "dataset": t.dataset, "kind": t.kind, "unit": cfg.unit,
            "splits_to_filter": list(cfg.splits_to_filter), "rules": records, "rows": rows,
            **({"words": words} if t.kind == "lm" else {}),
            "provenance": provenance(study, stage="filter", task=task)})
    summary = ", ".join(f"{s} {n}" for s, n in rows.items())
    log("filter", f"{task}: {n_in} rows in -> {summary} out in {time.time() - t0:.1f} s -> {out}")
