"""Summarization decoding at the study's scale: the evaluate stage's decode_all over 2,000
CNN/DailyMail-length articles (target: <= 60 s on an H100, beam 4).

The model is params.yaml's cnn_dailymail baseline cell (d512/6+6, vocabulary 16k, beam 4, summaries
of at most max_len_b = 120 tokens, batches of 32 sorted by source length), with random weights and
EOS suppressed, so every summary runs to the full 120 tokens: the worst case, since a trained
model stops earlier. The sources have real lengths: the mirror's CNN/DailyMail validation and test
articles (unfiltered, as the evaluate stage reads the test split), tokenized by a BPE model trained
here on the mirror's train and validation articles at the task's vocab_size, truncated to
train.max_src_len with EOS appended as batching.load_seq2seq does, and repeated in a fixed
shuffled order up to --articles (eval.max_examples, 2,000; the mirror holds 1,500). The token ids
are random: speed does not depend on them.

Each beam-search implementation (eval.decoding: host, static, and graphs on CUDA) decodes all the
articles once through evaluate.decode_all, cold as one evaluate job meets them (per-shape kernel
plans and graph captures included), after one untimed two-article batch that initialises the
device. Reported: seconds for all articles, articles/s, summary tokens/s, and the share of
summaries identical to those of the first implementation listed.

    python bench/bench_decode_articles.py [--quick] [--articles 2000] [--impls host,static,graphs] [--name decode_articles] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import os
import time

from common import OUT_DIR, REPO, md_table, mirror_dir, sync, torch_setup, write_report

import numpy as np
import torch

from pipeline_src.train import batching
from pipeline_src.study.config import load_study
from pipeline_src.data.tokens import EOS
from pipeline_src.evaluate.evaluator import decode_all
from pipeline_src.model import Transformer
from pipeline_src.train.trainer import model_config

TARGET_S = 60.0  # for 2,000 articles on the H100
TASK, CELL = "cnn_dailymail", "baseline"
QUICK_MODEL = dict(d_model=64, n_heads=4, enc_layers=1, dec_layers=1, d_ff=128)


def read_articles(split: str) -> list[str]:
    path = mirror_dir() / "cnn_dailymail" / f"{split}.jsonl.gz"
    if not path.exists():
        raise SystemExit(f"error: {path} missing (set PIPELINE_DATA_MIRROR to the offline mirror)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["article"] for line in f]


def article_lengths(vocab_size: int, max_src_len: int) -> tuple[list[int], float]:
    """Source lengths in BPE tokens (EOS included) of the mirror's validation + test articles."""
    import sentencepiece as spm
    tick = time.perf_counter()
    validation = read_articles("validation")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(read_articles("train") + validation),
                                   model_writer=model, vocab_size=vocab_size, model_type="bpe",
                                   character_coverage=1.0, max_sentence_length=1 << 20, num_threads=os.cpu_count(),
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    lengths = [min(len(ids), max_src_len - 1) + 1
               for ids in sp.encode(validation + read_articles("test"))]
    return lengths, time.perf_counter() - tick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 24 articles cut to 64 tokens, 8-token summaries")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--params", default=str(REPO / "params.yaml"), help="the study whose cnn_dailymail cell is used")
    ap.add_argument("--articles", type=int, help="articles decoded (default: the cell's eval.max_examples)")
    ap.add_argument("--impls", default="host,static,graphs", help="eval.decoding values, comma-separated "
                    "(graphs runs on CUDA only)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 with --quick)")
    ap.add_argument("--name", default="decode_articles")
    ap.add_argument("--out", default=str(OUT_DIR))
    # as evaluate.run: SDPA's cuDNN backend off (it would build a plan for every decoding step's shape)
    ap.set_defaults(no_cudnn_sdp=True)
    args = ap.parse_args()
    device = torch_setup(args)
    gpu = device.type == "cuda"

    impls = [i for i in args.impls.split(",") if i]
    if not impls or set(impls) - {"host", "static", "graphs"}:
        raise SystemExit(f"error: --impls {args.impls!r}: give host, static and/or graphs, comma-separated")
    impls = [i for i in impls if gpu or i != "graphs"]
    if not impls:
        raise SystemExit("error: --impls graphs needs a CUDA device (eval.decoding graphs runs as static elsewhere)")
    study = load_study(args.params)
    cell = study.cell(TASK, CELL)
    ev, dims = cell.eval, dict(cell.model)
    vocab = study.bpe_config(TASK, cell.filter_variant, cell.bpe_variant).vocab_size
    max_src_len = cell.train.max_src_len
    n = args.articles or ev.max_examples or 2000
    if args.quick:
        dims.update(QUICK_MODEL)
        vocab, max_src_len, n = 1000, 64, args.articles or 24
        ev = dataclasses.replace(ev, max_len_a=0.0, max_len_b=8, batch_size=8)
    lengths, bpe_s = article_lengths(vocab, max_src_len)
    order = np.random.default_rng(0).permutation(len(lengths))
    lengths = [lengths[order[i % len(lengths)]] for i in range(n)]
    rng = np.random.default_rng(1)
    src = [np.append(rng.integers(4, vocab, size=L - 1), EOS).astype(np.int64) for L in lengths]
    data = batching.Seq2SeqData(src, [np.zeros(0, dtype=np.int64)] * n)

    torch.manual_seed(0)
    model = Transformer(model_config(dataclasses.replace(cell, model=dims), vocab)).to(device).eval()
    never = torch.tensor([EOS], device=device)
    # EOS can never win: every summary runs to max_len_b (the hook's output replaces the logits).
    model.lm_head.register_forward_hook(lambda mod, inp, out: out.index_fill(-1, never, float("-inf")))
    precision = cell.train.precision

    warm = batching.Seq2SeqData(src[:2], data.tgt[:2])
    decode_all(model, warm, dataclasses.replace(ev, decoding="host"), device, precision, "warm-up")
    rows, results, hyps = [], [], {}
    for impl in impls:
        sync(device)
        tick = time.perf_counter()
        hyps[impl] = decode_all(model, data, dataclasses.replace(ev, decoding=impl), device, precision,
                                f"decode {impl}")
        sync(device)
        s = time.perf_counter() - tick
        out_lens = sorted({len(h) for h in hyps[impl]})
        out_tokens = sum(map(len, hyps[impl]))
        same = sum(a == b for a, b in zip(hyps[impl], hyps[impls[0]])) / n
        met = (s <= TARGET_S) if gpu and n >= 2000 else None
        rows.append([impl, f"{s:.2f}" if s < 10 else f"{s:.1f}", f"{n / s:.1f}", f"{out_tokens / s:,.0f}",
                     "–".join(map(str, (out_lens[0], out_lens[-1]))), f"{same:.0%}",
                     {True: "yes", False: "NO", None: "–"}[met]])
        results.append({"impl": impl, "seconds": s, "articles_per_s": n / s,
                        "summary_tokens_per_s": out_tokens / s, "summary_lengths": out_lens,
                        f"identical_to_{impls[0]}": same, "target_met": met})

    batches = -(-n // ev.batch_size)
    name = f"d{dims['d_model']}/{dims['enc_layers']}+{dims['dec_layers']}"
    md = (f"{name} (heads {dims['n_heads']}, d_ff {dims['d_ff']}, vocabulary {vocab}), random weights, EOS "
          f"suppressed; {n} articles of real CNN/DailyMail lengths (BPE tokens: mean {np.mean(lengths):.0f}, "
          f"max {max(lengths)}; BPE trained here in {bpe_s:.1f} s), {batches} batch{'es' if batches > 1 else ''} of "
          f"{ev.batch_size} sorted by "
          f"length, beam {ev.beam_size}, length penalty {ev.length_penalty}, summaries of "
          f"{int(ev.max_len_b)} tokens; one cold pass of evaluate.decode_all per implementation; device {device}"
          + (" (bf16 autocast)" if gpu and precision in ("auto", "bf16") else f", {torch.get_num_threads()} threads")
          + f". Target: {n if n >= 2000 else 2000} articles in ≤ {TARGET_S:.0f} s on the H100.\n\n"
          + md_table(["eval.decoding", f"s for {n} articles", "articles/s", "summary tokens/s", "summary length",
                      f"same as {impls[0]}", "target met"], rows) + "\n")
    write_report(args.name, "Decoding CNN/DailyMail-length articles (the evaluate stage's decode_all)",
                 {"device": str(device), "task": TASK, "cell": CELL, "params": args.params,
                  "model": dict(dims, vocab_size=vocab), "articles": n, "batch_size": ev.batch_size,
                  "beam": ev.beam_size, "length_penalty": ev.length_penalty, "max_len_b": ev.max_len_b,
                  "source_lengths": {"mean": float(np.mean(lengths)), "max": int(max(lengths)),
                                     "min": int(min(lengths))}, "bpe_seconds": bpe_s,
                  "target_s": TARGET_S, "results": results}, md, quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
