"""Evaluate one trained task x cell x seed.

Perplexity on validation and test, per token and per word (per word is the one comparable across
tokenizers, see report.TOKEN_LEVEL). Language modelling: the split's token stream is scored with
a sliding window of train.lm_seq_len tokens advanced by eval.lm_stride tokens, each token once,
and after the first window from at least lm_seq_len - lm_stride + 1 tokens of context
(lm_score_windows); per word it compares with published PTB/WikiText figures: the NLL covers
every line of the split, blank lines and WikiText headings included, each line's <eos> too, and
is divided by the split's word count as that work counts it (from the raw rows: every whitespace
token plus one <eos> per line; PTB test 82,430, WikiText-2 test 245,569; see data.lm_word_count).
Translation: beam search on the test set, SentencePiece detokenization, BLEU and chrF with
sacrebleu (signatures saved). Summarisation: ROUGE-1/2/Lsum F1 with rouge-score and bootstrap
95 % intervals, beside the lead-3 baseline on the same articles. Per-example NLLs and scores are
saved for the aggregate stage's paired tests.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..common import StageError, atomic_dir, atomic_write_json, progress, provenance, seed_everything
from ..data.tokens import EOS, PAD, load_spm
from ..model import beam_search
from ..model.checkpoint import load_trained_model
from .static_decode import beam_search_static
from ..runtime.gpu_slots import select_device
from ..study import screening, seed_plan
from ..study.config import Study
from ..study.paths import data_paths, output_path
from ..train import batching
from ..train.compiling import token_loss
from ..train.precision import autocast
from . import metrics


@torch.no_grad()
def seq2seq_nll(model, data: batching.Seq2SeqData, arch: str, batch_tokens: int, device, precision: str):
    """Per-example summed NLL and target-token count (target + EOS), in file order."""
    nll = np.zeros(len(data))
    tokens = np.zeros(len(data), dtype=np.int64)
    for idx in batching.seq2seq_batches(data, batch_tokens, arch, seed=None):
        batch = batching.to_device(batching.collate_seq2seq(data, idx, arch), device)
        with autocast(device, precision):
            logits = model(batch["src"], batch["tgt_in"])
        target = batch["tgt_out"]
        # Over the (batch, vocab, time) view, unlike lm_nll: the committed summarisation check
        # (reports/reference/cnndm/check/) holds these floats bit for bit, and at summaries'
        # few target tokens the faster layout would save only seconds per evaluation.
        loss = F.cross_entropy(logits.float().transpose(1, 2), target, ignore_index=PAD, reduction="none")
        nll[idx] = loss.sum(1).double().cpu().numpy()
        tokens[idx] = (target != PAD).sum(1).cpu().numpy()
    return nll, tokens


def lm_score_windows(n_targets: int, window: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Sliding-window scoring of a stream of n_targets + 1 tokens whose tokens 1..n_targets are
    predicted (token 0 is context only): (start of each window, first scored offset in it).

    Window k reads tokens starts[k] .. starts[k] + window - 1 (fewer at the end of the stream) and
    predicts the token after each; the prediction at offset j sees j + 1 tokens. The first window
    scores all of its predictions; every later one, `stride` tokens further, only its last
    `stride` ones (offsets window - stride .. window - 1), which no earlier window scored. So every
    token is scored exactly once and, after the first window, from at least window - stride + 1
    tokens. stride == window: the non-overlapping windows (batching.lm_windows), token for token."""
    later = max(0, (n_targets - window - 1) // stride + 1)  # windows after the first
    starts = np.arange(later + 1, dtype=np.int64) * stride
    first_scored = np.full(later + 1, window - stride, dtype=np.int64)
    first_scored[0] = 0
    return starts, first_scored


@torch.no_grad()
def lm_nll(model, stream: np.ndarray, line_ends: np.ndarray, seq_len: int, rows: int, device, precision: str,
           stride: int | None = None):
    """Per-line summed NLL and token count (the line's BPE tokens + its EOS) over the token stream,
    scored in windows of seq_len tokens advanced by `stride` (default seq_len: non-overlapping;
    see lm_score_windows), `rows` windows a batch; also the mean context of the scored tokens (the
    tokens each prediction sees).

    An EOS is put before the stream as context, as if a line had just ended, so that every token
    of the split is predicted exactly once (the first one too), with up to seq_len tokens of context."""
    stride = seq_len if stride is None else stride
    stream = np.concatenate([[EOS], stream])
    line_ends = line_ends + 1
    token_nll = np.zeros(len(stream))
    context = np.zeros(len(stream), dtype=np.int64)  # stays 0 where a token went unscored
    starts, first_scored = lm_score_windows(len(stream) - 1, seq_len, stride)
    for idx in batching.lm_batches(len(starts), rows, seed=None):
        batch = batching.to_device(batching.collate_lm(stream, starts, idx, seq_len), device)
        with autocast(device, precision):
            logits = model(None, batch["tgt_in"])
        # The training loss's layout, vocabulary last and contiguous: ~3x faster than over a
        # (batch, vocab, time) view at a 10k vocabulary, where it was half of the stage's time.
        loss = token_loss(logits, batch["tgt_out"], reduction="none").view_as(batch["tgt_out"])
        loss = loss.double().cpu().numpy()
        for row, w in enumerate(idx):
            lo, hi = first_scored[w], min(seq_len, len(stream) - 1 - starts[w])
            token_nll[starts[w] + 1 + lo: starts[w] + 1 + hi] = loss[row, lo:hi]
            context[starts[w] + 1 + lo: starts[w] + 1 + hi] = np.arange(lo + 1, hi + 1)
    if len(stream) > 1 and not context[1:].all():
        raise StageError(f"lm_nll: {int((context[1:] == 0).sum())} tokens left unscored "
                         f"(window {seq_len}, stride {stride})")
    bounds = np.concatenate([[1], line_ends])  # token 0 is the context EOS, never predicted
    per_line = np.add.reduceat(token_nll, bounds[:-1]) if len(line_ends) else np.zeros(0)
    mean_context = float(context[1:].mean()) if len(stream) > 1 else float("nan")
    return per_line, np.diff(bounds), mean_context


def _word_denominator(study: Study, task: str, split: str, lines: int, words_read: int,
                      cell: str | None = None) -> int:
    """The split's per-word denominator, counted by the filter stage on the raw rows as published
    PTB/WikiText results count it; refused unless the NLL just computed covers that whole split."""
    path = Path(data_paths(study, task, cell)[0]) / "stats.json"
    counted = (json.loads(path.read_text()).get("words") or {}).get(split)
    if counted is None:
        raise StageError(f"evaluate {task}: {path}: no word count for split {split}; rerun filter --task {task}")
    if (lines, words_read) != (counted["lines"], counted["words"]):
        raise StageError(
            f"evaluate {task}: split {split}: the evaluated text has {lines} lines / {words_read} words but the raw "
            f"split has {counted['lines']} / {counted['words']} ({path}): the perplexity would not cover the whole "
            f"split; rerun filter and bpe --task {task}")
    return int(counted["words"])


def _references(study: Study, task: str, split: str, bpe_dir: Path, cell: str | None = None) -> dict[str, list]:
    """The filtered split's columns (rows the BPE stage's token-length cuts kept, in order).
    Read with pyarrow, not pandas: importing pandas is a tenth of a small evaluation job."""
    import pyarrow.parquet as pq

    # (ParquetFile, not read_table: the dataset API behind read_table imports pandas)
    columns = pq.ParquetFile(Path(data_paths(study, task, cell)[0]) / f"{split}.parquet").read().to_pydict()
    index_file = bpe_dir / f"{split}.index.npy"
    if index_file.exists():
        keep = np.load(index_file).tolist()
        columns = {name: [values[i] for i in keep] for name, values in columns.items()}
    return columns


def _tsv(columns: list[str], rows: list[list]) -> str:
    """Tab-separated table; floats with 6 decimals, NaN as an empty field (as pandas writes them)."""
    def cell(v) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.6f}"
        return str(v)
    return "".join("\t".join(map(cell, row)) + "\n" for row in [columns] + rows)


