"""Aggregate stage: every task x cell x seed run into three tables.

reports/<study>/results.csv       one row per task x cell x seed run: identity, every evaluation
                                  metric, model size, training outcome and cost, and whether the
                                  run failed to train (`failed`, `failure`: see failure()).
reports/<study>/summary.csv       per task x cell: <col>_mean and <col>_std over runs (sample
                                  standard deviation, ddof=1; empty with a single run), n_seeds.
reports/<study>/significance.csv  every cell against its task's baseline cell (tasks.<T>.baseline_cell):
                                  * one row per cell and metric with seed "runs": the ablation's
                                    effect over training runs, a paired t-test of the per-seed
                                    differences of the runs' values (report/stats.py), q_value
                                    Benjamini-Hochberg-adjusted over every such row of the study
                                    that is a distinct comparison; a row that repeats another
                                    (word perplexity beside token perplexity, report.DUPLICATE_OF)
                                    names it in duplicate_of, is not counted again and carries its
                                    q_value; the tables mark these (none below stats.MIN_RUNS runs);
                                  * one row per seed: does run s of the cell differ from run s of
                                    the baseline *on this test set* (a paired bootstrap over test
                                    examples: sacrebleu's for BLEU, of per-example F1 for ROUGE, of
                                    corpus perplexity from per-sequence NLL sums; per-token only for
                                    cells on the baseline's tokenizer, report.TOKEN_LEVEL). A
                                    statement about those two trained models, not about the
                                    ablation: another seed may differ. Uncorrected, labelled so.
                                  All tests are two-sided; alpha 0.05. Cells that leak the future
                                  are tested too, flagged leaks_future.
reports/<study>/metrics/, plots/  what DVC shows: headline metrics per task x cell and the data of
                                  the dvc.yaml plots (report/views.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..common import StageError, atomic_write_text
from ..evaluate import metrics
from ..study.seed_plan import run_seeds
from . import stats, views
from . import (ALPHA, BOOTSTRAP_SEED, FAILED_FRACTION, DUPLICATE_OF, METRIC_ORDER, TESTED_METRICS, comparable, higher_is_better,
               read_json, report_paths, require, run_paths)

ID_COLUMNS = ["task", "kind", "cell", "family", "label", "seed", "leaks_future", "failed", "failure"]
TRAIN_COLUMNS = ["n_params", "flops_per_token", "steps", "train_tokens", "epochs_seen", "best_val_loss", "best_step",
                 "final_val_loss", "final_train_loss", "unigram_val_loss", "stop_reason", "lr", "converged"]
COST_COLUMNS = ["wall_s", "s_per_mtok", "tokens_per_s", "mfu", "peak_mem_mb", "device", "device_name", "precision",
                "cpu_count", "train_flops", "processed_tokens"]
# Derived per run from the training's own counts: the FLOPs its batches cost per target token and
# the tokens (source and target) each step put through the model; unlike wall time, a machine
# shared with other jobs does not move them.
MEASURED_COLUMNS = ["train_flops_per_tgt_token", "processed_tokens_per_step"]
GROUP_COLUMNS = ["task", "kind", "cell", "family", "label", "leaks_future"]
RUN_LEVEL = "runs"  # significance.csv: the seed-level row of a cell and metric (its `seed` column)
REQUIRED_METRICS = {
    "translation": ["test_ppl", "bleu", "chrf"],
    "summarization": ["test_ppl", "rouge1", "rouge2", "rougeLsum"],
    "lm": ["test_ppl"],
}
SIGNIFICANCE_COLUMNS = ["task", "kind", "cell", "family", "label", "leaks_future", "baseline", "metric", "seed",
                        "n_runs", "n_examples", "n_resamples", "base", "cell_score", "delta", "ci_lo", "ci_hi",
                        "p_value", "q_value", "duplicate_of", "p_not_better", "significant", "higher_is_better", "test",
                        "about"]


# --- results.csv ---------------------------------------------------------------------------------


def failure(tm: dict, metrics: dict) -> str:
    """Why a run did not train ('' if it did): a non-finite loss, a best validation loss near the
    unigram level of its training data, or a run that got there and fell back (diverged)."""
    def bad(x):
        return x is None or not np.isfinite(float(x))

    best, final, uni = tm.get("best_val_loss"), tm.get("final_val_loss"), tm.get("unigram_val_loss")
    losses = {"best validation loss": best, "final validation loss": final, "test loss": metrics.get("test_loss")}
    nonfinite = [k for k, v in losses.items() if v is not None and bad(v)]
    if nonfinite:
        return f"non-finite {nonfinite[0]}"
    if bad(uni) or bad(best):
        return ""
    if best >= FAILED_FRACTION * uni:
        return f"best val loss {best:.2f} vs {uni:.2f} for the unigram distribution"
    if not bad(final) and final >= FAILED_FRACTION * uni:
        return f"diverged: final val loss {final:.2f} (best {best:.2f}, unigram {uni:.2f})"
    return ""


def _run_row(study, task, cell, seed) -> dict:
    p = run_paths(study, task.name, cell, seed)
    tm, cost, ev = read_json(p["train_metrics"]), read_json(p["cost"]), read_json(p["eval_metrics"])
    # Identity, outcome, signatures and provenance live beside the metrics, in the *_info.json files.
    ti, ei = read_json(p["train_info"]), read_json(p["eval_info"])
    for path, obj in ((p["train_info"], ti), (p["eval_info"], ei)):
        for key, want in (("task", task.name), ("cell", cell), ("seed", seed)):
            if key in obj and str(obj[key]) != str(want):
                raise StageError(f"{path}: {key} is {obj[key]!r}, expected {want!r} (stale or misplaced file)")
    cfg = study.cell(task.name, cell)
    row = {"task": task.name, "kind": task.kind, "cell": cell, "family": cfg.family, "label": cfg.label,
           "seed": int(seed), "leaks_future": bool(cfg.leaks_future)}
    m = require(ev, "metrics", p["eval_metrics"])
    for key in REQUIRED_METRICS[task.kind]:
        if key not in m:
            raise StageError(f"{p['eval_metrics']}: metrics.{key} missing (needed for a {task.kind} task)")
    for key, value in m.items():
        if isinstance(value, (list, tuple)):
            if len(value) == 2 and key.endswith("_ci"):
                row[f"{key}_lo"], row[f"{key}_hi"] = (None if v is None else float(v) for v in value)
            continue
        if isinstance(value, bool):
            row[key] = value
        elif isinstance(value, (int, float)) or value is None:
            row[key] = np.nan if value is None else float(value)
        elif isinstance(value, str):
            row[key] = value
    for key, value in (ei.get("signatures") or {}).items():
        row[key] = value
    row["n_test"] = ev.get("n_test")
    for key in TRAIN_COLUMNS:
        row[key] = tm.get(key, ti.get(key))
    for key in COST_COLUMNS:
        row[key] = cost.get(key)
    row["git_commit"] = (ti.get("provenance") or {}).get("git_commit")
    tokens, wall = row.get("train_tokens"), row.get("wall_s")
    row["s_per_mtok"] = wall / tokens * 1e6 if tokens and wall is not None else np.nan
    target_tokens, steps = cost.get("target_tokens") or tokens, row.get("steps")
    row["train_flops_per_tgt_token"] = (row["train_flops"] / target_tokens if row.get("train_flops") and target_tokens
                                        else np.nan)  # (runs made before these counts: not known)
    row["processed_tokens_per_step"] = (row["processed_tokens"] / steps if row.get("processed_tokens") and steps
                                        else np.nan)
    row["failure"] = failure(tm, m)
    row["failed"] = bool(row["failure"])
    return row


def _order_columns(frame: pd.DataFrame) -> pd.DataFrame:
    metric_cols = [c for c in frame.columns if c not in ID_COLUMNS + TRAIN_COLUMNS + COST_COLUMNS + MEASURED_COLUMNS
                   + ["n_test", "git_commit"]]

    def key(c):
        base = c[:-3] if c.endswith("_lo") or c.endswith("_hi") else c
        base = base[:-3] if base.endswith("_ci") else base
        suffix = {"": 0, "_ci_lo": 1, "_ci_hi": 2}.get(c[len(base):], 3)
        return (METRIC_ORDER.index(base) if base in METRIC_ORDER else len(METRIC_ORDER), base, suffix, c)

    metric_cols.sort(key=key)
    return frame[ID_COLUMNS + metric_cols + ["n_test"] + TRAIN_COLUMNS + COST_COLUMNS + MEASURED_COLUMNS + ["git_commit"]]


def collect_results(study, seeds=None) -> pd.DataFrame:
    """Every run of the study (with adaptive seeds, those the plan gave each cell), or of `seeds` only."""
    rows = [_run_row(study, task, cell, seed)
            for task in study.tasks.values() for cell in task.cells
            for seed in (seeds if seeds is not None else run_seeds(study, task.name, cell))]
    return _order_columns(pd.DataFrame(rows))


# --- summary.csv ---------------------------------------------------------------------------------


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """Mean and sample std (ddof=1) over seeds of every numeric column, per task x cell,
    in the order the runs appear in results."""
    numeric = [c for c in results.columns
               if c not in GROUP_COLUMNS + ["seed"] and pd.api.types.is_numeric_dtype(results[c])
               and not pd.api.types.is_bool_dtype(results[c])]
    out = []
    for _, group in results.groupby(GROUP_COLUMNS, sort=False, dropna=False):
        row = {c: group[c].iloc[0] for c in GROUP_COLUMNS}
        row["n_seeds"] = int(group["seed"].nunique())
        row["n_failed"] = int(group["failed"].astype(bool).sum()) if "failed" in group else 0
        # runs whose validation still improved at the end (train_info.json "converged"; unknown: not counted)
        row["n_unconverged"] = int(sum(str(v).lower() == "false" for v in group["converged"])) if "converged" in group else 0
        for c in numeric:
            values = pd.to_numeric(group[c], errors="coerce")
            row[f"{c}_mean"] = values.mean() if values.notna().any() else np.nan
            row[f"{c}_std"] = values.std(ddof=1) if values.notna().sum() > 1 else np.nan
        for c in ("device", "device_name", "precision"):
            if c in group:
                row[c] = group[c].iloc[0]
        out.append(row)
    return pd.DataFrame(out)


# --- significance.csv ----------------------------------------------------------------------------


class RunOutputs:
    """Per-run evaluation outputs, read once."""

    def __init__(self, study):
        self.study = study
        self._cache: dict = {}

    def _dir(self, task, cell, seed) -> Path:
        d = run_paths(self.study, task, cell, seed)["outputs"]
        if not d.is_dir():
            raise StageError(f"{d}: missing (run the evaluate stage for {task}/{cell}/seed{seed})")
        return d

    def per_example(self, task, cell, seed) -> pd.DataFrame:
        key = ("pe", task, cell, seed)
        if key not in self._cache:
            path = self._dir(task, cell, seed) / "per_example.tsv"
            if not path.exists():
                raise StageError(f"{path}: missing")
            frame = pd.read_csv(path, sep="\t")
            for col in ("split", "index", "nll", "tokens"):
                if col not in frame:
                    raise StageError(f"{path}: column {col} missing")
            frame = frame[frame["split"] == "test"].sort_values("index").reset_index(drop=True)
            if frame.empty:
                raise StageError(f"{path}: no test rows")
            self._cache[key] = frame
        return self._cache[key]

    def lines(self, task, cell, seed, name) -> list[str]:
        key = ("lines", task, cell, seed, name)
        if key not in self._cache:
            path = self._dir(task, cell, seed) / name
            if not path.exists():
                raise StageError(f"{path}: missing")
            self._cache[key] = path.read_text(encoding="utf-8").split("\n")[:-1]
        return self._cache[key]

    def scores(self, task, cell, seed, metric, expected_mean: float | None) -> np.ndarray:
        key = ("scores", task, cell, seed)
        if key not in self._cache:
            path = self._dir(task, cell, seed) / "scores.tsv"
            if not path.exists():
                raise StageError(f"{path}: missing")
            self._cache[key] = (path, pd.read_csv(path, sep="\t"))
        path, frame = self._cache[key]
        if metric not in frame:
            raise StageError(f"{path}: column {metric} missing")
        values = frame[metric].to_numpy(dtype=np.float64)
        # Per-example scores are F1 x 100 (metrics.rouge); accept a 0-1 file by matching the mean.
        if expected_mean is not None and len(values) and values.max() <= 1.0 \
                and abs(values.mean() * 100 - expected_mean) < abs(values.mean() - expected_mean):
            values = values * 100.0
        return values


def _check_same(a, b, what: str):
    if len(a) != len(b):
        raise StageError(f"{what}: {len(a)} vs {len(b)} test examples; cannot pair them")


def _ppl_arrays(out: RunOutputs, task, cell, seed, denom: str, base_frame: pd.DataFrame | None = None):
    frame = out.per_example(task, cell, seed)
    if denom not in frame or frame[denom].isna().all():
        raise StageError(f"{out._dir(task, cell, seed) / 'per_example.tsv'}: column {denom} empty")
    if base_frame is not None and not np.array_equal(frame["index"].to_numpy(), base_frame["index"].to_numpy()):
        raise StageError(f"{task}/{cell}/seed{seed}: test examples differ from the baseline's; cannot pair them")
    return frame["nll"].to_numpy(np.float64), frame[denom].to_numpy(np.float64)


def paired_test(out: RunOutputs, task, kind: str, base: str, cell: str, seeds: list, metric: str, n: int,
              means: dict) -> dict:
    """One paired test of `cell` against `base` on `metric`, pooling the given seeds."""
    if metric == "bleu":
        bh, ch, refs = [], [], []
        for s in seeds:
            b, c = out.lines(task, base, s, "hyps.txt"), out.lines(task, cell, s, "hyps.txt")
            r, rc = out.lines(task, base, s, "refs.txt"), out.lines(task, cell, s, "refs.txt")
            _check_same(b, c, f"{task}/{cell}/seed{s} hyps.txt")
            _check_same(b, r, f"{task}/{base}/seed{s} refs.txt")
            if r != rc:
                raise StageError(f"{task}/{cell}/seed{s}: refs.txt differs from the baseline's; cannot pair them")
            bh, ch, refs = bh + b, ch + c, refs + r
        res = metrics.paired_bootstrap_bleu(bh, ch, refs, n=n, seed=BOOTSTRAP_SEED)
        res["p_not_better"] = np.nan
        n_examples = len(refs)
    elif metric.startswith("rouge"):
        b_all, c_all = [], []
        for s in seeds:
            b = out.scores(task, base, s, metric, means.get((base, s, metric)))
            c = out.scores(task, cell, s, metric, means.get((cell, s, metric)))
            _check_same(b, c, f"{task}/{cell}/seed{s} scores.tsv")
            b_all.append(b)
            c_all.append(c)
        res = metrics.paired_bootstrap_mean(np.concatenate(b_all), np.concatenate(c_all), n=n, seed=BOOTSTRAP_SEED,
                                            higher_is_better=True)
        n_examples = sum(map(len, b_all))
    elif metric in ("test_ppl", "test_ppl_word"):
        denom = "tokens" if metric == "test_ppl" else "words"
        arrays = {"bn": [], "bt": [], "cn": [], "ct": []}
        for s in seeds:
            base_frame = out.per_example(task, base, s)
            bn, bt = _ppl_arrays(out, task, base, s, denom)
            cn, ct = _ppl_arrays(out, task, cell, s, denom, base_frame)
            for k, v in zip(("bn", "bt", "cn", "ct"), (bn, bt, cn, ct)):
                arrays[k].append(v)
        cat = {k: np.concatenate(v) for k, v in arrays.items()}
        res = metrics.paired_bootstrap_ppl(cat["bn"], cat["cn"], cat["bt"], cat["ct"], n=n, seed=BOOTSTRAP_SEED)
        n_examples = len(cat["bn"])
    else:
        raise AssertionError(metric)
    return {"metric": metric, "n_examples": n_examples, "n_resamples": n, "base": res["base"],
            "cell_score": res["cell"], "delta": res["delta"], "p_value": res["p_value"],
            "p_not_better": res["p_not_better"], "significant": bool(res["p_value"] < ALPHA),
            "higher_is_better": higher_is_better(metric), "test": res["test"]}


def _runs_test(results: pd.DataFrame, task: str, base: str, cell: str, metric: str) -> dict:
    """The seed-level test of `cell` against `base`: paired t over the runs they share a seed with."""
    rows = results[results["task"] == task]
    b = rows[rows["cell"] == base].set_index("seed")[metric].astype(float)
    c = rows[rows["cell"] == cell].set_index("seed")[metric].astype(float)
    seeds = sorted(set(b.index) & set(c.index))
    t = stats.paired_t((c[seeds] - b[seeds]).to_numpy())
    enough = len(seeds) >= stats.MIN_RUNS
    return {"metric": metric, "seed": RUN_LEVEL, "n_runs": len(seeds), "base": float(b[seeds].mean()),
            "cell_score": float(c[seeds].mean()), "delta": t["mean"], "ci_lo": t["ci_lo"], "ci_hi": t["ci_hi"],
            "p_value": t["p"] if enough else np.nan, "higher_is_better": higher_is_better(metric),
            "test": f"paired t over {len(seeds)} runs" + ("" if enough else f" (no test below {stats.MIN_RUNS} runs)"),
            "about": "the ablation: new training runs of both cells"}


def significance(study, results: pd.DataFrame) -> pd.DataFrame:
    out = RunOutputs(study)
    # Mean ROUGE per run from eval_metrics.json: lets scores.tsv in 0-1 units be recognised.
    means = {(r["task"], r["cell"], r["seed"], m): r[m] for r in results.to_dict("records")
             for m in ("rouge1", "rouge2", "rougeLsum") if m in r}
    rows = []
    for task in study.tasks.values():
        base = task.baseline_cell
        n = study.cell(task.name, base).eval.bootstrap
        available = set(results.loc[results["task"] == task.name].dropna(axis=1, how="all").columns)
        tested = [m for m in TESTED_METRICS[task.kind] if m in available]
        task_means = {k[1:]: v for k, v in means.items() if k[0] == task.name}
        for cell in task.cells:
            if cell == base:
                continue
            cfg = study.cell(task.name, cell)
            ident = {"task": task.name, "kind": task.kind, "cell": cell, "family": cfg.family, "label": cfg.label,
                     "leaks_future": bool(cfg.leaks_future), "baseline": base}
            for metric in tested:
                if not comparable(study, task.name, cell, metric):
                    continue  # per-token numbers of another tokenizer: no valid comparison
                paired = sorted(set(run_seeds(study, task.name, cell)) & set(run_seeds(study, task.name, base)))
                for s in paired:
                    res = paired_test(out, task.name, task.kind, base, cell, [s], metric, n, task_means)
                    rows.append({**ident, "seed": s, "n_runs": 1, "about": "these two trained models on this test set",
                                 **res})
                rows.append({**ident, **_runs_test(results, task.name, base, cell, metric)})
    frame = pd.DataFrame(rows, columns=SIGNIFICANCE_COLUMNS)
    _false_discovery(frame)
    return frame


def _false_discovery(frame: pd.DataFrame) -> None:
    """q_value, significant and duplicate_of of the seed-level rows (in place): Benjamini-Hochberg
    over every distinct seed-level test of the study (the tables' marks). A row whose metric
    repeats a tested metric of the same cell (report.DUPLICATE_OF) is not counted a second time:
    it gets that row's q_value, so the two carry the same mark."""
    runs = frame["seed"].astype(str) == RUN_LEVEL
    frame[["duplicate_of", "significant"]] = frame[["duplicate_of", "significant"]].astype(object)
    tested = {(r.task, r.cell, r.metric): i for i, r in frame[runs].iterrows() if pd.notna(r.p_value)}
    repeats = {}
    for (task, cell, metric), i in tested.items():
        rep = DUPLICATE_OF.get(metric)
        if rep is not None and (task, cell, rep) in tested:
            repeats[i] = tested[(task, cell, rep)]
            frame.loc[i, "duplicate_of"] = rep
    distinct = runs & ~frame.index.isin(list(repeats))
    frame.loc[distinct, "q_value"] = stats.benjamini_hochberg(frame.loc[distinct, "p_value"].astype(float).to_numpy())
    for i, rep in repeats.items():
        frame.loc[i, "q_value"] = frame.loc[rep, "q_value"]
    frame.loc[runs, "significant"] = frame.loc[runs, "q_value"].astype(float) < ALPHA


# --- stage entry ---------------------------------------------------------------------------------


def _csv(frame: pd.DataFrame) -> str:
    return frame.to_csv(index=False, float_format="%.6g", lineterminator="\n")


def run(study) -> None:
    paths = report_paths(study)
    results = collect_results(study)
    summary = summarize(results)
    sig = significance(study, results)
    shown = views.build(study, summary)
    # Everything computed before anything is written: a failure leaves the old outputs intact.
    atomic_write_text(paths["results"], _csv(results))
    atomic_write_text(paths["summary"], _csv(summary))
    atomic_write_text(paths["significance"], _csv(sig))
    views.write(study, shown, paths["headline"], paths["plots"])
    runs = sig[(sig["seed"].astype(str) == RUN_LEVEL) & sig["duplicate_of"].isna()] if len(sig) else sig
    tested = int(runs["p_value"].notna().sum()) if len(runs) else 0
    n_sig = int((runs["q_value"].astype(float) < ALPHA).sum()) if len(runs) else 0
    n_failed = int(results["failed"].sum())
    print(f"[aggregate] {len(results)} runs ({n_failed} failed to train), {len(summary)} task x cell groups, "
          f"{n_sig} of {tested} distinct seed-level tests against the baseline significant at q<{ALPHA} "
          f"(Benjamini-Hochberg): {paths['results'].parent}", flush=True)
