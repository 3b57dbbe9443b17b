"""Stage `plan` (adaptive seeds, params `seeds: {min, max}`): writes the seed plan,
data/<study>/plan/seeds.json: the claims judged on the first round of runs, and the cells of
unsettled comparisons given the seeds up to `max`. The rule and why it keeps the error rate, and
the reading of the seed plan by the train and evaluate jobs: pipeline_src/study/seed_plan.py.
"""
from __future__ import annotations

from ..common import StageError, atomic_write_json
from ..study.seed_plan import plan_path
from .aggregate import collect_results
from .claims import evaluate_claims
from .stats import fmt_runs


def extends(verdict: str, runs_needed, cap: int) -> bool:
    """The plan's rule for one comparison: tested, not settled, and settled by `cap` runs at the
    observed effect and spread."""
    return verdict == "inconclusive" and runs_needed is not None and runs_needed <= cap  # (NaN, inf: no)


def decide(study, claims) -> tuple[list[dict], list[dict]]:
    """(one decision per comparison, the task/cell pairs to extend) from the first round's
    claims table (report/claims.evaluate_claims on the first seeds)."""
    cap = len(study.seeds)
    decisions, extend = [], []
    for r in claims.to_dict("records"):
        need = r.get("runs_needed")
        if r.get("kind") == "check":  # more runs are spent on claims, not on the pipeline's own tests
            decision = f"no more runs (a check: {r['verdict']})"
        elif r["verdict"] in ("supported", "contradicted"):
            decision = "settled"
        elif r["verdict"] != "inconclusive":
            decision = f"no more runs ({r['verdict']})"
        elif not extends(r["verdict"], need, cap):
            decision = f"no more runs (needs {fmt_runs(need) if need is not None else '--'} per cell; the cap is {cap})"
        else:
            decision = f"extend to {cap} runs"
            for cell in (r["cell"], r["versus"]):
                if {"task": r["task"], "cell": cell} not in extend:
                    extend.append({"task": r["task"], "cell": cell})
        decisions.append({k: r.get(k) for k in ("claim", "task", "cell", "versus", "metric", "verdict", "p_adjusted",
                                                 "runs_needed")} | {"decision": decision})
    return decisions, extend


def run(study) -> None:
    if not study.adaptive_seeds:
        raise StageError(f"{study.path}: seeds: a list, not {{min, max}}; the study has no seed plan")
    claims = evaluate_claims(study, collect_results(study, seeds=study.first_seeds))
    decisions, extend = decide(study, claims)
    record = {"first_seeds": list(study.first_seeds), "extra_seeds": [s for s in study.seeds
                                                                      if s not in study.first_seeds],
              "rule": ("extend both cells of every tested, inconclusive comparison whose runs needed for 80 % "
                       f"power (at the observed effect and spread) are at most {len(study.seeds)}; every look "
                       "is tested at alpha / 2"),
              "comparisons": decisions, "extend": extend}
    path = plan_path(study)
    atomic_write_json(path, record)
    cells = ", ".join(f"{e['task']}/{e['cell']}" for e in extend) or "none"
    print(f"[plan] {len(decisions)} comparisons after {len(study.first_seeds)} seeds; seeds "
          f"{record['extra_seeds']} for: {cells} -> {path}", flush=True)
