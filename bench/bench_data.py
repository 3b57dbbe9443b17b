"""The data stages on >= 100k rows: filter and BPE encoding rows/s, BPE training MB/s.

Builds a temporary mirror whose Multi30k train split is the real one replicated (each copy
made distinct by a trailing marker token, so deduplication keeps it), then times the real
stage code: `download`, `filter` (batched datasets.map in one process, as the stages run by
default, vs. PIPELINE_DATA_PROCS worker processes, default min(cores, 8)), SentencePiece
training and the encoding of every split (one process vs. workers).

    python bench/bench_data.py [--quick] [--mirror ../shared/datasets] [--rows 116000] [--vocab 10000]

Writes reports/bench/data.json (machine, versions, date, numbers) and reports/bench/data.md.
Target: none fixed; it decides whether worker processes pay (PIPELINE_DATA_PROCS). On 2 and on 16
cores they lose at every count (bench/results/h100/README.md), so the stages run in-process.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pipeline_src.data as data_pkg  # noqa: E402
from pipeline_src.data import bpe  # noqa: E402
from pipeline_src.common import cpu_name, package_versions  # noqa: E402
from pipeline_src.study.config import load_study  # noqa: E402
from pipeline_src.data import download, read_parquet  # noqa: E402
from pipeline_src.data import filter as filt  # noqa: E402
from pipeline_src.study.stages import data_paths  # noqa: E402


def build_mirror(src_mirror: Path, dst: Path, rows: int) -> int:
    """Multi30k with train replicated to >= rows rows; validation/test as they are."""
    out = dst / "multi30k"
    out.mkdir(parents=True)
    lines = gzip.decompress((src_mirror / "multi30k" / "train.jsonl.gz").read_bytes()).decode().splitlines()
    lines = lines[:rows]  # (a smoke run takes fewer than one copy)
    copies = -(-rows // len(lines))
    buf = []
    for k in range(copies):
        for line in lines:
            r = json.loads(line)
            if k:
                r = {"en": f"{r['en'].rstrip()} #{k}", "de": f"{r['de'].rstrip()} #{k}"}
            buf.append(json.dumps(r, ensure_ascii=False))
    (out / "train.jsonl.gz").write_bytes(gzip.compress(("\n".join(buf) + "\n").encode(), compresslevel=1, mtime=0))
    for split in ("validation", "test"):
        shutil.copy(src_mirror / "multi30k" / f"{split}.jsonl.gz", out / f"{split}.jsonl.gz")
    return len(buf)


PARAMS = """\
study: bench
mirror: {mirror}
seeds: [0]
datasets:
  multi30k: {{kind: translation, hf_id: bentrevett/multi30k, fields: {{src: en, tgt: de}}}}
tasks:
  multi30k_en_de:
    kind: translation
    dataset: multi30k
    filter: {{unit: words, min_src_len: 1, max_src_len: 100, min_tgt_len: 1, max_tgt_len: 100, max_ratio: 1.5, dedup: true}}
    bpe: {{vocab_size: {vocab}, character_coverage: 1.0}}
    cells: [baseline]
cells:
  baseline: {{family: baseline}}
