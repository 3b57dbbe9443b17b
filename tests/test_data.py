"""Data stages: download (mirror / generator / Hub errors), filter, SentencePiece BPE, tokens;
and the language-model evaluation they feed: per-word denominators, sliding-window perplexity.

Every test builds a tiny mirror (<mirror>/<dataset>/<split>.jsonl.gz) and params file in
tmp_path and runs the stages in-process with tmp_path as the working directory (stage outputs
go to data/<study>/... relative to it).
"""
from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline_src.data import bpe
from pipeline_src.common import StageError
from pipeline_src.study.config import ConfigError, load_study
from pipeline_src.data import demo, download
from pipeline_src.data import filter as filt
from pipeline_src.data.tokens import BOS, EOS, PAD, UNK, load_index, load_sequences, load_spm
from project_copy import checkout_env

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the a big small red dog cat sees likes runs fast old new house tree river bird fish "
         "green blue one two sun moon star sky").split()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("PIPELINE_QUIET", "1")
    monkeypatch.delenv("PIPELINE_DATA_MIRROR", raising=False)


def toy_pairs(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k = int(rng.integers(3, 9))
        src = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), k)]
        tgt = [w[::-1] for w in reversed(src)]
        rows.append({"en": " ".join(src), "de": " ".join(tgt)})
    return rows


def write_jsonl_gz(path: Path, rows=None, data: bytes | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data, mtime=0))
    return path


def write_mirror(root: Path, name: str, splits: dict) -> Path:
    for split, rows in splits.items():
        write_jsonl_gz(root / name / f"{split}.jsonl.gz", rows)
    return root


def make_study(tmp: Path, datasets: dict, tasks: dict, name: str = "toy", mirror="mirror"):
    raw = {"study": name, "mirror": mirror, "seeds": [0], "datasets": datasets, "tasks": tasks,
           "cells": {"baseline": {"family": "baseline"}}}
    for t in tasks.values():
        t.setdefault("cells", ["baseline"])
        if t["kind"] == "lm":
            t.setdefault("model", {"arch": "decoder_only"})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_study(path)


def toy_study(tmp: Path, filter_cfg=None, bpe_cfg=None, fields=None, name="toy"):
    return make_study(
        tmp, {"toy": {"kind": "translation", "hf_id": "x/toy", "fields": fields or {"src": "en", "tgt": "de"}}},
        {"toy_mt": {"kind": "translation", "dataset": "toy", "filter": filter_cfg or {},
                    "bpe": bpe_cfg or {"vocab_size": 60}}}, name=name)


def standard_mirror(tmp: Path) -> None:
    write_mirror(tmp / "mirror", "toy", {"train": toy_pairs(300, 0), "validation": toy_pairs(30, 1),
                                         "test": toy_pairs(30, 2)})


def no_temp_left(tmp: Path) -> bool:
    return not [p for p in (tmp / "data").rglob("*") if p.name.endswith(".tmp")] if (tmp / "data").exists() else True


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def tree_bytes(root: Path, skip=()) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


@contextlib.contextmanager
def cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


# --------------------------------------------------------------------------- pipeline on a toy mirror


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """download + filter + bpe of the toy dataset, run once for several tests."""
    tmp = tmp_path_factory.mktemp("toy")
    standard_mirror(tmp)
    with cwd(tmp):
        os.environ["PIPELINE_QUIET"] = "1"
        study = toy_study(tmp, filter_cfg={"max_src_len": 7}, bpe_cfg={"vocab_size": 60, "max_src_tokens": 30})
        download.run(study, "toy")
        filt.run(study, "toy_mt")
        bpe.run(study, "toy_mt")
    return tmp, study


def test_pipeline_outputs_and_manifest(toy_run):
    tmp, _ = toy_run
    raw = tmp / "data/toy/raw/toy"
    manifest = json.loads((raw / "manifest.json").read_text())
    assert manifest["source"] == "mirror:mirror"
    assert {s: v["rows"] for s, v in manifest["splits"].items()} == {"train": 300, "validation": 30, "test": 30}
    src_file = tmp / "mirror/toy/train.jsonl.gz"
    assert manifest["splits"]["train"]["source_sha256"] == hashlib.sha256(src_file.read_bytes()).hexdigest()
    assert manifest["splits"]["train"]["sha256"] == hashlib.sha256((raw / "train.parquet").read_bytes()).hexdigest()
    assert pq.read_table(raw / "train.parquet").column_names == ["en", "de"]  # the Hub's own schema
    assert "datasets" in manifest["provenance"]["versions"]
    filtered = tmp / "data/toy/filtered/toy_mt/default"
    assert pq.read_table(filtered / "train.parquet").column_names == ["src", "tgt"]
    stats = json.loads((tmp / "data/toy/bpe/toy_mt/default/bpe60/stats.json").read_text())
    assert stats["vocab_size"] == 60 and stats["mb_per_s"] > 0
    assert set(stats["tokens"]) == {"train", "validation", "test"}
    assert no_temp_left(tmp)


def test_ids_offsets_round_trip(toy_run):
    tmp, _ = toy_run
    bpe_dir = tmp / "data/toy/bpe/toy_mt/default/bpe60"
    sp = load_spm(bpe_dir)
    assert [sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()] == [PAD, UNK, BOS, EOS] == [0, 1, 2, 3]
    for split in ("train", "validation", "test"):
        frame = pq.read_table(tmp / f"data/toy/filtered/toy_mt/default/{split}.parquet").to_pandas()
        index = load_index(bpe_dir, split)
        for side in ("src", "tgt"):
            ids = np.load(bpe_dir / f"{split}.{side}.ids.npy")
            offsets = np.load(bpe_dir / f"{split}.{side}.offsets.npy")
            assert ids.dtype == np.int32 and offsets.dtype == np.int64
            assert len(offsets) == len(index) + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
            assert not np.isin(ids, [PAD, BOS, EOS]).any()  # trainers add BOS/EOS
            seqs = load_sequences(bpe_dir, split, side)
            assert len(seqs) == len(index)
            for i, seq in zip(index, seqs):
                assert sp.decode(seq.tolist()) == frame[side][i]


def test_determinism(toy_run, tmp_path):
    """download + filter + bpe again from scratch elsewhere -> identical bytes."""
    first, _ = toy_run
    standard_mirror(tmp_path)
    with cwd(tmp_path):
        study = toy_study(tmp_path, filter_cfg={"max_src_len": 7}, bpe_cfg={"vocab_size": 60, "max_src_tokens": 30})
        download.run(study, "toy")
        filt.run(study, "toy_mt")
        bpe.run(study, "toy_mt")
    skip = ("stats.json", "manifest.json")  # provenance names the params path; bpe stats hold MB/s
    a, b = tree_bytes(first / "data/toy", skip), tree_bytes(tmp_path / "data/toy", skip)
    assert a == b and any(k.endswith("spm.model") for k in a) and any(k.endswith(".ids.npy") for k in a)
    sa = json.loads((first / "data/toy/bpe/toy_mt/default/bpe60/stats.json").read_text())
    sb = json.loads((tmp_path / "data/toy/bpe/toy_mt/default/bpe60/stats.json").read_text())
    for key in ("tokens", "sequences", "dropped", "vocab_size"):
        assert sa[key] == sb[key]


def test_multiprocess_matches_single_process(toy_run, tmp_path, monkeypatch):
    """The batched multi-process path (used from 50k rows) gives the same bytes in the same order."""
    import pipeline_src.data as data_pkg

    first, _ = toy_run
    monkeypatch.setattr(data_pkg, "MULTIPROC_MIN_ROWS", 100)
    monkeypatch.setattr(data_pkg, "num_proc_for", lambda n: 2 if n >= 100 else None)
    monkeypatch.setattr(filt, "num_proc_for", data_pkg.num_proc_for)
    monkeypatch.setattr(bpe, "num_proc_for", data_pkg.num_proc_for)
    standard_mirror(tmp_path)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, filter_cfg={"max_src_len": 7}, bpe_cfg={"vocab_size": 60, "max_src_tokens": 30})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    bpe.run(study, "toy_mt")
    skip = ("stats.json", "manifest.json")
    assert tree_bytes(first / "data/toy", skip) == tree_bytes(tmp_path / "data/toy", skip)