def decoding_method(ev, model, device) -> str:
    """The beam search eval.decoding asks for, as it can run here (see config.EvalConfig)."""
    if ev.decoding in ("auto", "host") or model.cfg.arch == "encoder_only" or model.cfg.copy_attention \
            or ev.no_repeat_ngram:
        return "host"
    return "graphs" if ev.decoding == "graphs" and device.type == "cuda" else "static"


@torch.no_grad()
def decode_all(model, data: batching.Seq2SeqData, ev, device, precision: str, desc: str) -> list[list[int]]:
    method = decoding_method(ev, model, device)
    order = np.argsort([len(s) for s in data.src], kind="stable")
    hyps: list[list[int] | None] = [None] * len(data)
    bar = progress(total=len(data), desc=desc, unit="sent")
    for start in range(0, len(order), ev.batch_size):
        idx = order[start: start + ev.batch_size].tolist()
        src = batching.pad_rows([data.src[i] for i in idx]).to(device)
        with autocast(device, precision):  # beam_size 1 is exactly greedy search (tested)
            if method == "host":
                out = beam_search(model, src, beam_size=ev.beam_size, length_penalty=ev.length_penalty,
                                  max_len_a=ev.max_len_a, max_len_b=ev.max_len_b, no_repeat_ngram=ev.no_repeat_ngram)
            else:
                out = beam_search_static(model, src, beam_size=ev.beam_size, length_penalty=ev.length_penalty,
                                         max_len_a=ev.max_len_a, max_len_b=ev.max_len_b,
                                         cuda_graphs=method == "graphs")
        for i, h in zip(idx, out):
            hyps[i] = h
        bar.update(len(idx))
    bar.close()
    return hyps