"""


def timed(fn, *args, **kw) -> float:
    t0 = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2,000 rows, vocabulary 1,000 (smoke test)")
    ap.add_argument("--mirror", default=os.environ.get("PIPELINE_DATA_MIRROR", str(REPO.parent / "shared" / "datasets")))
    ap.add_argument("--rows", type=int, default=116_000, help="train rows after replication (>= 100k)")
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--out", default=str(REPO / "reports" / "bench"))
    args = ap.parse_args()
    if args.quick:
        args.rows, args.vocab = min(args.rows, 2000), min(args.vocab, 1000)
    os.environ.setdefault("PIPELINE_QUIET", "1")

    work = Path(tempfile.mkdtemp(prefix="bench_data."))
    old_cwd = os.getcwd()
    saved_procs = os.environ.get(data_pkg.PROCS_ENV)
    try:
        train_rows = build_mirror(Path(args.mirror), work / "mirror", args.rows)
        params = work / "bench.yaml"
        params.write_text(PARAMS.format(mirror=work / "mirror", vocab=args.vocab))
        os.chdir(work)
        study = load_study(params)
        t_download = timed(download.run, study, "multi30k")
        raw_rows = sum(read_parquet(f"data/bench/raw/multi30k/{s}.parquet").num_rows
                       for s in ("train", "validation", "test"))

        cores = int(saved_procs or min(os.cpu_count() or 1, 8))

        def procs(n: int) -> None:  # how many datasets.map workers the stage code will use
            os.environ[data_pkg.PROCS_ENV] = str(n)

        procs(1)
        t_filter_1 = timed(filt.run, study, "multi30k_en_de")
        procs(cores)
        t_filter_n = timed(filt.run, study, "multi30k_en_de")
        filtered_dir, bpe_dir = data_paths(study, "multi30k_en_de")
        filtered = read_parquet(f"{filtered_dir}/train.parquet")
        texts = filtered.column("src").to_pylist() + filtered.column("tgt").to_pylist()
        model, train_stats = bpe.train_spm(texts, vocab_size=args.vocab, character_coverage=1.0,
                                           max_sentences=10 ** 7, task="bench")
        model_file = work / "spm.model"
        model_file.write_bytes(model)

        def encode_all():
            for side in ("src", "tgt"):
                bpe.encode_texts(filtered, side, str(model_file))

        procs(1)
        t_encode_1 = timed(encode_all)
        procs(cores)
        t_encode_n = timed(encode_all)
        procs(1)                    # the stage as it runs by default
        t_bpe_stage = timed(bpe.run, study, "multi30k_en_de")
        stage_stats = json.loads(Path(bpe_dir, "stats.json").read_text())
    finally:
        os.environ.pop(data_pkg.PROCS_ENV, None)
        if saved_procs is not None:
            os.environ[data_pkg.PROCS_ENV] = saved_procs
        os.chdir(old_cwd)
        shutil.rmtree(work, ignore_errors=True)

    n_enc = filtered.num_rows
    results = {
        "benchmark": "data", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu": cpu_name(), "cores": os.cpu_count(),
                    "worker_processes": cores},
        "versions": package_versions(),
        "command": " ".join(["python bench/bench_data.py", *sys.argv[1:]]), "quick": args.quick,
        "input": {"train_rows": train_rows, "raw_rows_all_splits": raw_rows, "filtered_train_rows": n_enc,
                  "bpe_vocab_size": args.vocab, "bpe_training_mb": round(train_stats["bytes"] / 1e6, 2)},
        "download_s": round(t_download, 2),
        "filter": {"rows": raw_rows, "s_1proc": round(t_filter_1, 2), "s_multiproc": round(t_filter_n, 2),
                   "rows_per_s_1proc": round(raw_rows / t_filter_1), "rows_per_s_multiproc": round(raw_rows / t_filter_n)},
        "bpe_training": {"mb": round(train_stats["bytes"] / 1e6, 2), "s": round(train_stats["seconds"], 2),
                         "mb_per_s": round(train_stats["mb_per_s"], 2), "threads": 1},
        "encode_train": {"rows": n_enc, "sides": 2, "s_1proc": round(t_encode_1, 2), "s_multiproc": round(t_encode_n, 2),
                         "rows_per_s_1proc": round(n_enc / t_encode_1), "rows_per_s_multiproc": round(n_enc / t_encode_n)},
        "bpe_stage_s": round(t_bpe_stage, 2), "bpe_stage_mb_per_s": stage_stats["mb_per_s"],
    }
    f, e, b = results["filter"], results["encode_train"], results["bpe_training"]
    md = "\n".join([
        "# Data stage benchmark",
        "",
        f"{results['date']} · {results['machine']['cpu']} · {results['machine']['cores']} cores "
        f"({cores} worker processes) · datasets {results['versions']['datasets']}, "
        f"sentencepiece {results['versions']['sentencepiece']}, pyarrow {results['versions']['pyarrow']}",
        "",
        f"Multi30k train replicated to {train_rows:,} rows (+ validation/test); `{results['command']}`.",
        "",
        f"| step | rows / data | 1 process (the default) | {cores} `datasets.map` processes |",
        "|---|---:|---:|---:|",
        f"| filter (map + rules + Parquet) | {raw_rows:,} rows | {f['rows_per_s_1proc']:,} rows/s | {f['rows_per_s_multiproc']:,} rows/s |",
        f"| BPE encode (src + tgt; SentencePiece threads) | {n_enc:,} rows | {e['rows_per_s_1proc']:,} rows/s | {e['rows_per_s_multiproc']:,} rows/s |",
        f"| BPE training (vocab {args.vocab}, 1 thread) | {b['mb']} MB | {b['mb_per_s']} MB/s | – |",
        f"| whole `bpe` stage (train + encode 3 splits) | {n_enc:,} train rows | {results['bpe_stage_s']} s | – |",
        f"| `download` (mirror → Parquet) | {raw_rows:,} rows | {results['download_s']} s | – |",
        "",
    ])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "data.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