def test_token_cut_keeps_references_aligned(tmp_path, monkeypatch):
    standard_mirror(tmp_path)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, bpe_cfg={"vocab_size": 60, "max_src_tokens": 12})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    bpe.run(study, "toy_mt")
    bpe_dir = tmp_path / "data/toy/bpe/toy_mt/default/bpe60"
    stats = json.loads((bpe_dir / "stats.json").read_text())
    (cut,) = stats["dropped"]
    assert cut["rule"] == "max_src_tokens" and cut["split"] == "train" and 0 < cut["after"] < cut["before"]
    index = load_index(bpe_dir, "train")
    assert len(index) == cut["after"] == stats["sequences"]["train"]
    assert len(load_index(bpe_dir, "test")) == 30  # only train is cut
    sp = load_spm(bpe_dir)
    frame = pq.read_table(tmp_path / "data/toy/filtered/toy_mt/default/train.parquet").to_pandas()
    for i, s, t in zip(index, load_sequences(bpe_dir, "train", "src"), load_sequences(bpe_dir, "train", "tgt")):
        assert len(s) <= 12
        assert sp.decode(s.tolist()) == frame.src[i] and sp.decode(t.tolist()) == frame.tgt[i]


def test_vocab_too_large_is_one_line(tmp_path, monkeypatch):
    standard_mirror(tmp_path)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, bpe_cfg={"vocab_size": 5000})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    with pytest.raises(StageError) as err:
        bpe.run(study, "toy_mt")
    assert "tasks.toy_mt.bpe.vocab_size" in one_line(err)
    assert not (tmp_path / "data/toy/bpe/toy_mt/default/bpe5000").exists() and no_temp_left(tmp_path)


def test_spm_literal_unk_in_text_round_trips():
    """PTB writes unknown words as the literal "<unk>"; it must survive BPE (no UNK ids)."""
    import sentencepiece as spm

    texts = [f"the {w} <unk> sold N shares" for w in WORDS] * 5
    model, stats = bpe.train_spm(texts, vocab_size=60, character_coverage=1.0, max_sentences=1000)
    sp = spm.SentencePieceProcessor(model_proto=model)
    ids = sp.encode("the dog <unk> sold N shares")
    assert UNK not in ids and sp.decode(ids) == "the dog <unk> sold N shares"
    assert stats["bytes"] == sum(len(t) for t in texts)
    again, _ = bpe.train_spm(texts, vocab_size=60, character_coverage=1.0, max_sentences=1000)
    assert again == model


def test_training_sentence_cap_is_deterministic():
    texts = [" ".join(WORDS[i % len(WORDS)] + WORDS[(i * 7) % len(WORDS)] for _ in range(3)) for i in range(400)]
    a, sa = bpe.train_spm(texts, vocab_size=80, character_coverage=1.0, max_sentences=100)
    b, sb = bpe.train_spm(texts, vocab_size=80, character_coverage=1.0, max_sentences=100)
    assert a == b and sa["texts_used"] == 100 and sa["texts"] == 400


# --------------------------------------------------------------------------- bad input


def _bad_mirror(tmp: Path, case: str) -> dict:
    """Write a mirror with one defect; return what the error must name."""
    good = toy_pairs(20, 0)
    lines = [json.dumps(r) for r in good]
    root = tmp / "mirror" / "toy"
    write_jsonl_gz(root / "validation.jsonl.gz", toy_pairs(5, 1))
    write_jsonl_gz(root / "test.jsonl.gz", toy_pairs(5, 2))
    data = ("\n".join(lines) + "\n").encode()
    expect = {"split": "train", "file": "train.jsonl.gz"}
    if case == "truncated_gzip":
        (root / "train.jsonl.gz").write_bytes(gzip.compress(data, mtime=0)[:-25])
        expect["what"] = "truncated"
    elif case == "non_utf8":
        lines[3] = lines[3].replace(good[3]["en"].split()[0], "caf\udcff", 1)
        data = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
        write_jsonl_gz(root / "train.jsonl.gz", data=data)
        expect.update(what="UTF-8", row="row 4")
    elif case == "missing_field":
        lines[6] = json.dumps({"en": good[6]["en"]})
        write_jsonl_gz(root / "train.jsonl.gz", data=("\n".join(lines) + "\n").encode())
        expect.update(what="'de'", row="row 7")
    elif case == "misnamed_field":
        write_jsonl_gz(root / "train.jsonl.gz", data=data)
        expect.update(what="'german'")
    elif case == "empty_split":
        write_jsonl_gz(root / "train.jsonl.gz", data=data)
        write_jsonl_gz(root / "test.jsonl.gz", data=b"")
        expect.update(split="test", file="test.jsonl.gz", what="empty")
    elif case == "bad_json":
        lines[2] = lines[2][:-3]
        write_jsonl_gz(root / "train.jsonl.gz", data=("\n".join(lines) + "\n").encode())
        expect.update(what="JSON", row="row 3")
    elif case == "missing_file":
        expect.update(what="not found")
    return expect


@pytest.mark.parametrize("case", ["truncated_gzip", "non_utf8", "missing_field", "misnamed_field", "empty_split",
                                  "bad_json", "missing_file"])
def test_download_bad_input(case, tmp_path, monkeypatch):
    expect = _bad_mirror(tmp_path, case)
    monkeypatch.chdir(tmp_path)
    fields = {"src": "en", "tgt": "german"} if case == "misnamed_field" else None
    study = toy_study(tmp_path, fields=fields)
    with pytest.raises(StageError) as err:
        download.run(study, "toy")
    msg = one_line(err)
    assert "toy" in msg and f"split {expect['split']}" in msg and expect["file"] in msg, msg
    assert expect["what"] in msg, msg
    if "row" in expect:
        assert expect["row"] in msg, msg
    assert not (tmp_path / "data/toy/raw/toy").exists() and no_temp_left(tmp_path)


def test_unknown_dataset_and_task(tmp_path, monkeypatch):
    standard_mirror(tmp_path)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path)
    with pytest.raises(ConfigError) as err:
        download.run(study, "nope")
    assert "datasets.nope" in one_line(err) and "toy" in str(err.value)
    with pytest.raises(ConfigError) as err:
        filt.run(study, "nope")
    assert "tasks.nope" in one_line(err)
    assert not (tmp_path / "data").exists() or no_temp_left(tmp_path)


def test_filter_removing_every_row(tmp_path, monkeypatch):
    standard_mirror(tmp_path)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, filter_cfg={"min_src_len": 50})
    download.run(study, "toy")
    with pytest.raises(StageError) as err:
        filt.run(study, "toy_mt")
    msg = one_line(err)
    for part in ("toy_mt", "dataset toy", "split train", "min_src_len", "train.parquet"):
        assert part in msg, msg
    assert not (tmp_path / "data/toy/filtered/toy_mt/default").exists() and no_temp_left(tmp_path)


def test_hub_unreachable_without_mirror(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(download, "_hub_unreachable", lambda: "huggingface.co:443 is unreachable (test)")
    study = make_study(tmp_path, {"toy": {"kind": "translation", "hf_id": "x/toy", "fields": {"src": "en", "tgt": "de"}}},
                       {"toy_mt": {"kind": "translation", "dataset": "toy"}}, mirror=None)
    with pytest.raises(StageError) as err:
        download.run(study, "toy")
    msg = one_line(err)
    for part in ("download toy", "x/toy", "PIPELINE_DATA_MIRROR", "mirror:", "enabled: false"):
        assert part in msg, msg
    assert not (tmp_path / "data/toy/raw/toy").exists() and no_temp_left(tmp_path)


def write_parquet_export(repo: Path, config: str, splits: dict) -> None:
    """The layout of a Hub dataset's Parquet export (branch refs/convert/parquet):
    <config>/<split>/0000.parquet, rows in the dataset's own schema."""
    import pyarrow as pa
    for split, rows in splits.items():
        (repo / config / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), repo / config / split / "0000.parquet")


