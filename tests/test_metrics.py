"""pipeline_src.evaluate.metrics against independent implementations: the sacrebleu command line,
rouge-score called directly, torch's cross-entropy, and hand-made examples."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline_src.evaluate import metrics

SACREBLEU = Path(sys.executable).parent / "sacrebleu"
WORDS = ("the a dog cat sees likes big small red river town house market school road "
         "Grüße naïve über 50% R&D").split()


def _corpus(n: int, seed: int):
    rng = np.random.default_rng(seed)
    refs = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 14)))) + rng.choice([".", "!", ""]) for _ in range(n)]

    def corrupt(r, q):
        out = [w if rng.random() < q else str(rng.choice(WORDS)) for w in r.split() if rng.random() < 0.95]
        return " ".join(out)

    return refs, corrupt


def _cli(*args: str, env=None) -> str:
    if not SACREBLEU.exists():
        pytest.fail(f"{SACREBLEU} missing: sacrebleu is a project dependency")
    proc = subprocess.run([str(SACREBLEU), *args], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def mt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mt")
    refs, corrupt = _corpus(60, 0)
    hyps = [corrupt(r, 0.7) for r in refs]
    better = [corrupt(r, 0.95) for r in refs]
    for name, lines in (("refs.txt", refs), ("hyps.txt", hyps), ("better.txt", better)):
        (d / name).write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return d, refs, hyps, better


def test_bleu_equals_sacrebleu_cli(mt_files):
    d, refs, hyps, _ = mt_files
    ours = metrics.bleu(hyps, refs)
    cli = float(_cli(str(d / "refs.txt"), "-i", str(d / "hyps.txt"), "-m", "bleu", "-b", "-w", "6"))
    assert ours["bleu"] == pytest.approx(cli, abs=1e-5)
    assert 5 < ours["bleu"] < 95  # a non-trivial score, so the comparison means something
    assert ours["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_chrf_equals_sacrebleu_cli(mt_files):
    d, refs, hyps, _ = mt_files
    ours = metrics.chrf(hyps, refs)
    cli = float(_cli(str(d / "refs.txt"), "-i", str(d / "hyps.txt"), "-m", "chrf", "-b", "-w", "6"))
    assert ours["chrf"] == pytest.approx(cli, abs=1e-5)
    assert "nc:6" in ours["signature"]


def test_bleu_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        metrics.bleu(["a b"], ["a b", "c d"])


def test_paired_bootstrap_bleu_matches_cli_and_detects_a_better_system(mt_files):
    d, refs, hyps, better = mt_files
    res = metrics.paired_bootstrap_bleu(hyps, better, refs, n=200, seed=12345)
    env = dict(os.environ, SACREBLEU_SEED="12345")
    out = json.loads(_cli(str(d / "refs.txt"), "-i", str(d / "hyps.txt"), str(d / "better.txt"), "-m", "bleu",
                          "--paired-bs", "--paired-bs-n", "200", env=env))
    base, cell = out[0]["BLEU"], out[1]["BLEU"]  # the first system is the baseline
    assert out[1]["system"].endswith("better.txt")
    assert res["p_value"] == pytest.approx(cell["p_value"])
    assert res["delta"] == pytest.approx(cell["score"] - base["score"])
    assert res["delta"] > 0 and res["p_value"] < 0.05


def test_paired_bootstrap_bleu_identical_systems_not_significant(mt_files):
    _, refs, hyps, _ = mt_files
    res = metrics.paired_bootstrap_bleu(hyps, list(hyps), refs, n=100, seed=7)
    assert res["p_value"] == 1.0 and res["delta"] == 0.0
    with pytest.raises(ValueError):
        metrics.paired_bootstrap_bleu(hyps, hyps, refs, n=10, seed=0)


def test_rouge_equals_rouge_score_directly():
    from rouge_score import rouge_scorer

    refs = ["The cat sat on the mat.\nIt was very happy there.",
            "Police arrested two men on Tuesday.\nThe men were released later.",
            "Markets rallied after the announcement."]
    hyps = ["A cat was sitting on a mat.\nThe cat was happy.",
            "Two men were arrested by police.",
            "The markets fell sharply after news."]
    summary, per = metrics.rouge(hyps, refs, n_boot=200, seed=0)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    direct = [scorer.score(r, h) for r, h in zip(refs, hyps)]  # sentences already one per line
    for k in ("rouge1", "rouge2", "rougeLsum"):
        expect = [s[k].fmeasure * 100 for s in direct]
        assert [p[k] for p in per] == pytest.approx(expect)
        assert summary[k] == pytest.approx(np.mean(expect))
        lo, hi = summary[f"{k}_ci"]
        assert min(expect) - 1e-9 <= lo <= summary[k] <= hi <= max(expect) + 1e-9
    # ROUGE-Lsum really is summary-level: one-line texts are split into sentences first.
    s1, _ = metrics.rouge(["Cats purr. Dogs bark."], ["Dogs bark. Cats purr."], n_boot=0)
    assert s1["rougeLsum"] == pytest.approx(100.0)
    assert s1["rouge1"] == pytest.approx(100.0)


def test_split_sentences_and_lead3():
    article = ('Mr. Smith went to Washington on Monday. He said "It is done." Then he left! '
               'Why? Nobody in the U.S. Senate knew.\nA new line starts here')
    assert metrics.split_sentences(article) == [
        "Mr. Smith went to Washington on Monday.", 'He said "It is done."', "Then he left!", "Why?",
        "Nobody in the U.S. Senate knew.", "A new line starts here"]
    assert metrics.lead3(article) == 'Mr. Smith went to Washington on Monday.\nHe said "It is done."\nThen he left!'
    assert metrics.lead3("Only one sentence") == "Only one sentence"
    assert metrics.split_sentences("line one\n\nline two.") == ["line one", "line two."]


def test_tokenized_lower_cased_text_splits_at_sentence_final_tokens():
    """See et al.'s CNN/DailyMail: PTB tokens, lower-cased (no capital marks a start), closing
    quotes after the full stop, abbreviations kept whole."""
    article = ("marseille , france ( cnn ) the prosecutor said he was not aware of any video . "
               "robin told cnn that \" so far no videos were used . '' he added . u.s. officials left at 5 p.m. "
               "! and then ?")
    assert metrics.split_sentences(article, tokenized=True) == [
        "marseille , france ( cnn ) the prosecutor said he was not aware of any video .",
        "robin told cnn that \" so far no videos were used . ''", "he added .",
        "u.s. officials left at 5 p.m. !", "and then ?"]
    assert metrics.lead3(article, tokenized=True).count("\n") == 2
    assert len(metrics.split_sentences(article)) == 1  # the plain splitter needs capitals: one sentence
    s, _ = metrics.rouge(["he added . robin told cnn ."], ["robin told cnn .\nhe added ."], n_boot=0, tokenized=True)
    assert s["rougeLsum"] == pytest.approx(100.0)


def test_perplexity_equals_exp_mean_token_nll():
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, 50, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 50, (7, 11), generator=g)
    nll_sum = float(F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), reduction="sum"))
    # independent recomputation: -log softmax at the target, averaged, exponentiated
    logp = logits - logits.logsumexp(-1, keepdim=True)
    mean_nll = float(-logp.gather(-1, targets[..., None]).mean())
    assert metrics.perplexity(nll_sum, targets.numel()) == pytest.approx(math.exp(mean_nll), rel=1e-12)
    with pytest.raises(ValueError):
        metrics.perplexity(1.0, 0)


def test_paired_bootstrap_mean():
    rng = np.random.default_rng(0)
    base = rng.normal(30, 8, 300)
    same = metrics.paired_bootstrap_mean(base, base.copy(), n=500, seed=0)
    assert same["p_value"] == 1.0 and same["delta"] == 0.0 and same["p_not_better"] == 1.0
    better = metrics.paired_bootstrap_mean(base, base + rng.normal(2.0, 3, 300), n=500, seed=0)
    assert better["delta"] > 1 and better["p_value"] < 0.05 and better["p_not_better"] < 0.05
    lo, hi = better["delta_ci"]
    assert lo < better["delta"] < hi
    # noise alone is (usually) not significant, and lower-is-better flips the one-sided test
    noise = metrics.paired_bootstrap_mean(base, base + rng.normal(0, 3, 300), n=500, seed=0)
    assert noise["p_value"] > 0.05
    worse_lower = metrics.paired_bootstrap_mean(base, base + 3, n=200, seed=0, higher_is_better=False)
    assert worse_lower["p_value"] < 0.05 and worse_lower["p_not_better"] == 1.0
    with pytest.raises(ValueError):
        metrics.paired_bootstrap_mean(base, base[:-1], n=10, seed=0)


def test_paired_bootstrap_ppl():
    rng = np.random.default_rng(1)
    tokens = rng.integers(5, 30, 200).astype(float)
    base = tokens * np.log(20) * np.exp(rng.normal(0, 0.1, 200))
    same = metrics.paired_bootstrap_ppl(base, base.copy(), tokens, n=300, seed=0)
    assert same["p_value"] == 1.0 and same["delta"] == 0.0
    assert same["base"] == pytest.approx(metrics.perplexity(base.sum(), int(tokens.sum())))
    better = metrics.paired_bootstrap_ppl(base, base * 0.9, tokens, n=300, seed=0)
    assert better["delta"] < 0 and better["p_value"] < 0.05 and better["p_not_better"] < 0.05
