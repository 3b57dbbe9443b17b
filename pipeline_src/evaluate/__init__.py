"""Evaluation: stage `evaluate` and the scores it computes.

    evaluator.py    stage `evaluate`: perplexity, decoding and scores of one trained run
    metrics.py      pure scoring functions: BLEU/chrF, ROUGE, Lead-3, perplexity, paired tests
"""