def _iwslt_rows(n: int, seed: int) -> list[dict]:  # IWSLT2017's schema: {"translation": {"de", "en"}}
    return [{"translation": {"de": r["de"], "en": r["en"]}} for r in toy_pairs(n, seed)]


def test_hub_parquet_export_from_a_local_copy(tmp_path, monkeypatch):
    """The Hub code path (`datasets.load_dataset(hf_id, revision=, data_dir=)`) on a local copy of a
    script dataset's Parquet export: data_dir picks the config, nested fields map, no network is asked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(download, "_hub_unreachable", lambda: pytest.fail("a local copy must not touch the network"))
    repo = tmp_path / "hub" / "iwslt2017"
    write_parquet_export(repo, "iwslt2017-en-de", {"train": _iwslt_rows(300, 0), "validation": _iwslt_rows(30, 1),
                                                   "test": _iwslt_rows(20, 2)})
    write_parquet_export(repo, "iwslt2017-en-fr", {"train": _iwslt_rows(7, 3), "validation": _iwslt_rows(7, 4),
                                                   "test": _iwslt_rows(7, 5)})   # another config: must be ignored
    study = make_study(tmp_path, {"iwslt": {"kind": "translation", "hf_id": str(repo),
                                            "hf_revision": "refs/convert/parquet", "hf_data_dir": "iwslt2017-en-de",
                                            "fields": {"src": "translation.en", "tgt": "translation.de"}}},
                       {"iwslt_mt": {"kind": "translation", "dataset": "iwslt", "bpe": {"vocab_size": 60}}}, mirror=None)
    download.run(study, "iwslt")
    manifest = json.loads((tmp_path / "data/toy/raw/iwslt/manifest.json").read_text())
    assert manifest["source"] == f"local:{repo}/iwslt2017-en-de@refs/convert/parquet"
    assert {s: v["rows"] for s, v in manifest["splits"].items()} == {"train": 300, "validation": 30, "test": 20}
    filt.run(study, "iwslt_mt")
    first = pq.read_table(tmp_path / "data/toy/filtered/iwslt_mt/default/train.parquet").to_pylist()[0]
    assert (first["src"], first["tgt"]) == (toy_pairs(1, 0)[0]["en"], toy_pairs(1, 0)[0]["de"])


def test_hub_repo_layouts_from_local_copies(tmp_path, monkeypatch):
    """The two other repository layouts the real params rely on, read through the Hub code path:
    bentrevett/multi30k (JSON Lines named train/val/test, no config: `val` must become the
    validation split) and Salesforce/wikitext (Parquet per config, declared in the README's
    `configs:`; hf_config picks wikitext-2-raw-v1 among several)."""
    import pyarrow as pa
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(download, "_hub_unreachable", lambda: pytest.fail("a local copy must not touch the network"))
    multi30k = tmp_path / "hub" / "multi30k"
    for split, n in (("train", 40), ("val", 6), ("test", 5)):
        (multi30k / f"{split}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (multi30k / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy_pairs(n, 7)))
    wikitext = tmp_path / "hub" / "wikitext"
    lines = {"train": ["", " = Valkyria = \n", " The game began . \n", "", " It was released . \n"],
             "validation": [" = Heading = \n", " A line . \n"], "test": [" Test text . \n"]}
    configs = []
    for config, scale in (("wikitext-2-raw-v1", 1), ("wikitext-103-raw-v1", 3)):
        for split, texts in lines.items():
            (wikitext / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"text": texts * scale}), wikitext / config / f"{split}-00000-of-00001.parquet")
        configs.append({"config_name": config, "data_files": [
            {"split": split, "path": f"{config}/{split}-*"} for split in lines]})
    (wikitext / "README.md").write_text("---\n" + yaml.safe_dump({"configs": configs}, sort_keys=False) + "---\n")
    study = make_study(tmp_path, {"multi30k": {"kind": "translation", "hf_id": str(multi30k), "fields": {"src": "en", "tgt": "de"}},
                                  "wikitext2": {"kind": "lm", "hf_id": str(wikitext), "hf_config": "wikitext-2-raw-v1",
                                                "fields": {"text": "text"}, "text_format": "wikitext"}},
                       {"mt": {"kind": "translation", "dataset": "multi30k"},
                        "lm": {"kind": "lm", "dataset": "wikitext2", "filter": {"dedup": False, "drop_headings": True}}},
                       mirror=None)
    download.run(study, "multi30k")
    download.run(study, "wikitext2")
    rows = {name: {s: v["rows"] for s, v in json.loads((tmp_path / f"data/toy/raw/{name}/manifest.json").read_text())
                   ["splits"].items()} for name in ("multi30k", "wikitext2")}
    assert rows == {"multi30k": {"train": 40, "validation": 6, "test": 5},
                    "wikitext2": {"train": 5, "validation": 2, "test": 1}}
    filt.run(study, "lm")
    kept = pq.read_table(tmp_path / "data/toy/filtered/lm/default/train.parquet").column("text").to_pylist()
    assert [t.strip() for t in kept] == ["The game began .", "It was released ."]   # asked: blank lines, headings dropped
    valid = pq.read_table(tmp_path / "data/toy/filtered/lm/default/validation.parquet").column("text").to_pylist()
    assert valid == ["= Heading =", "A line ."]   # evaluated whole


def test_hub_script_dataset_names_the_parquet_export(tmp_path, monkeypatch):
    """datasets >= 4 refuses loading scripts: the error says which params keys load the Parquet export."""
    monkeypatch.chdir(tmp_path)
    repo = tmp_path / "hub" / "iwslt2017"
    repo.mkdir(parents=True)
    (repo / "iwslt2017.py").write_text("import datasets\n")
    study = make_study(tmp_path, {"iwslt": {"kind": "translation", "hf_id": str(repo), "hf_config": "iwslt2017-en-de",
                                            "fields": {"src": "translation.en", "tgt": "translation.de"}}},
                       {"iwslt_mt": {"kind": "translation", "dataset": "iwslt"}}, mirror=None)
    with pytest.raises(StageError) as err:
        download.run(study, "iwslt")
    msg = one_line(err)
    for part in ("download iwslt", "loading-script", "hf_revision: refs/convert/parquet", "hf_data_dir: iwslt2017-en-de"):
        assert part in msg, msg
    assert not (tmp_path / "data/toy/raw/iwslt").exists() and no_temp_left(tmp_path)


def test_mirror_env_wins(tmp_path, monkeypatch):
    standard_mirror(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_DATA_MIRROR", str(tmp_path / "mirror"))
    study = make_study(tmp_path, {"toy": {"kind": "translation", "hf_id": "x/toy", "fields": {"src": "en", "tgt": "de"}}},
                       {"toy_mt": {"kind": "translation", "dataset": "toy"}}, mirror="does/not/exist")
    download.run(study, "toy")
    manifest = json.loads((tmp_path / "data/toy/raw/toy/manifest.json").read_text())
    assert manifest["source"] == f"mirror:{tmp_path / 'mirror'}"


def test_cli_exit_codes(tmp_path):
    """Run as `python -m pipeline_src`: ConfigError -> 2, StageError -> 1, one `error:` line."""
    _bad_mirror(tmp_path, "truncated_gzip")
    toy_study(tmp_path)
    env = checkout_env()
    env.pop("PIPELINE_DATA_MIRROR", None)
    for dataset, code in (("nope", 2), ("toy", 1)):
        proc = subprocess.run([sys.executable, "-m", "pipeline_src", "download", "--params", "toy.yaml",
                               "--dataset", dataset], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and dataset in errors[0], proc.stderr
    assert not (tmp_path / "data/toy/raw/toy").exists() and no_temp_left(tmp_path)


# --------------------------------------------------------------------------- filter rules


def test_filter_rule_counts(tmp_path, monkeypatch):
    train = [("a b c", "x y z"),            # kept
             ("", "x"),                      # drop_empty
             ("a b c d e f", "x y z w v u"),  # max_src_len (5)
             ("a", "x y"),                   # max_ratio (2 > 1.5)
             ("a b c", "x y z"),            # dedup
             ("a b", "x y"),                # kept
             ("a b c d", "x y z w u"),      # max_tgt_len (4)
             ("p q", "r s")]                # kept
    validation = [("a b c d e f g h", "x"), ("", "x"), ("k", "l")]  # only drop_empty applies here
    rows = {"train": [{"en": s, "de": t} for s, t in train],
            "validation": [{"en": s, "de": t} for s, t in validation],
            "test": [{"en": "a", "de": "b"}]}
    write_mirror(tmp_path / "mirror", "toy", rows)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, filter_cfg={"max_src_len": 5, "max_tgt_len": 4, "max_ratio": 1.5})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    out = tmp_path / "data/toy/filtered/toy_mt/default"
    stats = json.loads((out / "stats.json").read_text())
    got = [(r["split"], r["rule"], r["before"], r["after"]) for r in stats["rules"]]
    assert got == [("train", "drop_empty", 8, 7), ("train", "min_src_len", 7, 7), ("train", "max_src_len", 7, 6),
                   ("train", "min_tgt_len", 6, 6), ("train", "max_tgt_len", 6, 5), ("train", "max_ratio", 5, 4),
                   ("train", "dedup", 4, 3), ("validation", "drop_empty", 3, 2), ("test", "drop_empty", 1, 1)]
    assert stats["rows"] == {"train": 3, "validation": 2, "test": 1}
    assert pq.read_table(out / "train.parquet").to_pydict() == {"src": ["a b c", "a b", "p q"],
                                                                "tgt": ["x y z", "x y", "r s"]}


def test_sampling_and_splits_to_filter(tmp_path, monkeypatch):
    rows = {s: [{"en": f"w{i} {s}", "de": f"v{i}"} for i in range(n)] for s, n in
            (("train", 100), ("validation", 50), ("test", 40))}
    write_mirror(tmp_path / "mirror", "toy", rows)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, filter_cfg={"sample_fraction": 0.5, "sample_size": 30, "sample_seed": 3,
                                            "splits_to_filter": ["train", "test"]})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    out = tmp_path / "data/toy/filtered/toy_mt/default"
    first = {s: pq.read_table(out / f"{s}.parquet").column("src").to_pylist() for s in ("train", "validation", "test")}
    stats = json.loads((out / "stats.json").read_text())
    got = {(r["split"], r["rule"]): (r["before"], r["after"]) for r in stats["rules"]}
    assert got[("train", "sample_fraction")] == (100, 50) and got[("train", "sample_size")] == (50, 30)
    assert got[("test", "sample_fraction")] == (40, 20) and got[("test", "sample_size")] == (20, 20)
    assert ("validation", "sample_size") not in got and len(first["validation"]) == 50
    order = [int(x.split()[0][1:]) for x in first["train"]]
    assert order == sorted(order)  # corpus order kept
    filt.run(study, "toy_mt")
    assert pq.read_table(out / "train.parquet").column("src").to_pylist() == first["train"]


def test_sample_eval_keeps_a_fixed_random_subset_of_an_evaluation_split(tmp_path, monkeypatch):
    """`sample_eval: {test: N}`: N random test rows, the same every time, in corpus order (not the
    first N: a corpus ordered by source would bias a prefix); train untouched; source text counted."""
    rows = {s: [{"en": f"w{i} {s}", "de": f"v{i}"} for i in range(n)] for s, n in
            (("train", 60), ("validation", 50), ("test", 40))}
    write_mirror(tmp_path / "mirror", "toy", rows)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, filter_cfg={"sample_eval": {"test": 10}})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    out = tmp_path / "data/toy/filtered/toy_mt/default"
    stats = json.loads((out / "stats.json").read_text())
    rule = next(r for r in stats["rules"] if r["rule"] == "sample_eval (test)")
    assert (rule["before"], rule["after"]) == (40, 10) and rule["src_units_before"] == 80
    assert rule["src_units_after"] == 20 and stats["rows"] == {"train": 60, "validation": 50, "test": 10}
    test = [int(x.split()[0][1:]) for x in pq.read_table(out / "test.parquet").column("src").to_pylist()]
    assert test == sorted(test) and test != list(range(10))
    filt.run(study, "toy_mt")
    again = [int(x.split()[0][1:]) for x in pq.read_table(out / "test.parquet").column("src").to_pylist()]
    assert again == test


def test_nested_fields_and_ids(tmp_path, monkeypatch):
    """IWSLT-style rows {"translation": {"de", "en"}} and a kept `id` column."""
    rows = {s: [{"id": f"{s}{i}", "translation": {"de": f"hallo {i}", "en": f"hello {i}"}} for i in range(5)]
            for s in ("train", "validation", "test")}
    write_mirror(tmp_path / "mirror", "toy", rows)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, fields={"src": "translation.en", "tgt": "translation.de", "id": "id"})
    download.run(study, "toy")
    filt.run(study, "toy_mt")
    table = pq.read_table(tmp_path / "data/toy/filtered/toy_mt/default/test.parquet")
    assert table.to_pydict() == {"src": [f"hello {i}" for i in range(5)], "tgt": [f"hallo {i}" for i in range(5)],
                                 "id": [f"test{i}" for i in range(5)]}


def test_nested_field_misnamed(tmp_path, monkeypatch):
    rows = {s: [{"translation": {"de": "hallo", "en": "hello"}}] for s in ("train", "validation", "test")}
    write_mirror(tmp_path / "mirror", "toy", rows)
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, fields={"src": "translation.en", "tgt": "translation.fr"})
    with pytest.raises(StageError) as err:
        download.run(study, "toy")
    msg = one_line(err)
    assert "translation.fr" in msg and "split train" in msg and "train.jsonl.gz" in msg


# Rows whose configured fields have the wrong type: (rows of the train split, field mapping,
# what the one-line error must contain). The Multi30k case is the one from the bug report.
def _typed_rows(n=8):
    return [{"en": f"a small dog {i}", "de": f"ein kleiner hund {i}"} for i in range(n)]


def _nested_rows(n=8):
    return [{"id": f"r{i}", "translation": {"en": f"hello {i}", "de": f"hallo {i}"}} for i in range(n)]


def _with(rows, i, row):
    rows = list(rows)
    rows[i] = row
    return rows


MT = {"src": "en", "tgt": "de"}
NESTED = {"src": "translation.en", "tgt": "translation.de", "id": "id"}
BAD_TYPES = {
    "number_and_list": (_with(_typed_rows(), 5, {"en": 3, "de": ["ein", "hund"]}), MT, ("row 6", "'en'", "a number")),
    "list": (_with(_typed_rows(), 2, {"en": "a dog", "de": ["ein", "hund"]}), MT, ("row 3", "'de'", "a list")),
    "object": (_with(_typed_rows(), 7, {"en": "a dog", "de": {"text": "hund"}}), MT, ("row 8", "'de'", "an object")),
    "boolean": (_with(_typed_rows(), 0, {"en": True, "de": "hund"}), MT, ("row 1", "'en'", "true/false")),
    "float": (_with(_typed_rows(), 4, {"en": 1.5, "de": "hund"}), MT, ("row 5", "'en'", "a number")),
    "every_row_a_number": ([{"en": i, "de": f"hund {i}"} for i in range(8)], MT, ("row 1", "'en'", "a number")),
    "null": (_with(_typed_rows(), 3, {"en": None, "de": "hund"}), MT, ("row 4", "'en'", "missing or null")),
    "nested_not_an_object": (_with(_nested_rows(), 1, {"id": "x", "translation": "hello hallo"}), NESTED,
                             ("row 2", "'translation'", "must be an object", "'en'")),
    "nested_list": (_with(_nested_rows(), 6, {"id": "x", "translation": ["hello", "hallo"]}), NESTED,
                    ("row 7", "'translation'", "a list")),
    "nested_number": (_with(_nested_rows(), 3, {"id": "x", "translation": {"en": 5, "de": "hallo"}}), NESTED,
                      ("row 4", "'translation.en'", "a number")),
    "nested_key_missing": (_with(_nested_rows(), 5, {"id": "x", "translation": {"en": "hello"}}), NESTED,
                           ("row 6", "'translation.de'", "missing or null")),
    "id_object": (_with(_nested_rows(), 2, {"id": {"n": 1}, "translation": {"en": "a", "de": "b"}}), NESTED,
                  ("row 3", "'id'", "text or an integer", "an object")),
}


@pytest.mark.parametrize("case", sorted(BAD_TYPES))
def test_download_refuses_rows_of_the_wrong_type(case, tmp_path, monkeypatch):
    rows, fields, expect = BAD_TYPES[case]
    good = _nested_rows(3) if fields is NESTED else _typed_rows(3)
    write_mirror(tmp_path / "mirror", "toy", {"train": rows, "validation": good, "test": good})
    monkeypatch.chdir(tmp_path)
    study = toy_study(tmp_path, fields=fields)
    with pytest.raises(StageError) as err:
        download.run(study, "toy")
    msg = one_line(err)
    for part in ("download toy", "split train", "train.jsonl.gz", *expect):
        assert part in msg, msg
    assert not (tmp_path / "data/toy/raw/toy").exists() and no_temp_left(tmp_path)


def test_download_bad_type_in_an_lm_split_and_an_integer_id(tmp_path, monkeypatch):
    """An lm text that is a list is refused (test split, row 2); an integer id is fine."""
    ok = [{"text": "a b c"}, {"text": ""}, {"text": "d e"}]
    write_mirror(tmp_path / "mirror", "wiki", {"train": ok, "validation": ok,
                                               "test": [{"text": "a"}, {"text": ["b", "c"]}]})
    monkeypatch.chdir(tmp_path)
    study = make_study(tmp_path, {"wiki": {"kind": "lm", "hf_id": "x/wiki", "fields": {"text": "text"}}},
                       {"wiki_lm": {"kind": "lm", "dataset": "wiki"}})
    with pytest.raises(StageError) as err:
        download.run(study, "wiki")
    msg = one_line(err)
    assert "split test" in msg and "row 2" in msg and "'text'" in msg and "a list" in msg, msg
    assert not (tmp_path / "data/toy/raw/wiki").exists()
    rows = [{"id": i, "translation": {"en": f"hello {i}", "de": f"hallo {i}"}} for i in range(4)]
    write_mirror(tmp_path / "mirror", "toy", {s: rows for s in ("train", "validation", "test")})
    download.run(toy_study(tmp_path, fields=NESTED), "toy")
    assert (tmp_path / "data/toy/raw/toy/manifest.json").is_file()


def _lm_study(tmp: Path, text_format: str, rows: dict, filter_cfg=None):
    write_mirror(tmp / "mirror", "wiki", rows)
    return make_study(tmp, {"wiki": {"kind": "lm", "hf_id": "x/wiki", "fields": {"text": "text"},
                                     "text_format": text_format}},
                      {"wiki_lm": {"kind": "lm", "dataset": "wiki", "filter": filter_cfg or {"dedup": False},
                                   "bpe": {"vocab_size": 40}}})


def test_wikitext_headings_and_blank_lines(tmp_path, monkeypatch):
    """Train drops headings and blank lines when asked; validation and test keep every line."""
    wiki = ["", " = Valkyria Chronicles III = \n", "", " Senjo no Valkyria 3 is a game . \n", "",
            " = = Gameplay = = \n", "", " As with previous games , it is fun . \n", " = = = Plot = = = \n"]
    rows = {s: [{"text": x} for x in wiki] for s in ("train", "validation", "test")}
    monkeypatch.chdir(tmp_path)
    study = _lm_study(tmp_path, "wikitext", rows, {"dedup": False, "drop_headings": True})
    download.run(study, "wiki")
    filt.run(study, "wiki_lm")
    out = tmp_path / "data/toy/filtered/wiki_lm/default"
    assert pq.read_table(out / "train.parquet").to_pydict() == {
        "text": ["Senjo no Valkyria 3 is a game .", "As with previous games , it is fun ."]}
    assert pq.read_table(out / "test.parquet").column("text").to_pylist() == [x.strip() for x in wiki]
    stats = json.loads((out / "stats.json").read_text())
    got = [(r["split"], r["rule"], r["before"], r["after"]) for r in stats["rules"] if r["split"] != "validation"]
    assert got == [("train", "split_lines", 9, 9), ("train", "drop_empty", 9, 5), ("train", "drop_headings", 5, 2),
                   ("train", "min_src_len", 2, 2), ("test", "split_lines", 9, 9)]
    # the denominator: 17 heading tokens + 17 text tokens + one <eos> for each of the 9 lines
    assert stats["words"]["test"] == {"whitespace_tokens": 34, "lines": 9, "words": 43}
    bpe.run(study, "wiki_lm")
    bstats = json.loads((tmp_path / "data/toy/bpe/wiki_lm/default/bpe40/stats.json").read_text())
    assert bstats["sequences"]["test"] == 9 and bstats["sequences"]["train"] == 2
    assert "tgt" not in bstats["tokens"]["test"] and bstats["tokens"]["test"]["text"] > 0


def test_lm_plain_splits_lines(tmp_path, monkeypatch):
    rows = {s: [{"text": "a b c\nd e\n\nf"}, {"text": "  "}, {"text": "g h"}] for s in ("train", "validation", "test")}
    monkeypatch.chdir(tmp_path)
    study = _lm_study(tmp_path, "plain", rows)
    download.run(study, "wiki")
    filt.run(study, "wiki_lm")
    out = tmp_path / "data/toy/filtered/wiki_lm/default"
    assert pq.read_table(out / "train.parquet").column("text").to_pylist() == ["a b c", "d e", "f", "g h"]
    assert pq.read_table(out / "validation.parquet").column("text").to_pylist() == ["a b c", "d e", "", "f", "", "g h"]
    stats = json.loads((out / "stats.json").read_text())
    got = [(r["rule"], r["before"], r["after"]) for r in stats["rules"] if r["split"] in ("train", "validation")]
    assert got == [("split_lines", 3, 6), ("drop_empty", 6, 4), ("min_src_len", 4, 4), ("split_lines", 3, 6)]
    assert stats["words"]["validation"] == {"whitespace_tokens": 8, "lines": 6, "words": 14}


# --------------------------------------------------------------------------- demo generators


def test_demo_generators_deterministic():
    for gen in ("reorder", "digest", "grammar"):
        a = demo.generate(gen, "train", 50, 7)
        assert a == demo.generate(gen, "train", 50, 7)
        assert a != demo.generate(gen, "train", 50, 8)
        assert a != demo.generate(gen, "validation", 50, 7)
        assert set(a[0]) == set(demo.GENERATOR_FIELDS[gen].values())


def test_demo_reorder_needs_reordering():
    rows = demo.generate("reorder", "train", 500, 1)
    reordered = sum(demo.word_by_word(r["src"]) != r["tgt"] for r in rows)
    assert reordered > 0.9 * len(rows)
    # same words, other order: the target is a permutation of the word-by-word translation
    assert all(sorted(demo.word_by_word(r["src"]).split()) == sorted(r["tgt"].split()) for r in rows)
    assert all(3 <= len(r["src"].split()) <= 9 for r in rows)


def test_demo_digest_and_grammar_shapes():
    for r in demo.generate("digest", "test", 100, 2):
        sentences = r["article"].split(" . ")
        assert 4 <= len(sentences) <= 8 and r["article"].endswith(" .")
        highlights = r["highlights"].split("\n")
        assert len(highlights) == 2 and all(h.endswith(" .") for h in highlights)
        assert r["article"].count(demo.MARKER) == 2
    rows = demo.generate("grammar", "train", 1000, 3)
    assert all(4 <= len(r["sentence"].split()) <= 20 and r["sentence"] == r["sentence"].lower() for r in rows)
    vocab = {w for r in rows for w in r["sentence"].split()}
    assert vocab <= demo.grammar_vocabulary() and 150 <= len(demo.grammar_vocabulary()) <= 250


def test_demo_download_uses_generator(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    study = make_study(tmp_path, {"g": {"kind": "lm", "generator": "grammar", "generator_seed": 3,
                                        "generator_rows": {"train": 200, "validation": 20, "test": 20}}},
                       {"g_lm": {"kind": "lm", "dataset": "g", "bpe": {"vocab_size": 100}}}, mirror=None)
    download.run(study, "g")
    raw = tmp_path / "data/toy/raw/g"
    assert json.loads((raw / "manifest.json").read_text())["source"] == "generator:grammar"
    assert pq.read_table(raw / "train.parquet").to_pylist() == demo.generate("grammar", "train", 200, 3)
    filt.run(study, "g_lm")
    bpe.run(study, "g_lm")
    sp = load_spm(tmp_path / "data/toy/bpe/g_lm/default/bpe100")
    text = pq.read_table(tmp_path / "data/toy/filtered/g_lm/default/validation.parquet").column("text").to_pylist()
    seqs = load_sequences(tmp_path / "data/toy/bpe/g_lm/default/bpe100", "validation", "text")
    assert [sp.decode(s.tolist()) for s in seqs] == text


def test_study_params_files_are_valid():
    for path in ("params.yaml", "workflow/studies/demo/params.yaml", "workflow/studies/mirror/params.yaml"):
        study = load_study(REPO / path)
        for task in study.tasks.values():
            assert task.dataset in study.datasets
    mirror = load_study(REPO / "workflow/studies/mirror/params.yaml")
    assert mirror.name == "mirror" and mirror.mirror == "../shared/datasets"
    assert all(t.cells == ("baseline", "pe_none") for t in mirror.tasks.values())


# --------------------------------------------------------------------------- lm denominators per corpus kind
# The published rule, written independently of the pipeline: AWD-LSTM's data.py (Merity et al.)
# reads the file line by line as `line.split() + ['<eos>']` and divides the test NLL by the count.

def published_count(file_text: str) -> int:
    return sum(len(line.split()) + 1 for line in io.StringIO(file_text))


def hub_rows(file_text: str) -> list[dict]:
    """wiki.*.tokens -> the Hub's rows, as Salesforce/wikitext's builder made them: one row per
    line of the file, a blank line as an empty row."""
    return [{"text": line if line.strip() else ""} for line in io.StringIO(file_text)]


# A small wiki.test.tokens-like split: blank lines are " ", headings " = Title = ", rare words
# replaced by <unk>, numbers split with @,@ / @.@, as in the released files.
WIKI_TOKENS = {
    "test": (" \n = Robert Boulter = \n \n"
             " Robert Boulter is an English film , television and theatre actor . He had a guest @-@ starring role in 2000 . \n"
             " \n = = Career = = \n \n \n = = = 2000 – 2005 = = = \n \n"
             " In 2000 Boulter had a role on the series The Bill ; he played \" Scott <unk> \" in the episode . \n"
             " He was cast in the 2003 play <unk> , which was performed at the Royal Court Theatre . \n \n"
             " = = = 2006 – present = = = \n \n"
             " In 2006 , Boulter starred in the play <unk> by Mark <unk> . It ran for 1 @,@ 000 nights . \n \n"),
    "validation": (" \n = Homarus gammarus = \n \n"
                   " Homarus gammarus is a species of <unk> lobster from the eastern Atlantic Ocean . \n \n"
                   " = = Description = = \n \n"
                   " It may grow to a length of 60 cm ( 24 in ) and a mass of 6 @.@ 5 kilograms . \n \n"),
}
# The raw release keeps the words the tokenised one maps to <unk>: one token for one.
UNK_WORDS = iter(["Parry", "Herons", "Kedge", "Ravenhill", "decapod"] * 4)
WIKI_RAW = {s: "".join(next(UNK_WORDS) if part == "<unk>" else part
                       for part in re.split(r"(<unk>)", text)) for s, text in WIKI_TOKENS.items()}
WIKI_TRAIN = (WIKI_TOKENS["test"] + WIKI_TOKENS["validation"] + WIKI_RAW["test"]) * 3

LM_TINY = {"model": {"arch": "decoder_only", "d_model": 16, "n_heads": 2, "dec_layers": 1, "d_ff": 32, "max_len": 32},
           "train": {"max_steps": 4, "batch_tokens": 128, "lm_seq_len": 16, "eval_every": 4, "warmup_steps": 1,
                     "label_smoothing": 0.0},
           "eval": {"n_samples": 2}}


def _run_lm(tmp: Path, splits: dict, text_format: str, filter_cfg: dict, expected: dict | None = None,
            vocab: int = 120, field: str = "text") -> tuple[dict, dict]:
    """download -> filter -> bpe -> train (4 steps) -> evaluate a tiny lm; (eval metrics, filter stats)."""
    from pipeline_src.evaluate import evaluator
    from pipeline_src.train import trainer

    write_mirror(tmp / "mirror", "corpus", splits)
    ds = {"kind": "lm", "hf_id": "x/corpus", "fields": {"text": field}, "text_format": text_format}
    if expected:
        ds["expected_words"] = expected
    study = make_study(tmp, {"corpus": ds}, {"lm": {"kind": "lm", "dataset": "corpus", "filter": filter_cfg,
                                                    "bpe": {"vocab_size": vocab}, **copy.deepcopy(LM_TINY)}})
    download.run(study, "corpus")
    filt.run(study, "lm")
    bpe.run(study, "lm")
    trainer.run(study, "lm", "baseline", 0)
    evaluator.run(study, "lm", "baseline", 0)
    ev = json.loads((tmp / "data/toy/eval/lm/baseline/seed0/eval_metrics.json").read_text())
    ev["samples"] = json.loads((tmp / "data/toy/eval/lm/baseline/seed0/eval_info.json").read_text())["samples"]
    ev["per_example"] = pd.read_csv(tmp / "data/toy/eval/lm/baseline/seed0/outputs/per_example.tsv", sep="\t")
    return ev, json.loads((tmp / "data/toy/filtered/lm/default/stats.json").read_text())


def _assert_denominator(ev: dict, split: str, want: int, bpe_dir: Path) -> None:
    short = "val" if split == "validation" else "test"
    m, rows = ev["metrics"], ev["per_example"][ev["per_example"]["split"] == split]
    assert m[f"{short}_words"] == want
    assert int(rows["words"].sum()) == want  # the paired tests resample the same count
    # The NLL covers every token of the split: each line's BPE tokens and its <eos>, the first one too.
    lines = load_sequences(bpe_dir, split, "text")
    assert int(rows["tokens"].sum()) == sum(len(x) for x in lines) + len(lines) and len(rows) == len(lines)
    nll = float(rows["nll"].sum())
    assert m[f"{short}_ppl_word"] == pytest.approx(math.exp(nll / want), rel=1e-5)
    assert m[f"{short}_ppl"] == pytest.approx(math.exp(nll / rows["tokens"].sum()), rel=1e-5)


def test_wikitext_denominator_is_the_published_count(tmp_path, monkeypatch):
    """WikiText: every whitespace token, headings included, + one <eos> per line, blank lines
    included, although training drops headings and blank lines (asked for here)."""
    monkeypatch.chdir(tmp_path)
    splits = {"train": hub_rows(WIKI_TRAIN), **{s: hub_rows(t) for s, t in WIKI_TOKENS.items()}}
    want = {s: published_count(t) for s, t in WIKI_TOKENS.items()}
    body_only = sum(len(x.split()) + 1 for x in WIKI_TOKENS["test"].splitlines() if x.strip() and not x.strip().startswith("="))
    assert want["test"] == 127 and body_only == 87  # the filtered rows (the old denominator) are far off
    ev, stats = _run_lm(tmp_path, splits, "wikitext", {"dedup": False, "drop_headings": True}, expected=want)
    assert stats["words"]["test"] == {"whitespace_tokens": 110, "lines": 17, "words": want["test"]}
    for split in ("validation", "test"):
        _assert_denominator(ev, split, want[split], next((tmp_path / "data/toy/bpe/lm/default").iterdir()))
    assert [s["source"] for s in ev["samples"]] == ["= Robert Boulter =", "Robert Boulter is an"]  # blank lines skipped


def test_wikitext_raw_release_has_the_tokenised_count(tmp_path, monkeypatch):
    """wikitext-2-raw-v1 (params.yaml) differs from wikitext-2-v1 only by keeping the words the
    latter replaces with <unk>, one token for one: counted the same way, its per-word perplexity
    is divided by the same 245,569 for the real test split."""
    from pipeline_src.data import lm_word_count

    for split in ("validation", "test"):
        assert WIKI_RAW[split] != WIKI_TOKENS[split] and "<unk>" not in WIKI_RAW[split]
        raw = lm_word_count(r["text"] for r in hub_rows(WIKI_RAW[split]))
        assert raw == lm_word_count(r["text"] for r in hub_rows(WIKI_TOKENS[split]))
        assert raw["words"] == published_count(WIKI_TOKENS[split])
    monkeypatch.chdir(tmp_path)
    splits = {"train": hub_rows(WIKI_TRAIN), **{s: hub_rows(t) for s, t in WIKI_RAW.items()}}
    ev, _ = _run_lm(tmp_path, splits, "wikitext", {"min_src_len": 0, "drop_empty": False, "dedup": False})
    _assert_denominator(ev, "test", published_count(WIKI_TOKENS["test"]), next((tmp_path / "data/toy/bpe/lm/default").iterdir()))


def test_expected_word_count_is_checked_at_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_mirror(tmp_path / "mirror", "corpus", {s: hub_rows(WIKI_TOKENS["test"]) for s in ("train", "validation", "test")})
    study = make_study(tmp_path, {"corpus": {"kind": "lm", "hf_id": "x/corpus", "fields": {"text": "text"},
                                             "text_format": "wikitext", "expected_words": {"test": 245569}}},
                       {"lm": {"kind": "lm", "dataset": "corpus"}})
    with pytest.raises(StageError) as err:
        download.run(study, "corpus")
    msg = one_line(err)
    for part in ("download corpus", "split test", "test.jsonl.gz", "127 words (110 whitespace tokens + 17 lines)",
                 "datasets.corpus.expected_words.test", "245569"):
        assert part in msg, msg
    assert not (tmp_path / "data/toy/raw/corpus").exists() and no_temp_left(tmp_path)


def test_ptb_style_denominator(tmp_path, monkeypatch):
    """PTB: one sentence per row, <unk> and N tokens, no blank lines: words + one <eos> per sentence."""
    sents = ["no it was n't black monday", "but while the new york stock exchange did n't fall apart",
             "some of the <unk> stocks fell N N", "the <unk> index rose N to N"]
    rows = [{"sentence": s} for s in sents]
    monkeypatch.chdir(tmp_path)
    want = published_count("".join(s + "\n" for s in sents))
    assert want == 6 + 11 + 8 + 7 + 4
    splits = {"train": rows * 20, "validation": rows[:2], "test": rows}
    ev, _ = _run_lm(tmp_path, splits, "plain", {"dedup": False, "sample_size": 30}, expected={"test": want},
                    vocab=60, field="sentence")
    _assert_denominator(ev, "test", want, next((tmp_path / "data/toy/bpe/lm/default").iterdir()))
    # scored with windows of lm_seq_len 16 advanced by the default half window, recorded beside the metrics
    n = int(ev["per_example"].query("split == 'test'")["tokens"].sum())
    assert ev["lm_eval"] == {"lm_window": 16, "lm_stride": 8, "lm_mean_context_val": ev["lm_eval"]["lm_mean_context_val"],
                             "lm_mean_context": pytest.approx(np.mean([p - _scoring_window(p, 16, 8) for p in range(1, n + 1)]))}
    assert n > 16 and not [k for k in ev["metrics"] if k.startswith("lm_")]


def test_plain_text_denominator(tmp_path, monkeypatch):
    """Plain multi-line rows: every line of every row, blank and whitespace-only lines included,
    one <eos> each; train drops blank lines (drop_empty), evaluation keeps them."""
    docs = ["a cat sat on the mat .\nthe dog ran .\n\nbirds fly south", "   ", "one more line here\n"]
    text = "".join(d if d.endswith("\n") else d + "\n" for d in docs)  # the same text as a file
    want = published_count(text)
    assert want == 18 + 6
    monkeypatch.chdir(tmp_path)
    ev, stats = _run_lm(tmp_path, {"train": [{"text": d} for d in docs * 30], "validation": [{"text": d} for d in docs],
                                   "test": [{"text": d} for d in docs]}, "plain", {"dedup": False}, vocab=40)
    assert stats["words"]["test"] == {"whitespace_tokens": 18, "lines": 6, "words": want}
    assert stats["rows"]["train"] == 30 * 4 and stats["rows"]["test"] == 6
    _assert_denominator(ev, "test", want, next((tmp_path / "data/toy/bpe/lm/default").iterdir()))


@pytest.mark.skipif(not (REPO.parent / "shared/datasets/ptb/test.jsonl.gz").is_file(),
                    reason="the shared offline mirror (../shared/datasets) is not beside the checkout")
def test_ptb_mirror_counts_are_the_published_ones(tmp_path, monkeypatch):
    """The real PTB test split: 82,430 words incl. <eos> (73,760 validation), counted on the raw rows."""
    monkeypatch.chdir(tmp_path)
    study = make_study(tmp_path, {"ptb": {"kind": "lm", "hf_id": "ptb_text_only", "fields": {"text": "sentence"},
                                          "expected_words": {"validation": 73760, "test": 82430}}},
                       {"ptb": {"kind": "lm", "dataset": "ptb", "filter": {"dedup": False, "sample_size": 500}}},
                       mirror=str(REPO.parent / "shared/datasets"))
    download.run(study, "ptb")
    filt.run(study, "ptb")
    stats = json.loads((tmp_path / "data/toy/filtered/ptb/default/stats.json").read_text())
    assert stats["words"]["test"] == {"whitespace_tokens": 78669, "lines": 3761, "words": 82430}
    assert stats["words"]["validation"]["words"] == 73760 and stats["rows"]["test"] == 3761


def test_report_table_states_the_word_denominator():
    from pipeline_src.report.tables import _word_note

    assert "82,430 words" in _word_note(pd.DataFrame({"test_words_mean": [82430.0, 82430.0]}))
    assert "words:" not in _word_note(pd.DataFrame({"test_ppl_mean": [1.0]}))  # older metrics: no number invented


# --------------------------------------------------------------------------- sliding-window perplexity
# evaluate.lm_nll scores the stream in windows of lm_seq_len tokens advanced by eval.lm_stride.

def _lm_stream(n_lines: int, seed: int, vocab: int = 23) -> tuple[np.ndarray, np.ndarray]:
    """A token stream as batching.load_lm_stream makes it (EOS closing every line) and its line ends."""
    rng = np.random.default_rng(seed)
    lines = [rng.integers(EOS + 1, vocab, int(rng.integers(0, 9))).tolist() for _ in range(n_lines)]
    stream = np.array([t for x in lines for t in x + [EOS]], dtype=np.int64)
    return stream, np.cumsum([len(x) + 1 for x in lines])


def _tiny_decoder(seed: int = 0, vocab: int = 23):
    import torch
    from pipeline_src.model import ModelConfig, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=vocab, arch="decoder_only", d_model=16, n_heads=2, dec_layers=2, d_ff=32,
                                   dropout=0.0, max_len=64, attention_impl="sdpa")).eval()


def _non_overlapping_nll(model, stream, line_ends, seq_len: int, rows: int) -> np.ndarray:
    """The evaluation before sliding windows, as it was written: windows of seq_len tokens side by
    side, each scoring all of its predictions."""
    import torch
    from pipeline_src.train import batching
    from pipeline_src.train.compiling import token_loss

    stream = np.concatenate([[EOS], stream])
    token_nll = np.zeros(len(stream))
    starts = batching.lm_windows(stream, seq_len)
    with torch.no_grad():
        for idx in batching.lm_batches(len(starts), rows, seed=None):
            batch = batching.collate_lm(stream, starts, idx, seq_len)
            logits = model(None, batch["tgt_in"])
            target = batch["tgt_out"]
            loss = token_loss(logits, target, reduction="none").view_as(target).double().numpy()
            for row, w in enumerate(idx):
                n = min(seq_len, len(stream) - 1 - starts[w])
                token_nll[starts[w] + 1: starts[w] + 1 + n] = loss[row, :n]
    bounds = np.concatenate([[1], line_ends + 1])
    return np.add.reduceat(token_nll, bounds[:-1])


def _scoring_window(p: int, window: int, stride: int) -> int:
    """Start of the window that scores stream token p >= 1, from the rule itself: the first window
    scores tokens 1..window, window k >= 1 (start k * stride) the `stride` tokens after those."""
    return 0 if p <= window else -(-(p - window) // stride) * stride


def test_stride_equal_to_the_window_is_the_non_overlapping_evaluation_bit_for_bit():
    import torch
    from pipeline_src.evaluate.evaluator import lm_nll

    model = _tiny_decoder()
    cpu = torch.device("cpu")
    stream, ends = _lm_stream(40, seed=1)
    assert len(stream) % 16  # a final partial window
    for seq_len, rows in ((16, 1), (16, 3), (7, 4)):
        old = _non_overlapping_nll(model, stream, ends, seq_len, rows)
        for stride in (None, seq_len):
            nll, count, mean_context = lm_nll(model, stream, ends, seq_len, rows, cpu, "fp32", stride)
            assert np.array_equal(nll, old) and count.sum() == len(stream)
            # every window but the last full: context 1..seq_len, on average (seq_len + 1) / 2 per token
            full, rest = divmod(len(stream), seq_len)
            want = (full * seq_len * (seq_len + 1) / 2 + rest * (rest + 1) / 2) / len(stream)
            assert mean_context == pytest.approx(want)
    # and token for token: each window by itself, summed
    direct = np.zeros(len(stream) + 1)
    full = np.concatenate([[EOS], stream])
    with torch.no_grad():
        for start in range(0, len(stream), 16):
            window = torch.tensor(full[start: start + 17])[None]
            logp = torch.log_softmax(model(None, window[:, :-1]).float(), -1)[0]
            direct[start + 1: start + window.size(1)] = -logp.gather(1, window[0, 1:, None])[:, 0].double().numpy()
    per_line = np.add.reduceat(direct, np.concatenate([[1], ends + 1])[:-1])
    nll, _, _ = lm_nll(model, stream, ends, 16, 1, cpu, "fp32", 16)
    np.testing.assert_allclose(nll, per_line, rtol=1e-5)


@pytest.mark.parametrize("n, window, stride", [(0, 4, 2), (1, 4, 2), (4, 4, 1), (5, 4, 4), (37, 8, 3), (40, 8, 8),
                                               (41, 8, 5), (100, 16, 1), (100, 16, 16), (17, 16, 15), (33, 16, 8)])
def test_every_token_is_scored_exactly_once(n, window, stride):
    from pipeline_src.evaluate.evaluator import lm_score_windows

    starts, first = lm_score_windows(n, window, stride)
    times, context = np.zeros(n + 1, dtype=int), np.zeros(n + 1, dtype=int)
    for start, lo in zip(starts, first):
        hi = min(window, n - start)
        assert hi > lo or n == 0, (start, lo, hi)  # no window that scores nothing
        times[start + 1 + lo: start + 1 + hi] += 1
        context[start + 1 + lo: start + 1 + hi] = np.arange(lo + 1, hi + 1)
    assert times[0] == 0 and (times[1:] == 1).all()
    for p in range(1, n + 1):  # scored by the window the rule names, with the context that window gives
        assert context[p] == p - _scoring_window(p, window, stride)
        assert context[p] >= (window - stride + 1 if p > window else p)


def test_sliding_windows_score_each_token_with_its_windows_context():
    """stride < window: each token's NLL is that of the model run on the window that scores it."""
    import torch
    from pipeline_src.evaluate.evaluator import lm_nll

    model = _tiny_decoder(seed=2)
    stream, ends = _lm_stream(30, seed=3)
    full = np.concatenate([[EOS], stream])
    window, stride = 12, 5
    want = np.zeros(len(full))
    with torch.no_grad():
        for p in range(1, len(full)):
            start = _scoring_window(p, window, stride)
            ids = torch.tensor(full[start: min(start + window, len(full) - 1)])[None]
            logp = torch.log_softmax(model(None, ids).float(), -1)[0, p - 1 - start]
            want[p] = -float(logp[full[p]])
    nll, count, mean_context = lm_nll(model, stream, ends, window, 4, torch.device("cpu"), "fp32", stride)
    np.testing.assert_allclose(nll, np.add.reduceat(want, np.concatenate([[1], ends + 1])[:-1]), rtol=1e-5)
    assert count.sum() == len(stream)
    assert mean_context == pytest.approx(np.mean([p - _scoring_window(p, window, stride) for p in range(1, len(full))]))