def run(study: Study, task: str, cell_name: str, seed: int) -> None:
    screening.require_own_run(study, "evaluate", task, cell_name)
    if screening.write_not_promoted_eval(study, task, cell_name, seed):  # its training was not promoted
        return
    if seed_plan.write_not_needed_eval(study, task, cell_name, seed):  # an adaptive seed the plan did not ask for
        return
    cell = study.cell(task, cell_name)
    path_fields = dict(study=study.name, task=task, cell=cell_name, seed=seed)
    ckpt = Path(output_path("train", "ckpt", **path_fields))
    bpe_dir = Path(data_paths(study, task, cell_name)[1])  # the cell's data variant
    if not (ckpt / "best.pt").exists():
        raise StageError(f"{ckpt}: no best.pt; run the train stage for {task}/{cell_name}/seed{seed} first")

    seed_everything(seed)
    device = select_device(study)
    if device.type == "cuda":
        # cuDNN attention builds a plan for every new (batch, length) shape, and decoding meets
        # a new shape every step: 8.35 s cold vs 0.15 s without it (bench/bench_decode.py, H100).
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, meta = load_trained_model(ckpt, device)
    sp = load_spm(bpe_dir)
    evaluation = lm_evaluation if cell.kind == "lm" else seq2seq_evaluation
    result, per_example, samples, files = evaluation(study, task, cell_name, seed, model, sp, bpe_dir, device)
    write_outputs(study, task, cell_name, seed, model, device, meta, result, per_example, samples, files)


