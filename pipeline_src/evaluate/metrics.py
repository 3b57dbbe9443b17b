"""Pure scoring functions: corpus BLEU/chrF, ROUGE, Lead-3, perplexity and paired tests.

No I/O and no global state: every function takes plain lists/arrays and returns plain Python
values, so the evaluate stage and the aggregate stage compute identical numbers.

Conventions
-----------
* BLEU and chrF are sacrebleu's defaults (BLEU: 13a tokenisation, exp smoothing, mixed case;
  chrF: chrF2, character order 6) on *detokenised* text, one reference per hypothesis. They
  equal `sacrebleu refs.txt -i hyps.txt -m bleu chrf` on the same lines.
* ROUGE is Google's `rouge-score` (ROUGE-1, ROUGE-2, ROUGE-Lsum, Porter stemming), reported as
  F1 x 100. ROUGE-Lsum needs one sentence per line; nltk's punkt data is not available
  offline, so `split_sentences` is a small regex splitter (newlines always end a sentence).
* Perplexity is exp(total NLL / total tokens): a corpus-level ratio, not a mean of
  per-sequence perplexities.

Significance tests (all paired: both systems are scored on the same test examples, and a
bootstrap resample draws the same example indices for both)
---------------------------------------------------------------------------------------------
* `paired_bootstrap_bleu`: sacrebleu's own paired bootstrap resampling
  (`sacrebleu.significance.PairedTest(test_type="bs")`, the test behind `sacrebleu --paired-bs`,
  a port of Moses' bootstrap-hypothesis-difference-significance.pl). It is two-sided: the
  statistic is |BLEU(cell) - BLEU(base)| compared with the centred bootstrap distribution of
  that absolute difference; p = (c + 1) / (n + 1). Same seed -> same p as the CLI run with
  SACREBLEU_SEED=<seed>. One deviation: for two *identical* systems sacrebleu returns
  p = 1/(n+1) (its strict ">" never counts a zero difference); we return p = 1.0 there,
  the only sensible answer for "is this system different from itself".
* `paired_bootstrap_mean` (per-example scores such as ROUGE) and `paired_bootstrap_ppl`
  (corpus perplexity from per-sequence NLL sums) use the same paired resampling of example
  indices and a two-sided test of H0 "no difference" by the shift method
  (Efron & Tibshirani 1993, §16.4; Berg-Kirkpatrick et al. 2012):
      d  = stat(cell) - stat(base) on the full test set
      d* = the same difference on each of n resamples
      p  = (1 + #{ |d* - d| >= |d| }) / (n + 1)
  They also return the one-sided `p_not_better` for H0 "the cell is not better than the
  baseline": (1 + #{ s(d* - d) >= s d }) / (n + 1), s = +1 if higher is better else -1,
  and a 95 % percentile interval of d.
"""
from __future__ import annotations

import math
import os
import re
import threading
from typing import Callable, Sequence

import numpy as np

ROUGE_TYPES = ("rouge1", "rouge2", "rougeLsum")