class _PeriodOracle:
    """A language model of a stream that repeats with period P: it knows the next token once the
    token P - 1 back is in its window (uniform over the vocabulary before): its loss depends only
    on how much context a prediction has."""

    def __init__(self, period: int, vocab: int):
        self.period, self.vocab = period, vocab

    def __call__(self, src, tgt):
        import torch

        logits = torch.zeros(*tgt.shape, self.vocab)
        seen = tgt[:, : tgt.size(1) - self.period + 1]  # the token at offset j + 1 - P predicts offset j + 1
        logits[:, self.period - 1:].scatter_(2, seen[..., None], 30.0)
        return logits


def test_a_smaller_stride_gives_more_context_and_a_lower_perplexity():
    import torch
    from pipeline_src.evaluate import metrics
    from pipeline_src.evaluate.evaluator import lm_nll

    period, vocab, window = 10, 40, 24
    cycle = np.random.default_rng(0).permutation(np.arange(EOS + 1, vocab))[:period]
    stream = np.tile(cycle, 30)
    ends = np.arange(period, len(stream) + 1, period)  # (one "line" per period: lines do not matter here)
    ppl, context = {}, {}
    for stride in (1, 5, window // 2, window - period + 1, window - period + 2, window - 1, window):
        nll, count, context[stride] = lm_nll(_PeriodOracle(period, vocab), stream, ends, window, 8,
                                             torch.device("cpu"), "fp32", stride)
        ppl[stride] = metrics.perplexity(float(nll.sum()), int(count.sum()))
    strides = sorted(ppl)
    assert all(ppl[a] <= ppl[b] and context[a] >= context[b] for a, b in zip(strides, strides[1:])), (ppl, context)
    # window - stride >= period - 1: after the first window every token is known
    assert ppl[window - period + 1] == ppl[1] < ppl[window - period + 2] < ppl[window]


@pytest.mark.parametrize("where, value, message", [
    ("task", 0, "tasks.lm.eval.lm_stride: 0 is less than the minimum of 1"),
    ("task", 17, "tasks.lm.eval.lm_stride (cell baseline): 17 must be a whole number of tokens from 1 to "
                 "train.lm_seq_len 16"),
    ("cell", 20, "cells.baseline (task lm): eval.lm_stride: 20 must be a whole number of tokens from 1 to "
                 "train.lm_seq_len 16"),
    ("task", 2.5, "tasks.lm.eval.lm_stride: 2.5 is not of type 'integer', 'null'"),
])
def test_a_bad_stride_is_one_line_naming_the_key(tmp_path, where, value, message):
    task = {"kind": "lm", "dataset": "corpus", **copy.deepcopy(LM_TINY)}
    raw = {"study": "toy", "seeds": [0], "cells": {"baseline": {"family": "baseline"}},
           "datasets": {"corpus": {"kind": "lm", "hf_id": "x/corpus", "fields": {"text": "text"}}}, "tasks": {"lm": task}}
    (task["eval"] if where == "task" else raw["cells"]["baseline"].setdefault("eval", {}))["lm_stride"] = value
    task["cells"] = ["baseline"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_study(tmp_path / "p.yaml")
    assert message in one_line(err)