def lm_evaluation(study: Study, task: str, cell_name: str, seed: int, model, sp, bpe_dir: Path, device):
    """Perplexity per token and per word on validation and test; a few greedy continuations.
    Returns (metrics, per-example rows, samples, files for outputs/)."""
    cell = study.cell(task, cell_name)
    t = cell.train
    result, per_example = {}, []
    rows = max(1, t.batch_tokens // t.lm_seq_len)
    stride = cell.eval.lm_stride
    # What the perplexities were scored with: written beside the metrics, not among them, because
    # they are settings, not results, which no claim or significance test may compare across cells.
    lm_eval = {"lm_window": t.lm_seq_len, "lm_stride": stride}
    test_lines: list = []
    for split in ("validation", "test"):
        stream, ends = batching.load_lm_stream(bpe_dir, split)
        nll, count, mean_context = lm_nll(model, stream, ends, t.lm_seq_len, rows, device, t.precision, stride)
        lm_eval["lm_mean_context" if split == "test" else "lm_mean_context_val"] = mean_context
        lines = _references(study, task, split, bpe_dir, cell_name)["text"]
        line_words = [len(str(x).split()) + 1 for x in lines]
        words = _word_denominator(study, task, split, len(ends), sum(line_words), cell_name)
        short = "val" if split == "validation" else "test"
        result[f"{short}_loss"] = float(nll.sum() / count.sum())
        result[f"{short}_ppl"] = metrics.perplexity(float(nll.sum()), int(count.sum()))
        result[f"{short}_ppl_word"] = metrics.perplexity(float(nll.sum()), words)
        result[f"{short}_words"] = words  # the denominator, stated beside the figure
        per_example += [{"split": split, "index": i, "nll": float(a), "tokens": int(b), "words": w}
                        for i, (a, b, w) in enumerate(zip(nll, count, line_words))]
        test_lines = lines
    samples = [] if cell.leaks_future else _lm_samples(model, sp, test_lines, cell.eval.n_samples, device)
    result["lm_eval"] = lm_eval
    return result, per_example, samples, {}


def seq2seq_evaluation(study: Study, task: str, cell_name: str, seed: int, model, sp, bpe_dir: Path, device):
    """Perplexity on validation and test; beam search on test, scored with BLEU/chrF (translation)
    or ROUGE beside lead-3 (summarisation). Returns (metrics, per-example rows, samples, files)."""
    cell = study.cell(task, cell_name)
    ev, t, arch = cell.eval, cell.train, cell.model["arch"]
    result, per_example, references = {}, [], {}
    for split in ("validation", "test"):
        data = batching.load_seq2seq(bpe_dir, split, t.max_src_len, t.max_tgt_len,
                                     limit=ev.max_examples if split == "test" else None)
        nll, count = seq2seq_nll(model, data, arch, t.batch_tokens, device, t.precision)
        short = "val" if split == "validation" else "test"
        result[f"{short}_loss"] = float(nll.sum() / count.sum())
        result[f"{short}_ppl"] = metrics.perplexity(float(nll.sum()), int(count.sum()))
        # Per-word perplexity: the same summed NLL over the reference's words (+1 for the
        # end of sequence), so cells with different tokenizers compare; per-token cannot.
        references[split] = _references(study, task, split, bpe_dir, cell_name)
        ref_words = [len(str(x).split()) + 1 for x in references[split]["tgt"][: len(nll)]]
        result[f"{short}_ppl_word"] = metrics.perplexity(float(nll.sum()), int(sum(ref_words)))
        per_example += [{"split": split, "index": i, "nll": float(a), "tokens": int(b), "words": w}
                        for i, (a, b, w) in enumerate(zip(nll, count, ref_words))]
    test = batching.load_seq2seq(bpe_dir, "test", t.max_src_len, t.max_tgt_len, limit=ev.max_examples)
    refs_frame = {k: v[: len(test)] for k, v in references["test"].items()}
    hyp_ids = decode_all(model, test, ev, device, t.precision, desc=f"decode {task}/{cell_name}/s{seed}")
    hyps = [sp.decode(h) for h in hyp_ids]
    refs = [str(r) for r in refs_frame["tgt"]]
    srcs = [str(s) for s in refs_frame["src"]]
    if cell.kind == "translation":
        bleu, chrf = metrics.bleu(hyps, refs), metrics.chrf(hyps, refs)
        result.update(bleu=bleu["bleu"], bleu_signature=bleu["signature"], chrf=chrf["chrf"],
                      chrf_signature=chrf["signature"])
        files = {"hyps.txt": _lines(hyps), "refs.txt": _lines(refs), "srcs.txt": _lines(srcs)}
    else:
        tokenized = study.datasets[study.task(task).dataset].text_format == "tokenized"
        result_rouge, files = _summary_scores(hyps, refs, srcs, ev.bootstrap, seed, tokenized)
        result.update(result_rouge)
    samples = [{"source": s, "reference": r, "hypothesis": h} for s, r, h in zip(srcs, refs, hyps)][: ev.n_samples]
    return result, per_example, samples, files


def _summary_scores(hyps: list[str], refs: list[str], srcs: list[str], n_boot: int, seed: int,
                    tokenized: bool = False) -> tuple[dict, dict]:
    """ROUGE of the summaries and of the lead-3 baseline on the same articles, and the files.
    tokenized: the dataset's text is PTB-tokenised (sentences end at standalone . ! ? tokens)."""
    scores, per = metrics.rouge(hyps, refs, n_boot=n_boot, seed=seed, tokenized=tokenized)
    lead = [metrics.lead3(s, tokenized) for s in srcs]
    lead_scores, lead_per = metrics.rouge(lead, refs, n_boot=n_boot, seed=seed, tokenized=tokenized)
    result = dict(scores)
    result.update({f"lead3_{k}": v for k, v in lead_scores.items() if not k.endswith("_ci")})
    files = {
        "predictions.jsonl": "".join(json.dumps({"source": s, "reference": r, "hypothesis": h, "lead3": l},
                                                ensure_ascii=False) + "\n"
                                     for s, r, h, l in zip(srcs, refs, hyps, lead)),
        "scores.tsv": _tsv(list(per[0]) + [f"lead3_{k}" for k in lead_per[0]],
                           [[p[k] for k in p] + [q[k] for k in q] for p, q in zip(per, lead_per)]),
    }
    return result, files


def write_outputs(study: Study, task: str, cell_name: str, seed: int, model, device, meta: dict, result: dict,
                  per_example: list[dict], samples: list[dict], files: dict[str, str]) -> None:
    """outputs/ (per-example NLLs and the decoded files), eval_metrics.json (numbers only: the
    metrics, and for lm the window, stride and mean context they were scored with, in `lm_eval`
    beside them) and eval_info.json (identity, metric signatures, samples, provenance)."""
    cell = study.cell(task, cell_name)
    path_fields = dict(study=study.name, task=task, cell=cell_name, seed=seed)
    with atomic_dir(Path(output_path("evaluate", "outputs", **path_fields))) as tmp:
        columns = ["split", "index", "nll", "tokens", "words"]
        (tmp / "per_example.tsv").write_text(_tsv(columns, [[p[c] for c in columns] for p in per_example]))
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    signatures = {k: result.pop(k) for k in [k for k in result if k.endswith("_signature")]}
    lm_eval = result.pop("lm_eval", None)
    atomic_write_json(Path(output_path("evaluate", "metrics", **path_fields)), {
        "metrics": result, "n_test": int(sum(p["split"] == "test" for p in per_example)),
        "checkpoint_step": meta.get("step"), **({"lm_eval": lm_eval} if lm_eval else {})})
    atomic_write_json(Path(output_path("evaluate", "info", **path_fields)), {
        "task": task, "cell": cell_name, "seed": seed, "kind": cell.kind, "family": cell.family, "label": cell.label,
        "leaks_future": cell.leaks_future, "signatures": signatures, "samples": samples,
        "decoding": decoding_method(cell.eval, model, device) if cell.kind != "lm" else None,
        "provenance": provenance(study, seed=seed)})
    shown = ", ".join(f"{k}={v:.3f}" for k, v in result.items() if isinstance(v, float) and not math.isnan(v))
    print(f"evaluated {task}/{cell_name}/seed{seed}: {shown}", flush=True)


def _lines(texts: list[str]) -> str:
    return "".join(t.replace("\n", " ") + "\n" for t in texts)


@torch.no_grad()
def _lm_samples(model, sp, lines, n: int, device, prefix_words: int = 4, new_tokens: int = 16) -> list[dict]:
    """Greedy continuations of the first words of a few test lines (blank lines skipped; the
    prompt and continuation stay within the model's max_len positions)."""
    out = []
    max_len = model.cfg.max_len
    for line in [x for x in lines if str(x).split()][:n]:
        words = str(line).split()
        prompt = " ".join(words[:prefix_words])
        ids = torch.tensor([sp.encode(prompt)[: max_len - 1]], device=device)
        for _ in range(min(new_tokens, max_len - ids.size(1))):
            nxt = model(None, ids)[0, -1].argmax()
            if int(nxt) == model.cfg.eos_id:
                break
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append({"source": prompt, "reference": str(line), "hypothesis": sp.decode(ids[0].tolist())})
    return out