def _check_pair(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")


# --- translation ---------------------------------------------------------------------------------


def bleu(hyps: list[str], refs: list[str]) -> dict:
    """Corpus BLEU (sacrebleu defaults) -> {"bleu": float, "signature": str}."""
    from sacrebleu.metrics import BLEU

    _check_pair(hyps, refs)
    metric = BLEU()
    score = metric.corpus_score(list(hyps), [list(refs)])
    return {"bleu": float(score.score), "signature": str(metric.get_signature())}


def chrf(hyps: list[str], refs: list[str]) -> dict:
    """Corpus chrF2 (sacrebleu defaults) -> {"chrf": float, "signature": str}."""
    from sacrebleu.metrics import CHRF

    _check_pair(hyps, refs)
    metric = CHRF()
    score = metric.corpus_score(list(hyps), [list(refs)])
    return {"chrf": float(score.score), "signature": str(metric.get_signature())}


_SACREBLEU_ENV_LOCK = threading.Lock()


def paired_bootstrap_bleu(base_hyps: list[str], cell_hyps: list[str], refs: list[str], n: int = 1000,
                          seed: int = 12345) -> dict:
    """sacrebleu's paired bootstrap test of `cell` against `base` (see the module docstring).

    Returns {"p_value", "delta" (BLEU cell - base), "base", "cell", "cell_mean", "cell_ci"
    (half-width of sacrebleu's 95 % bootstrap interval), "n", "seed", "test"}.
    `seed` must be >= 1: sacrebleu treats seed 0 as "do not seed" (non-deterministic)."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    _check_pair(base_hyps, refs)
    _check_pair(cell_hyps, refs)
    if int(seed) < 1:
        raise ValueError("paired_bootstrap_bleu: seed must be >= 1 (sacrebleu treats 0 as unseeded)")
    if n < 1:
        raise ValueError("paired_bootstrap_bleu: n must be >= 1")
    # PairedTest reads its seed from SACREBLEU_SEED when constructed and when called.
    with _SACREBLEU_ENV_LOCK:
        old = os.environ.get("SACREBLEU_SEED")
        os.environ["SACREBLEU_SEED"] = str(int(seed))
        try:
            test = PairedTest([("base", list(base_hyps)), ("cell", list(cell_hyps))], {"BLEU": BLEU()},
                              [list(refs)], test_type="bs", n_samples=int(n))
            _, scores = test()
        finally:
            if old is None:
                os.environ.pop("SACREBLEU_SEED", None)
            else:
                os.environ["SACREBLEU_SEED"] = old
    base_res, cell_res = scores["BLEU"]
    p = float(cell_res.p_value)
    if list(base_hyps) == list(cell_hyps):
        p = 1.0  # sacrebleu would say 1/(n+1) for a system compared with itself
    return {"p_value": p, "delta": float(cell_res.score - base_res.score), "base": float(base_res.score),
            "cell": float(cell_res.score), "cell_mean": float(cell_res.mean), "cell_ci": float(cell_res.ci),
            "n": int(n), "seed": int(seed), "test": "sacrebleu paired bootstrap (two-sided)"}


# --- summarisation -------------------------------------------------------------------------------

# Words that end in "." without ending a sentence (lower-cased, without the dot).
_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "ft", "vs", "etc", "inc", "ltd", "co",
    "corp", "gen", "gov", "sen", "rep", "sgt", "col", "lt", "capt", "rev", "no", "jan", "feb", "mar",
    "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "e.g", "i.e", "u.s", "u.k",
    "u.n", "a.m", "p.m", "approx", "dept", "est", "fig",
}
# A sentence ends at . ! or ? (possibly followed by closing quotes/brackets), then whitespace,
# then something that can start a sentence.
_BOUNDARY = re.compile(r"""[.!?]['"\u2019\u201d)\]]*(?P<gap>\s+)(?=["'\u2018\u201c(\[]?[A-Z0-9])""")


# Tokenised text (PTB style, e.g. See et al.'s CNN/DailyMail): a sentence ends at a standalone
# . ! ? token, with the closing quotes or brackets that follow it.
_END_TOKENS = {".", "!", "?"}
_CLOSING_TOKENS = {"''", "'", "\"", ")", "-rrb-", "]"}


def _split_tokenized(line: str) -> list[str]:
    sentences, current = [], []
    tokens = line.split()
    for i, tok in enumerate(tokens):
        current.append(tok)
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if (tok in _END_TOKENS or (tok in _CLOSING_TOKENS and current[-2:-1] and current[-2] in _END_TOKENS)) \
                and nxt not in _CLOSING_TOKENS:
            sentences.append(" ".join(current))
            current = []
    if current:
        sentences.append(" ".join(current))
    return sentences


def split_sentences(text: str, tokenized: bool = False) -> list[str]:
    """Split text into sentences with a small regex (no model, no downloaded data).

    Every non-empty line is split on its own, so text that already has one sentence per line
    ("\\n"-joined, e.g. CNN/DailyMail highlights) keeps exactly those sentences; a boundary
    inside a line is end punctuation + whitespace + a capital/digit/opening quote, except
    after a known abbreviation (Mr., Dr., U.S., ...) or a single initial ("J. Smith").
    tokenized: the text is PTB-tokenised (and possibly lower-cased, so no capitals mark a
    start): a sentence ends at a standalone . ! ? token and the closing quotes after it."""
    sentences: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if tokenized:
            sentences += _split_tokenized(line)
            continue
        start = 0
        for m in _BOUNDARY.finditer(line):
            end = m.start("gap")  # the sentence keeps its end punctuation and closing quotes
            before = line[start:end].rstrip("'\"\u2019\u201d)]")
            last_word = before.split()[-1] if before.split() else ""
            stem = last_word[:-1].lower().lstrip("(\"'\u2018\u201c") if last_word.endswith(".") else None
            if stem is not None and (stem in _ABBREVIATIONS or (len(stem) == 1 and stem.isalpha())):
                continue
            piece = line[start:end].strip()
            if piece:
                sentences.append(piece)
            start = m.end()
        piece = line[start:].strip()
        if piece:
            sentences.append(piece)
    return sentences


def lead3(article: str, tokenized: bool = False) -> str:
    """The Lead-3 baseline summary: the article's first three sentences, one per line."""
    return "\n".join(split_sentences(article, tokenized)[:3])


def _sentence_lines(text: str, tokenized: bool = False) -> str:
    return "\n".join(split_sentences(text, tokenized))


def rouge(hyps: list[str], refs: list[str], n_boot: int = 1000, seed: int = 0,
          tokenized: bool = False) -> tuple[dict, list[dict]]:
    """ROUGE-1/2/Lsum F1 x 100 with stemming, and a 95 % bootstrap interval of each mean.

    Returns (summary, per_example): summary = {"rouge1": mean, ..., "rouge1_ci": [lo, hi], ...},
    per_example = [{"rouge1": F1 x 100, "rouge2": ..., "rougeLsum": ...}, ...] in input order.
    Both texts are re-split into one sentence per line (for ROUGE-Lsum; ROUGE-1/2 ignore
    line breaks). The interval is the percentile interval of the mean over `n_boot`
    resamples of examples (numpy default_rng(seed))."""
    from rouge_score import rouge_scorer

    _check_pair(hyps, refs)
    if not hyps:
        raise ValueError("rouge: no examples")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    per_example = []
    for hyp, ref in zip(hyps, refs):
        s = scorer.score(_sentence_lines(ref, tokenized), _sentence_lines(hyp, tokenized))
        per_example.append({k: float(s[k].fmeasure * 100.0) for k in ROUGE_TYPES})
    summary: dict = {}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(hyps), size=(n_boot, len(hyps))) if n_boot > 0 else None
    for k in ROUGE_TYPES:
        values = np.array([e[k] for e in per_example], dtype=np.float64)
        summary[k] = float(values.mean())
        if idx is not None:
            means = values[idx].mean(axis=1)
            summary[f"{k}_ci"] = [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
        else:
            summary[f"{k}_ci"] = [summary[k], summary[k]]
    return summary, per_example


# --- language modelling --------------------------------------------------------------------------


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(total negative log-likelihood in nats / number of predicted tokens)."""
    if n_tokens <= 0:
        raise ValueError("perplexity: n_tokens must be positive")
    return float(math.exp(nll_sum / n_tokens))


# --- paired bootstrap on per-example statistics --------------------------------------------------


def _resample_indices(n_examples: int, n: int, seed: int, chunk: int = 200):
    rng = np.random.default_rng(seed)
    done = 0
    while done < n:
        m = min(chunk, n - done)
        yield rng.integers(0, n_examples, size=(m, n_examples))
        done += m


def _paired_bootstrap(base: tuple[np.ndarray, ...], cell: tuple[np.ndarray, ...],
                      stat: Callable[..., np.ndarray], n: int, seed: int, higher_is_better: bool,
                      test: str) -> dict:
    """stat(*arrays_indexed) -> one value per resample row; arrays are (rows, N) after indexing."""
    sizes = {len(a) for a in base + cell}
    if len(sizes) != 1:
        raise ValueError(f"paired bootstrap: arrays of different lengths {sorted(sizes)}")
    n_examples = sizes.pop()
    if n_examples == 0:
        raise ValueError("paired bootstrap: no examples")
    if n < 1:
        raise ValueError("paired bootstrap: n must be >= 1")
    full = np.arange(n_examples)[None, :]
    b0 = float(stat(*(a[full] for a in base))[0])
    c0 = float(stat(*(a[full] for a in cell))[0])
    d = c0 - b0
    diffs = []
    for idx in _resample_indices(n_examples, n, seed):
        diffs.append(stat(*(a[idx] for a in cell)) - stat(*(a[idx] for a in base)))
    dstar = np.concatenate(diffs)
    # Floating-point noise must not turn "identical" into "different".
    tol = 1e-9 * max(1.0, abs(b0), abs(c0))
    two_sided = np.sum(np.abs(dstar - d) >= abs(d) - tol)
    s = 1.0 if higher_is_better else -1.0
    one_sided = np.sum(s * (dstar - d) >= s * d - tol)
    return {
        "p_value": float((1 + two_sided) / (n + 1)),
        "p_not_better": float((1 + one_sided) / (n + 1)),
        "delta": d, "base": b0, "cell": c0,
        "delta_ci": [float(np.percentile(dstar, 2.5)), float(np.percentile(dstar, 97.5))],
        "n": int(n), "seed": int(seed), "test": test,
    }


def paired_bootstrap_mean(base: np.ndarray, cell: np.ndarray, n: int = 1000, seed: int = 0,
                          higher_is_better: bool = True) -> dict:
    """Paired bootstrap test of the difference of two means of per-example scores.

    Two-sided shift-method p-value of H0 "no difference" in "p_value"; one-sided p of
    "cell not better" in "p_not_better" (see module docstring). "delta" = mean(cell) - mean(base)."""
    base = np.asarray(base, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.float64)
    return _paired_bootstrap((base,), (cell,), lambda x: x.mean(axis=1), n, seed, higher_is_better,
                             "paired bootstrap of per-example means (two-sided)")


def paired_bootstrap_ppl(base_nll: np.ndarray, cell_nll: np.ndarray, base_tokens: np.ndarray,
                         cell_tokens: np.ndarray | None = None, n: int = 1000, seed: int = 0) -> dict:
    """Paired bootstrap test of corpus perplexity exp(sum nll / sum tokens); lower is better.

    Resamples test sequences (their NLL sums and token counts together). "delta" =
    PPL(cell) - PPL(base). Pass word counts as tokens for word-level perplexity."""
    base_nll = np.asarray(base_nll, dtype=np.float64)
    cell_nll = np.asarray(cell_nll, dtype=np.float64)
    base_tokens = np.asarray(base_tokens, dtype=np.float64)
    cell_tokens = base_tokens if cell_tokens is None else np.asarray(cell_tokens, dtype=np.float64)

    def ppl(nll, tok):
        return np.exp(nll.sum(axis=1) / np.maximum(tok.sum(axis=1), 1e-12))

    return _paired_bootstrap((base_nll, base_tokens), (cell_nll, cell_tokens), ppl, n, seed, False,
                             "paired bootstrap of corpus perplexity (two-sided)")
