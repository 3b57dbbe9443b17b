"""Did a run converge? Read from its training log's validation losses.

A run stopped while validation still improves has not shown what its cell can reach: the train
stage records the verdict (train_info.json "converged"), tables mark such runs, and what they show
holds "at this budget" only.
"""
from __future__ import annotations

CONVERGED_AFTER = 2
CONVERGED_RULE = (f"validation stopped improving before the run ended: none of its last {CONVERGED_AFTER} "
                  f"evaluations lowered the best validation loss")


def converged(log: list[dict]) -> bool:
    """Whether the run's validation loss had stopped improving (CONVERGED_RULE) by its end."""
    vals = [float(r["val_loss"]) for r in log if r.get("val_loss") not in ("", None)]
    if len(vals) <= CONVERGED_AFTER:
        return False
    best_before = min(vals[:-CONVERGED_AFTER])
    return min(vals[-CONVERGED_AFTER:]) >= best_before
