"""Static-shape length buckets, the batch stream and its prefetch thread (pipeline_src/train/batching.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline_src.train import batching
from pipeline_src.data.tokens import PAD
from project_copy import checkout_env

ROOT = Path(__file__).resolve().parent.parent
MIRROR = Path(os.environ.get("PIPELINE_DATA_MIRROR", ROOT.parent / "shared" / "datasets"))


def _synthetic(n: int = 2000, seed: int = 0) -> batching.Seq2SeqData:
    rng = np.random.default_rng(seed)
    src_len = rng.integers(2, 60, n)
    tgt_len = np.clip(src_len + rng.integers(-5, 6, n), 1, None)
    return batching.Seq2SeqData([rng.integers(4, 100, k) for k in src_len], [rng.integers(4, 100, k) for k in tgt_len])


def test_bucket_length_grid():
    for per_octave in (2, 4, 8):
        grid = sorted({batching.bucket_length(n, per_octave) for n in range(1, 513)})
        for n in range(1, 513):
            b = batching.bucket_length(n, per_octave)
            assert n <= b and (b - n) / n < 1 / per_octave and b in grid
        # per_octave exact small lengths, then per_octave values in each doubling
        assert len(grid) <= per_octave * (1 + np.log2(512 / per_octave)) + 1
    assert [batching.bucket_length(n, 4) for n in (3, 4, 5, 6, 7, 9, 17, 33)] == [3, 4, 5, 6, 7, 10, 20, 40]
    # any per_octave works (was a division by zero for 6 at n = 7): never shorter, under 1/per_octave + 1 longer
    for per_octave in (3, 5, 6, 7, 12):
        for n in range(1, 300):
            b = batching.bucket_length(n, per_octave)
            assert n <= b < n * (1 + 1 / per_octave) + 1


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_static_buckets_bound_the_distinct_shapes_of_an_epoch(arch):
    data, batch_tokens, per_octave = _synthetic(), 1024, 4
    lengths = {batching.bucket_length(batching._padded_len(data, i, arch), per_octave) for i in range(len(data))}
    shapes_per_epoch, orders = [], []
    for epoch in range(3):
        plans = batching.seq2seq_bucket_batches(data, batch_tokens, arch, per_octave, seed=7, epoch=epoch)
        seen = sorted(i for idx, _, _ in plans for i in idx)
        assert seen == list(range(len(data)))  # every example exactly once
        shapes = set()
        for plan in plans:
            batch = batching.collate_seq2seq(data, *plan[:1], arch, plan[1], plan[2])
            rows, length = batch["tgt_in"].shape
            if batch["src"] is not None:
                assert batch["src"].shape[0] == rows and (batch["src"].shape[1], length) == plan[1]
                length = max(plan[1])
            assert rows * length <= batch_tokens
            shapes.add((rows, plan[1]))
        shapes_per_epoch.append(shapes)
        orders.append([idx for idx, _, _ in plans])
        assert len(shapes) == len(lengths)  # one shape per bucket, however many batches
    assert shapes_per_epoch[0] == shapes_per_epoch[1] == shapes_per_epoch[2]
    assert orders[0] != orders[1]  # still shuffled from epoch to epoch
    assert len(shapes_per_epoch[0]) <= 4 * 6  # 4 per doubling for lengths up to ~128
    dynamic = {tuple(batching.collate_seq2seq(data, idx, arch)["tgt_in"].shape)
               for idx in batching.seq2seq_batches(data, batch_tokens, arch, seed=7)}
    assert len(dynamic) > 2 * len(shapes_per_epoch[0])  # what the buckets replace


def test_empty_rows_and_unpadded_lm_windows():
    stream = np.arange(4, 4 + 50)
    starts = batching.lm_windows(stream, 8)
    full = batching.collate_lm(stream, starts, [0, 1], 8)
    assert full["unpadded"] and full["tgt_in"].shape == (2, 8)
    last = batching.collate_lm(stream, starts, [len(starts) - 1], 8, rows=3)  # short window, padded rows
    assert not last["unpadded"] and last["tgt_in"].shape == (3, 8) and (last["tgt_in"][1:] == PAD).all()
    assert batching.pad_slots(last) == (int((last["tgt_in"] == PAD).sum()), 24)


def _numbers(n_fail: int | None = None):
    for i in range(10):
        if i == n_fail:
            raise RuntimeError("collate failed")
        yield i, {"x": torch.full((2, 3), i)}


def test_prefetcher_yields_the_same_items_in_order_and_passes_errors_on():
    got = list(batching.Prefetcher(_numbers(), depth=2))
    assert [i for i, _ in got] == list(range(10)) and all((b["x"] == i).all() for i, b in got)
    with pytest.raises(RuntimeError, match="collate failed"):
        list(batching.Prefetcher(_numbers(n_fail=4), depth=2))
    early = batching.Prefetcher(_numbers(), depth=1)
    next(early)
    early.close()  # a stopped run leaves no thread behind
    assert not early._thread.is_alive()


def test_batch_stream_resumes_at_a_data_position():
    plans = lambda epoch: [[epoch, k] for k in range(3)]  # noqa: E731
    stream = batching.batch_stream(plans, lambda p: tuple(p), 0, 0)
    first = [next(stream) for _ in range(7)]
    assert [(e, i) for e, i, _ in first] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 1)]
    resumed = batching.batch_stream(plans, lambda p: tuple(p), *first[3][:2])
    assert [next(resumed) for _ in range(3)] == first[4:]
    at_end = batching.batch_stream(plans, lambda p: tuple(p), 0, 3)  # saved after an epoch's last batch
    assert next(at_end) == first[3]


@pytest.mark.skipif(not (MIRROR / "multi30k").is_dir(), reason="needs the offline mirror's Multi30k")
def test_multi30k_static_buckets_pad_at_most_ten_percent(tmp_path):
    """The real study's Multi30k task (params.yaml: filter, BPE 10k, batch_tokens, length_buckets):
    padding of one epoch's static-shape batches, empty rows included."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    task = params["tasks"]["multi30k_en_de"]
    study = {"study": "padcheck", "mirror": str(MIRROR), "seeds": [0],
             "datasets": {"multi30k": params["datasets"]["multi30k"]},
             "tasks": {"multi30k_en_de": dict(task, cells=["baseline"])},
             "cells": {"baseline": {"family": "baseline"}}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(study))
    env = checkout_env()
    for stage, arg in [("download", ["--dataset", "multi30k"]), ("filter", ["--task", "multi30k_en_de"]),
                       ("bpe", ["--task", "multi30k_en_de"])]:
        subprocess.run([sys.executable, "-m", "pipeline_src", stage, "--params", "p.yaml", *arg], cwd=tmp_path,
                       env=env, check=True, capture_output=True)
    t = task["train"]
    assert t["length_buckets"] > 0
    from pipeline_src.study.config import load_study
    from pipeline_src.study.stages import data_paths

    bpe_dir = data_paths(load_study(tmp_path / "p.yaml"), "multi30k_en_de")[1]  # the baseline's tokenizer
    data = batching.load_seq2seq(tmp_path / bpe_dir, "train", 256, 256)
    for arch in ("encoder_decoder", "decoder_only"):
        plans = batching.seq2seq_bucket_batches(data, t["batch_tokens"], arch, t["length_buckets"], seed=0)
        pad = np.sum([batching.pad_slots(batching.collate_seq2seq(data, idx, arch, length, rows)) for idx, length, rows
                      in plans], axis=0)
        fraction = pad[0] / pad[1]
        print(f"{arch}: {len(plans)} batches, {len({p[1:] for p in plans})} shapes, pad fraction {fraction:.3f}")
        assert fraction <= 0.10
