"""Stage `download`: one dataset -> data/<study>/raw/<dataset>/{<split>.parquet, manifest.json}.

Sources, in order of precedence:
  1. `generator:` in the dataset's params -> rows made by pipeline_src/data/demo.py (no network);
  2. a mirror directory (env PIPELINE_DATA_MIRROR, else params `mirror:`, relative to the
     current directory) -> `<mirror>/<dataset>/<split>.jsonl.gz` read with
     `datasets.load_dataset("json", data_files=...)`; the files hold the Hub's own row schema;
  3. the Hugging Face Hub -> `datasets.load_dataset(hf_id, hf_config, revision=hf_revision,
     data_dir=hf_data_dir)`. hf_id may also name a local directory holding a copy of the Hub
     repository (`git clone` / `hf download --repo-type dataset`): the library reads it the same way.
     datasets >= 4 no longer runs loading scripts; for a script dataset (IWSLT2017, PTB) params
     point at the Hub's Parquet export instead: `hf_revision: refs/convert/parquet`,
     `hf_data_dir: <config name>` (that branch holds <config>/<split>/*.parquet).
There is no silent fallback from one source to another: a missing mirror file or an
unreachable Hub is a one-line StageError that says how to provide the data.

Rows are stored as they come (the Hub's schema); field mapping happens in `filter`. Every
field the dataset's `fields:` mapping names is checked here, in every row: it must exist and hold
text (reached through nested objects for `translation.en`; an `id` may also be an integer). A
misnamed field, or a row whose field is missing, null, a number, a list or an object, fails at
this first stage with one line naming dataset, split, file, row and field, and nothing is written.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import time
import zlib
from pathlib import Path

from ..common import StageError, atomic_dir, atomic_write_json, progress, provenance
from ..study.config import ConfigError
from ..study.paths import output_path
from . import dataset_fields, field_column, lm_word_count, log, quiet_datasets, sha256_file, write_parquet

MIRROR_ENV = "PIPELINE_DATA_MIRROR"


def mirror_dir(study) -> str | None:
    """The mirror directory in force: the environment variable wins over params `mirror:`."""
    env = os.environ.get(MIRROR_ENV)
    if env:
        return env
    return study.mirror or None


def mirror_datasets(study) -> list[str]:
    """The mirror folders the study's enabled tasks read (<mirror>/<dataset>/): not the generated ones."""
    used = {task.dataset for task in study.tasks.values()}
    return [name for name, ds in study.datasets.items() if name in used and not ds.generator]


def _one_line(text) -> str:
    return " ".join(str(text).split())[:300]


# --------------------------------------------------------------------------- sources


def _from_generator(ds) -> tuple[dict, str, dict]:
    import pyarrow as pa

    from .demo import generate

    tables, info = {}, {}
    for split in ds.splits:
        n = int(ds.generator_rows.get(split, 0))
        rows = generate(ds.generator, split, n, ds.generator_seed)
        tables[split] = pa.Table.from_pylist(rows)
        info[split] = {"source_split": split, "generator_seed": ds.generator_seed, "generator_rows": n}
    return tables, f"generator:{ds.generator}", info


