"""Evaluation: stage `evaluate` and the scores it computes.

    evaluator.py    stage `evaluate`: perplexity, decoding and scores of one trained run
    static_decode.py  beam search in static shapes (GPU; CUDA graphs), the same result as model/decode.py
    metrics.py      pure scoring functions: BLEU/chrF, ROUGE, Lead-3, perplexity, paired tests
"""