def _scan_jsonl_gz(path: Path) -> str | None:
    """Find the first problem in a .jsonl.gz file (called after a load failed, to name the row)."""
    row = 0
    try:
        with gzip.open(path, "rb") as f:
            for row, line in enumerate(f, 1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"row {row}: not valid UTF-8 (byte {e.start} of the line)"
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    return f"row {row}: not valid JSON ({e.msg}, column {e.colno})"
                if not isinstance(obj, dict):
                    return f"row {row}: not a JSON object"
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        return f"truncated or corrupt gzip after row {row} ({type(e).__name__}: {_one_line(e)})"
    if row == 0:
        return "the split is empty (no rows)"
    return None


def _from_mirror(ds, study, mirror: str, cache: Path) -> tuple[dict, str, dict]:
    import datasets

    root = Path(mirror)
    where = f"{MIRROR_ENV}={mirror}" if os.environ.get(MIRROR_ENV) else f"mirror: {mirror} in {study.path}"
    if not root.is_dir():
        raise StageError(f"download {ds.name}: mirror directory {mirror} does not exist ({where}); "
                         f"point it at a directory holding <dataset>/<split>.jsonl.gz")
    tables, info = {}, {}
    for split in progress(list(ds.splits), desc=f"download {ds.name} (mirror)", unit="split"):
        src_split = ds.splits[split]
        path = root / ds.name / f"{src_split}.jsonl.gz"
        if not path.is_file():
            have = sorted(p.name for p in (root / ds.name).glob("*")) if (root / ds.name).is_dir() else []
            raise StageError(
                f"download {ds.name}: split {split}: file {path} not found in the mirror ({where}; "
                f"{'it has ' + ', '.join(have) if have else 'no folder ' + ds.name + ' there'}); add the file, "
                f"set {MIRROR_ENV} to another mirror, or disable the tasks using {ds.name} with `enabled: false`")
        try:
            loaded = datasets.load_dataset("json", data_files={split: str(path)}, cache_dir=str(cache))[split]
            # Arrow's JSON reader can let invalid UTF-8 through into string columns: check.
            loaded.data.table.validate(full=True)
        except Exception as e:  # noqa: BLE001 - any failure becomes one line naming file and row
            problem = _scan_jsonl_gz(path) or f"{type(e).__name__}: {_one_line(e)}"
            raise StageError(f"download {ds.name}: split {split}: file {path}: {problem}") from None
        tables[split] = loaded.data.table
        info[split] = {"source_split": src_split, "source_file": str(path), "source_sha256": sha256_file(path)}
    return tables, f"mirror:{mirror}", info


def _hub_unreachable() -> str | None:
    """A fast reachability check of the Hub (the datasets library retries for ~25 s when
    offline). Skipped when a proxy or offline mode is configured: then the library decides."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                                        "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=5):
            return None
    except OSError as e:
        return f"{host}:{port} is unreachable: {_one_line(e)}"


def hub_label(ds) -> str:
    """hf_id[/config][/data_dir][@revision], as the manifest and error messages name a Hub source."""
    return (ds.hf_id + (f"/{ds.hf_config}" if ds.hf_config else "") + (f"/{ds.hf_data_dir}" if ds.hf_data_dir else "")
            + (f"@{ds.hf_revision}" if ds.hf_revision else ""))


def _from_hub(ds, study) -> tuple[dict, str, dict]:
    label = hub_label(ds)
    local = Path(ds.hf_id).is_dir()     # a local copy of the repository: no network involved
    where = "the local copy" if local else "the Hugging Face Hub"
    how = (f"to use an offline copy set {MIRROR_ENV} (or `mirror:` in {study.path}) to a directory holding "
           f"{ds.name}/<split>.jsonl.gz (or HF_HUB_OFFLINE=1 to use the Hugging Face cache), or disable the "
           f"tasks using {ds.name} with `enabled: false`")
    problem = None if local else _hub_unreachable()
    if problem:
        raise StageError(f"download {ds.name}: cannot load {label} from {where} ({problem}); {how}")
    import datasets

    try:
        loaded = datasets.load_dataset(ds.hf_id, ds.hf_config, revision=ds.hf_revision, data_dir=ds.hf_data_dir)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated...: all one line
        if "scripts are no longer supported" in str(e):
            raise StageError(
                f"download {ds.name}: {label} is a loading-script dataset, which datasets "
                f"{datasets.__version__} no longer runs; load the Hub's Parquet export instead: set "
                f"datasets.{ds.name}.hf_revision: refs/convert/parquet and hf_data_dir: "
                f"{ds.hf_config or 'default'} (and drop hf_config) in {study.path}") from None
        raise StageError(f"download {ds.name}: cannot load {label} from {where} "
                         f"({type(e).__name__}: {_one_line(e)[:160]}); {how}") from None
    tables, info = {}, {}
    for split in ds.splits:
        src_split = ds.splits[split]
        if src_split not in loaded:
            raise StageError(f"download {ds.name}: split {split}: the Hub dataset {label} has no split {src_split!r} "
                             f"(it has {', '.join(loaded)}); fix datasets.{ds.name}.splits in {study.path}")
        d = loaded[src_split]
        tables[split] = d.data.table
        files = [c["filename"] for c in d.cache_files]
        info[split] = {"source_split": src_split,
                       "source_file": ", ".join(os.path.basename(f) for f in files) or None,
                       "source_sha256": ",".join(sha256_file(f) for f in files) or None,
                       "fingerprint": getattr(d, "_fingerprint", None)}
    return tables, f"{'local' if local else 'hub'}:{label}", info


# --------------------------------------------------------------------------- checks


def _is_text_type(typ, role: str) -> bool:
    """An Arrow type every row of which is what the role needs: text (an `id` may also be an integer)."""
    import pyarrow as pa

    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ):
        return True
    return role == "id" and pa.types.is_integer(typ)


def _describe(value) -> str:
    kind = ("true/false" if isinstance(value, bool) else "a number" if isinstance(value, (int, float))
            else "a list" if isinstance(value, list) else "an object" if isinstance(value, dict)
            else "text" if isinstance(value, str) else type(value).__name__)
    return f"{kind} ({_one_line(json.dumps(value, ensure_ascii=False, default=str))[:60]})"


def _python_values(col) -> list:
    """A column's values as Python objects. A JSON source whose rows disagree on a field's type
    (a string in one row, a number or list in another) loads as Arrow's `arrow.json` extension
    type, whose values are JSON texts: decode them."""
    values = col.to_pylist()
    if getattr(col.type, "extension_name", None) == "arrow.json":
        values = [None if v is None else json.loads(v) for v in values]
    return values


def field_problem(table, dotted: str, role: str) -> tuple[int | None, str] | None:
    """(row number or None for the whole column, problem) for the first row whose field `dotted`
    is not what the task needs (text, reached through nested objects for `translation.en`),
    or None when every row is fine. Only a column of the wrong Arrow type is read row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = dotted.split(".")
    if parts[0] not in table.column_names:
        return None, (f"field {role}={dotted!r} not found: no column {parts[0]!r} "
                      f"(columns: {', '.join(table.column_names) or 'none'})")
    col, depth = table.column(parts[0]), 1
    while depth < len(parts) and pa.types.is_struct(col.type):
        names = [f.name for f in col.type]
        if parts[depth] not in names:  # no row has it: the mapping is wrong, not a row
            return None, (f"field {role}={dotted!r} not found: column {'.'.join(parts[:depth])!r} has no field "
                          f"{parts[depth]!r} (it is {col.type})")
        col, depth = pc.struct_field(col, parts[depth]), depth + 1
    if depth == len(parts) and _is_text_type(col.type, role):  # the usual case: one type check
        if col.null_count:
            return pc.index(pc.is_null(col), True).as_py() + 1, f"field {dotted!r} is missing or null"
        return None
    ok = (str, int) if role == "id" else (str,)
    for row, value in enumerate(_python_values(col), 1):
        where = ".".join(parts[:depth])
        for part in parts[depth:]:
            if value is None:
                break
            if not isinstance(value, dict):
                return row, f"field {where!r} must be an object with the key {part!r} but is {_describe(value)}"
            value, where = value.get(part), f"{where}.{part}"
        if value is None:
            return row, f"field {where!r} is missing or null"
        if not isinstance(value, ok) or isinstance(value, bool):
            need = "text or an integer" if role == "id" else "text (a string)"
            return row, f"field {dotted!r} must be {need} but is {_describe(value)}"
    return None


def _check(ds, study, split: str, table, origin: str) -> None:
    """Every field the dataset's mapping names, in every row, has the type its role needs."""
    if table.num_rows == 0:
        raise StageError(f"download {ds.name}: split {split}: file {origin}: the split is empty (no rows)")
    for role, dotted in dataset_fields(ds).items():
        problem = field_problem(table, dotted, role)
        if problem is None:
            continue
        row, what = problem
        if row is None:
            raise StageError(f"download {ds.name}: split {split}: file {origin}: {what}; "
                             f"fix datasets.{ds.name}.fields.{role} in {study.path}")
        raise StageError(f"download {ds.name}: split {split}: file {origin}: row {row}: {what}")


def _check_word_count(ds, study, split: str, table, origin: str) -> dict:
    """The split's per-word perplexity denominator as published work counts it (every whitespace
    token + one <eos> per line, see data.lm_word_count), checked against datasets.<name>.expected_words."""
    counts = lm_word_count(field_column(table, dataset_fields(ds)["text"]))
    want = ds.expected_words.get(split)
    if want is not None and counts["words"] != want:
        raise StageError(
            f"download {ds.name}: split {split}: file {origin}: {counts['words']} words ({counts['whitespace_tokens']} "
            f"whitespace tokens + {counts['lines']} lines) but datasets.{ds.name}.expected_words.{split} in "
            f"{study.path} is {want}: not the published split (a different release or a partial copy?)")
    return counts


# --------------------------------------------------------------------------- stage


def run(study, dataset: str) -> None:
    t0 = time.time()
    if dataset not in study.datasets:
        raise ConfigError(f"{study.path}: datasets.{dataset}: unknown dataset "
                          f"(known: {', '.join(study.datasets)})")
    ds = study.datasets[dataset]
    out = Path(output_path("download", "raw", study=study.name, dataset=dataset))
    quiet_datasets()
    with atomic_dir(out) as tmp:
        cache = tmp / ".hf_cache"
        mirror = None if ds.generator else mirror_dir(study)
        if ds.generator:
            tables, source, info = _from_generator(ds)
        elif mirror:
            tables, source, info = _from_mirror(ds, study, mirror, cache)
        else:
            tables, source, info = _from_hub(ds, study)
        splits = {}
        for split, table in tables.items():
            origin = info[split].get("source_file") or source
            _check(ds, study, split, table, origin)
            if ds.kind == "lm":
                info[split]["words"] = _check_word_count(ds, study, split, table, origin)
            path = tmp / f"{split}.parquet"
            write_parquet(table, path)
            splits[split] = {"rows": table.num_rows, "file": path.name, "sha256": sha256_file(path), **info[split]}
        columns = {name: str(tables[next(iter(tables))].schema.field(name).type)
                   for name in tables[next(iter(tables))].column_names}
        del tables
        shutil.rmtree(cache, ignore_errors=True)
        manifest = {
            "dataset": dataset, "kind": ds.kind, "source": source, "hf_id": ds.hf_id, "hf_config": ds.hf_config,
            "hf_revision": ds.hf_revision, "hf_data_dir": ds.hf_data_dir,
            "fields": dataset_fields(ds), "text_format": ds.text_format, "columns": columns, "splits": splits,
            "provenance": provenance(study, stage="download", dataset=dataset),
        }
        atomic_write_json(tmp / "manifest.json", manifest)
    rows = ", ".join(f"{s} {v['rows']}" for s, v in splits.items())
    log("download", f"{dataset}: {source}: {rows} rows in {time.time() - t0:.1f} s -> {out}")
