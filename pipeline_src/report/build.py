"""Report stage: reports/<study>/report.tex from templates/report.tex, compiled to report.pdf.

The template (Jinja2 with LaTeX-safe delimiters: ((* block *)), ((( variable ))) ) gets only
pre-escaped LaTeX strings from here. The tables and figures stages' index.json files say
what to include. latexmk -pdf runs in a temporary build directory next to the outputs, with
copies of figures/ and tables/; only a successful build moves report.pdf and report.tex into
place (os.replace), so a LaTeX error leaves the previous report untouched and raises a
one-line StageError with the first error of the log. pdflatex gets SOURCE_DATE_EPOCH and
\\pdftrailerid{} so the same inputs give the same PDF bytes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from ..common import StageError, atomic_write_text, git_commit, package_versions
from ..study.paths import dvc_yaml_path, stage_command
from ..study.seed_plan import run_seeds
from .aggregate import RUN_LEVEL
from . import (display_name, fmt_int, fmt_num, higher_is_better, is_missing, latex_escape as esc, latex_tt,
               metric_digits, primary_metric, read_csv, read_json, report_paths, run_paths)

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
MAX_SOURCE_WORDS = 80
MAX_TEXT_WORDS = 120
LONG_WORD = 24
LATEX_TIMEOUT_S = 300


# --- text helpers --------------------------------------------------------------------------------


def esc_text(text, max_words: int | None = None) -> tuple[str, bool]:
    """Escaped running text for samples: line breaks kept (\\newline), words longer than
    LONG_WORD characters given break points, cut after max_words words. -> (latex, truncated)."""
    words_seen = 0
    truncated = False
    lines_out = []
    for line in str(text).split("\n"):
        words = line.split()
        if max_words is not None and words_seen + len(words) > max_words:
            words = words[: max(0, max_words - words_seen)]
            truncated = True
        words_seen += len(words)
        out = []
        for w in words:
            if len(w) > LONG_WORD:
                out.append(r"\allowbreak{}".join(esc(w[i:i + 16]) for i in range(0, len(w), 16)))
            else:
                out.append(esc(w))
        if out:
            lines_out.append(" ".join(out))
        if truncated:
            break
    body = r"\newline ".join(lines_out) if lines_out else r"\textit{(empty)}"
    if truncated:
        body += r" [\dots]"
    return body, truncated


def _short(commit: str) -> str:
    return commit[:10] if commit and re.fullmatch(r"[0-9a-f]{7,40}", commit) else (commit or "unknown")


# --- content -------------------------------------------------------------------------------------


def _findings(study, task, summary: pd.DataFrame, sig: pd.DataFrame) -> str:
    rows = summary[summary["task"] == task.name].set_index("cell")
    metric = primary_metric(task.kind, [c[:-5] for c in rows.columns if c.endswith("_mean") and rows[c].notna().any()])
    col = f"{metric}_mean"
    if col not in rows or task.baseline_cell not in rows.index:
        return ""
    base = rows.loc[task.baseline_cell, col]
    if is_missing(base):
        return ""
    leaking = rows["leaks_future"].astype(str).str.lower().isin(["true", "1"])
    others = rows[~leaking].drop(index=[task.baseline_cell], errors="ignore")[col].dropna()
    leak_text = ("; " + ", ".join(esc(x) for x in rows[leaking]["label"]) + " leaks the future (not ranked)"
                 if leaking.any() else "")
    hib = higher_is_better(metric)
    name = esc(display_name(metric))
    d = metric_digits(metric, base)
    if others.empty:
        return f"Baseline {name} {fmt_num(base, d)}{leak_text}."

    def qval(cell):
        if sig is None or sig.empty:
            return None
        s = sig[(sig["task"] == task.name) & (sig["cell"] == cell) & (sig["metric"] == metric)
                & (sig["seed"].astype(str) == RUN_LEVEL)]
        return float(s["q_value"].iloc[0]) if len(s) and not is_missing(s["q_value"].iloc[0]) else None

    def describe(cell):
        v = rows.loc[cell, col]
        q = qval(cell)
        ptxt = "" if q is None else (f", $q={q:.3f}$" if q >= 0.001 else ", $q<0.001$")
        return (f"{esc(rows.loc[cell, 'label'])} ({fmt_num(v, d)}, "
                f"{'$+$' if v - base >= 0 else '$-$'}{fmt_num(abs(v - base), d)}{ptxt})")

    best = others.idxmax() if hib else others.idxmin()
    worst = others.idxmin() if hib else others.idxmax()
    improves = (others[best] > base) if hib else (others[best] < base)
    text = f"Baseline {name} {fmt_num(base, d)}; "
    if improves:
        text += f"best ablation: {describe(best)}"
    else:
        text += f"no ablation beats it (closest: {describe(best)})"
    if worst != best:
        text += f"; worst: {describe(worst)}"
    return text + leak_text + "."


def _metrics_text(results: pd.DataFrame, study) -> str:
    kinds = {t.kind for t in study.tasks.values()}
    parts = []
    if "translation" in kinds:
        sig_b = next((s for s in results.get("bleu_signature", pd.Series(dtype=object)).dropna().unique()), None)
        sig_c = next((s for s in results.get("chrf_signature", pd.Series(dtype=object)).dropna().unique()), None)
        parts.append("Translation is decoded with beam search and scored with sacrebleu on detokenised text: BLEU"
                     + (f" ({latex_tt(sig_b)})" if sig_b else "") + " and chrF"
                     + (f" ({latex_tt(sig_c)})" if sig_c else "") + ".")
    if "summarization" in kinds:
        parts.append("Summaries are scored with rouge-score (ROUGE-1, ROUGE-2 and ROUGE-Lsum F1 with Porter "
                     "stemming; sentences split by a regular expression for ROUGE-Lsum), next to the Lead-3 baseline "
                     "(the article's first three sentences).")
    parts.append("Perplexity is the exponential of the mean negative log-likelihood per BPE token on the test set"
                 + (" (for language modelling also per word, comparable across vocabularies)" if "lm" in kinds else "")
                 + ".")
    parts += [_lm_window_text(study, task) for task in study.tasks.values() if task.kind == "lm"]
    parts.append("Every cell is compared with its task's baseline over training runs (Section~\\ref{sec:method}).")
    return " ".join(parts)


def _lm_window_text(study, task) -> str:
    """How a language-model task's perplexity was scored: window, stride and the context they give
    (evaluate.lm_score_windows); the mean context as the baseline's first run recorded it."""
    by_setting: dict[tuple[int, int], list[str]] = {}
    for cell in task.cells:
        cfg = study.cell(task.name, cell)
        by_setting.setdefault((cfg.train.lm_seq_len, cfg.eval.lm_stride), []).append(cell)
    path = run_paths(study, task.name, task.baseline_cell, study.seeds[0])["eval_metrics"]
    recorded = (read_json(path).get("lm_eval") or {}) if path.exists() else {}
    texts = []
    for (window, stride), cells in by_setting.items():
        text = f"a sliding window of {fmt_int(window)} tokens advanced by {fmt_int(stride)}"
        text += (" (non-overlapping windows: a token is predicted from 1 to "
                 f"{fmt_int(window)} preceding tokens" if stride == window else
                 " (each window scores only the tokens no earlier window scored, so every token is scored once and, "
                 f"after the first window, predicted from at least {fmt_int(window - stride + 1)} preceding tokens")
        if (recorded.get("lm_window"), recorded.get("lm_stride")) == (window, stride) \
                and task.baseline_cell in cells and recorded.get("lm_mean_context") is not None:
            text += f"; on the test set {recorded['lm_mean_context']:.1f} on average"
        text += ")"
        if len(by_setting) > 1:
            text += f" for {', '.join(esc(study.cell(task.name, c).label) for c in cells)}"
        texts.append(text)
    return f"Perplexity on {esc(task.name)} is scored with " + "; and with ".join(texts) + "."


def _seeds_text(study) -> str:
    if not study.adaptive_seeds:
        n = len(study.seeds)
        return f"each cell trained with {n} seed{'s' if n != 1 else ''} ({esc(', '.join(map(str, study.seeds)))})"
    return (f"each cell trained with seeds 0--{len(study.first_seeds) - 1}, and the cells of claim comparisons "
            f"that these did not settle with seeds up to {len(study.seeds) - 1} (adaptive seeds, "
            "Section~\\ref{sec:method})")


def _convergence_text(results: pd.DataFrame) -> str:
    """The convergence rule, and how many runs it flags."""
    from ..study.convergence import CONVERGED_RULE

    flags = [str(v).lower() for v in results["converged"]] if "converged" in results else []
    n_not, n_known = flags.count("false"), sum(f in ("true", "false") for f in flags)
    counted = (f"{n_not} of {n_known} run{'s' if n_known != 1 else ''} of this study had not converged"
               if n_known else "no run of this study recorded whether it converged")
    return (f"A run converged when {esc(CONVERGED_RULE.split(': ', 1)[1])}; a run that had not (its validation "
            f"was still improving when it ended) is marked in every table, and what it shows holds at this "
            f"training budget ({counted}).")


def _lr_text(study, results: pd.DataFrame) -> str:
    """Each cell's peak learning rate, and whether it was chosen on validation (train.lr_grid)."""
    if "lr" not in results:
        return "The runs did not record their peak learning rates."
    parts = []
    for task in study.tasks.values():
        cells = []
        for cell in task.cells:
            lrs = pd.to_numeric(results[(results["task"] == task.name) & (results["cell"] == cell)]["lr"],
                                errors="coerce").dropna().unique()
            grid = study.cell(task.name, cell).train.lr_grid
            shown = "/".join(f"{x:g}" for x in sorted(lrs)) or "--"
            cells.append(f"{esc(cell)} {shown}" + (" (tuned)" if grid else ""))
        parts.append(f"{esc(task.name)}: " + ", ".join(cells))
    tuned = sum(bool(study.cell(t.name, c).train.lr_grid) for t in study.tasks.values() for c in t.cells)
    total = sum(len(t.cells) for t in study.tasks.values())
    how = ("every cell's was chosen on validation from its grid (the tune stage's short trials, one seed)"
           if tuned == total else
           f"{tuned} of {total} cells chose theirs on validation from a grid (tuned); the others ran at their "
           "task's setting, so a comparison with them is at a learning rate chosen for another cell")
    return f"Peak learning rates: {how}. " + "; ".join(parts) + "."


def _method_text(study, results: pd.DataFrame) -> str:
    """How the report's verdicts and marks are made, in words (report/stats.py is the code)."""
    from .stats import MIN_RUNS

    n_failed = int(results["failed"].astype(str).str.lower().isin(["true", "1"]).sum()) if "failed" in results else 0
    text = [
        "The unit of evidence is the training run. Two cells are compared run against run: run $s$ of the cell "
        "against run $s$ of the compared-against cell (same seed: same initialisation and data order, same test "
        "set), one number per run (its corpus BLEU, test perplexity, ROUGE or wall time), and the per-seed "
        "differences are tested with a paired $t$-test (\\texttt{scipy.stats}); an interval is the Student-$t$ "
        "interval of their mean, and beside a Holm-adjusted $p$ a simultaneous one (confidence $1-0.05/m$ over the "
        "$m$ comparisons of the family: Bonferroni, so that all the intervals hold together, as the verdicts do). "
        "Every run is scored on the same finite test set, so each difference carries that set's noise as well as "
        "the run's; the statement is about new training runs on this test set.",
        f"Below {MIN_RUNS} paired runs there is no test and no verdict (``too few runs''): with two runs the "
        "$t$-test has one degree of freedom, a 95\\,\\% interval of $\\pm 12.7$ standard errors, and rests on "
        "the normality of two numbers.",
        "Claims: Holm's step-down correction over all of the study's claim comparisons controls the chance of "
        "any wrong verdict at 5\\,\\% whatever the dependence between comparisons (they share baselines); the "
        "checks of the pipeline form their own family, so that a check that cannot fail eases no claim's test; a "
        "claim of equality within a margin is tested by two one-sided tests (TOST) against the one-sided test of a "
        "difference beyond the margin, each of the two possible verdicts at half the error rate (equivalent when the "
        "interval at the comparison's level, 95\\,\\% for a single comparison, lies inside the margin, different "
        "when it lies beyond it). Beside each comparison, two checks that do not assume normal differences and "
        "decide nothing: how many of the per-seed differences lie on the predicted side, and from 6 runs the exact "
        "sign-flip permutation $p$ (all $2^n$ sign assignments of the differences). For an unsettled comparison the "
        "report gives the runs per cell a paired $t$-test would need for 80\\,\\% power at the observed mean and "
        "standard deviation of the differences, at Holm's strictest level.",
        "Table marks: Benjamini--Hochberg over every cell-against-baseline test of the study (a false discovery "
        "rate of 5\\,\\%: the marks are many and exploratory, and no verdict rests on them), each comparison "
        "counted once: perplexity per word and per token of cells on one tokenizer are the same summed loss over "
        "fixed denominators, so the word-level mark is the token-level test's.",
        "The per-sentence paired bootstrap of one run against its baseline run (\\texttt{significance.csv}, rows "
        "per seed) says whether those two trained models differ on this test set; another seed may differ, so no "
        "verdict or mark uses it.",
        "A run failed to train when its best validation loss is above 90\\,\\% of the validation loss of the "
        "unigram distribution of its training targets (it learned almost nothing about context), when a loss is "
        "not finite, or when it got there and fell back (diverged); such runs are marked in every table and "
        "figure, and no verdict rests on them unless the claim predicts the failure and the cell failed at every "
        "learning rate of its grid (a cell without a grid failed at one lr only, which says the lr did not suit it). "
        "The unigram loss is what a model reaches with no context; 90\\,\\% of it is a convention: in the "
        "committed CPU studies runs that trained ended at most at 84\\,\\% of it and failed ones at 96\\,\\% or "
        "more, while on a 6-layer GPU language model they met at 89--90\\,\\%"
        + (f" ({n_failed} run{'s' if n_failed != 1 else ''} of this study)." if n_failed else "."),
    ]
    text.append(_convergence_text(results))
    text.append(_lr_text(study, results))
    if study.adaptive_seeds:
        text.append(
            f"Adaptive seeds: every cell ran {len(study.first_seeds)} seeds; the plan stage then judged the claims on "
            f"them and gave {len(study.seeds)} seeds to both cells of every comparison that was tested, not "
            f"settled, and would need at most {len(study.seeds)} runs for 80\\,\\% power. Each of the two looks is "
            "tested at half the error rate (Bonferroni over looks; the second look always has the full number "
            "of runs), which bounds the error whatever was decided after the first.")
    return " ".join(text)


def _samples(study) -> tuple[list[dict], bool]:
    out, any_trunc = [], False
    labels = {"translation": "Source", "summarization": "Article", "lm": "Prompt"}
    seed = study.seeds[0]
    for task in study.tasks.values():
        path = run_paths(study, task.name, task.baseline_cell, seed)["eval_info"]
        ev = read_json(path)
        entries = []
        for s in ev.get("samples") or []:
            limit = MAX_SOURCE_WORDS if task.kind == "summarization" else MAX_TEXT_WORDS
            src, t1 = esc_text(s.get("source", ""), limit)
            ref, t2 = esc_text(s.get("reference", ""), MAX_TEXT_WORDS)
            hyp, t3 = esc_text(s.get("hypothesis", ""), MAX_TEXT_WORDS)
            any_trunc |= t1 or t2 or t3
            entries.append({"source": src, "reference": ref, "hypothesis": hyp})
        note = "" if entries else r"\textit{No samples were saved for this task's baseline run.}"
        if task.kind == "lm" and entries:
            note = ("The model continues the first words of each test sentence greedily; the reference is the "
                    "whole sentence.")
        out.append({"name": esc(task.name), "samples": entries, "note": note, "source_label": labels[task.kind]})
    return out, any_trunc


def _provenances(study) -> list[dict]:
    provs = []
    for task in study.tasks.values():
        for cell in task.cells:
            for seed in run_seeds(study, task.name, cell):
                ev = read_json(run_paths(study, task.name, cell, seed)["eval_info"])
                provs.append(ev.get("provenance") or {})
    return provs


def _packages(provs: list[dict]) -> list[dict]:
    report = package_versions()
    runs: dict[str, set] = {}
    for p in provs:
        for k, v in (p.get("versions") or {}).items():
            runs.setdefault(k, set()).add(str(v))
    names = list(dict.fromkeys(list(runs) + list(report)))
    return [{"name": esc(n), "runs": esc(", ".join(sorted(runs.get(n, {"--"})))), "report": esc(report.get(n, "--"))}
            for n in names]


def _hardware(results: pd.DataFrame) -> str:
    parts = []
    if "device_name" in results:
        counts = results.groupby(["device", "device_name"], dropna=False).size() if "device" in results else \
            results.groupby("device_name").size()
        for key, n in counts.items():
            dev, name = key if isinstance(key, tuple) else ("", key)
            parts.append(f"{esc(name)}{' (' + esc(dev) + ')' if dev and str(dev) != 'nan' else ''}: {n} run{'s' if n != 1 else ''}")
    precision = sorted(results["precision"].dropna().astype(str).unique()) if "precision" in results else []
    text = "Training ran on " + ("; ".join(parts) if parts else "an unrecorded device") + "."
    if precision:
        text += " Precision: " + esc(", ".join(precision)) + "."
    if "cpu_count" in results and results["cpu_count"].notna().any():
        text += f" CPU cores available to training: {esc(', '.join(str(int(x)) for x in sorted(results['cpu_count'].dropna().unique())))}."
    text += f" This report was built on a machine with {os.cpu_count()} CPU cores."
    return text


def _dvc(study) -> tuple[str, list[dict]]:
    import yaml

    lock = dvc_yaml_path(study).with_name("dvc.lock")
    if not lock.exists():
        return (rf"No {latex_tt(str(lock))} was found: the study was not run with DVC (Snakemake keeps no "
                r"hash lock). \texttt{dvc repro} records every stage's dependency and output hashes there.", [])
    try:
        data = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise StageError(f"{lock}: not valid YAML ({getattr(e, 'problem', e)})") from None
    stages = []
    for name, st in (data.get("stages") or {}).items():
        outs = []
        for o in (st or {}).get("outs") or []:
            h = o.get("md5") or o.get("hash") or o.get("etag") or "?"
            outs.append(f"{Path(str(o.get('path', '?'))).name}: {str(h)[:10]}")
        stages.append({"name": esc(name, breakable=True), "outs": esc("; ".join(outs), breakable=True) or "--"})
    return (rf"{latex_tt(str(lock))} records the hash of every stage output (first 10 hex digits shown; "
            r"\texttt{dvc status} compares them with the workspace).", stages)


def _commands(study) -> list[dict]:
    params = study.path
    smk = "snakemake --cores all" + ("" if Path(params).as_posix() == "params.yaml" else f" --config params={params}")
    dvc = "dvc repro" + ("" if dvc_yaml_path(study).as_posix() == "dvc.yaml" else f" {dvc_yaml_path(study).as_posix()}")
    cmds = [{"what": "Snakemake", "cmd": latex_tt(smk)}, {"what": "DVC", "cmd": latex_tt(dvc)}]
    for stage in ("aggregate", "figures", "tables", "claims", "report"):
        cmds.append({"what": f"only the {stage} stage", "cmd": latex_tt(stage_command(stage, study))})
    return cmds


def _index(directory: Path) -> list[dict]:
    path = directory / "index.json"
    if not path.exists():
        raise StageError(f"{path}: missing (rerun the {directory.name} stage)")
    data = read_json(path)
    if not isinstance(data, list):
        raise StageError(f"{path}: expected a list of entries")
    for e in data:
        if not isinstance(e, dict) or "name" not in e:
            raise StageError(f"{path}: entry without a name")
        kind = "figure" if directory.name == "figures" else "table"
        f = directory / (e["name"] + (".pdf" if kind == "figure" else ".tex"))
        if not f.exists():
            raise StageError(f"{f}: listed in {path} but missing (rerun the {directory.name} stage)")
    return data


def _data_ablations(study, figs: list[dict], tabs: list[dict], fig_caption: dict) -> dict | None:
    """The section on cells that override `filter`/`bpe`: which comparisons are valid, the
    learning curves and the two-stage screening tables. None when no cell reaches the data."""
    from . import other_tokenizer

    by_task = {t.name: [c for c in t.cells if other_tokenizer(study, t.name, c)] for t in study.tasks.values()}
    curves = [{"name": f["name"], "caption": fig_caption[f["name"]]} for f in figs if f.get("kind") == "learning_curve"]
    screening = [x["name"] for x in tabs if x.get("kind") == "screening"]
    if not any(by_task.values()) and not curves and not screening:
        return None
    parts = []
    for task, cells in by_task.items():
        if not cells:
            continue
        base = study.cell(task, study.tasks[task].baseline_cell)
        labels = ", ".join(esc(study.cell(task, c).label) for c in cells)
        parts.append(f"On \\emph{{{esc(task)}}}, {labels} use{'s' if len(cells) == 1 else ''} another tokenizer "
                     f"model than the base ({esc(base.bpe_variant)} on data variant {esc(base.filter_variant)}).")
    text = " ".join(parts)
    if parts:
        text += (" A tokenizer that cuts text into more, shorter pieces predicts each piece more easily, so "
                 "perplexity per token is not comparable across tokenizers and is left out (--) for these "
                 "cells and never tested. Valid comparisons: perplexity per word (the same total likelihood "
                 "divided by the reference's words), and scores on detokenised text (BLEU and chrF by "
                 "sacrebleu, ROUGE). Per-token perplexity remains valid between cells that share the base "
                 "model's tokenizer. A data-size cell trains its tokenizer on its own subset, so it too is "
                 "compared per word and on detokenised text.")
    return {"text": text, "figures": curves, "tables": screening}


def render(study) -> str:
    """The report's LaTeX source."""
    import jinja2

    paths = report_paths(study)
    results, summary = read_csv(paths["results"]), read_csv(paths["summary"])
    sig = read_csv(paths["significance"])
    figs, tabs = _index(paths["figures"]), _index(paths["tables"])
    fig_caption = {f["name"]: esc(f.get("caption", "")) for f in figs}
    provs = _provenances(study)
    run_commits = sorted({str(p.get("git_commit") or "unknown") for p in provs}) or ["unknown"]
    report_commit = git_commit()
    samples, truncated = _samples(study)
    tasks = []
    for t in study.tasks.values():
        results_table = next((x["name"] for x in tabs if x.get("kind") == "results" and x.get("task") == t.name), None)
        if results_table is None:
            raise StageError(f"{paths['tables'] / 'index.json'}: no results table for task {t.name}")
        tfigs = [{"name": f["name"], "caption": fig_caption[f["name"]]} for f in figs
                 if f.get("task") == t.name and f.get("kind") in ("ablation", "loss")]
        tasks.append({"name": esc(t.name), "kind": esc(t.kind), "dataset": esc(t.dataset), "n_cells": len(t.cells),
                      "baseline": esc(study.cell(t.name, t.baseline_cell).label), "results_table": results_table,
                      "figures": tfigs, "finding": _findings(study, t, summary, sig)})

    def one(kind):
        f = next((f for f in figs if f.get("kind") == kind), None)
        return {"name": f["name"], "caption": fig_caption[f["name"]]} if f else None

    dvc_text, dvc_stages = _dvc(study)
    report = study.report or {}
    ctx = {
        "title": esc(report.get("title") or f"Transformer ablations: study {study.name}"),
        "author": esc(report.get("author") or "pipeline\\_src"),
        "study_name": esc(study.name),
        "commit_short": esc(_short(run_commits[0] if len(run_commits) == 1 else report_commit)),
        "description": esc(" ".join(str(study.raw.get("description") or "").split())) or
                       f"This report collects the results of study {esc(study.name)}.",
        "n_cells": len({c for t in study.tasks.values() for c in t.cells}),
        "n_tasks": len(study.tasks), "seeds_text": _seeds_text(study), "method_text": _method_text(study, results),
        "scope": esc(" ".join(str(report.get("scope") or "").split())),
        "first_seed": study.seeds[0],
        "tasks": tasks,
        "metrics_text": _metrics_text(results, study),
        "family_tables": [x["name"] for x in tabs if x.get("kind") == "ablation"],
        "size_figure": one("size"), "cost_figure": one("cost"),
        "attention_figures": [{"name": f["name"], "caption": fig_caption[f["name"]]} for f in figs
                              if f.get("kind") == "attention"],
        "samples": samples, "truncated": truncated, "max_source_words": MAX_SOURCE_WORDS,
        "run_commits": [latex_tt(_short(c)) for c in run_commits],
        "report_commit": esc(_short(report_commit)),
        "params_path": latex_tt(study.path),
        "commands": _commands(study),
        "hardware": _hardware(results),
        "packages": _packages(provs),
        "dvc_text": dvc_text, "dvc_stages": dvc_stages,
        "data_ablations": _data_ablations(study, figs, tabs, fig_caption),
    }
    from .claims import report_context  # the claims stage's tables (published references, claims)
    ctx.update(report_context(study))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), autoescape=False, undefined=jinja2.StrictUndefined,
        block_start_string="((*", block_end_string="*))", variable_start_string="(((", variable_end_string=")))",
        comment_start_string="((#", comment_end_string="#))", trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True)
    try:
        tex = env.get_template("report.tex").render(**ctx)
    except jinja2.TemplateError as e:
        raise StageError(f"{TEMPLATE_DIR / 'report.tex'}: template error ({e})") from None
    # Deterministic PDF: no random trailer /ID (dates come from SOURCE_DATE_EPOCH, see compile_pdf).
    return tex.replace(r"\begin{document}", "\\ifdefined\\pdftrailerid\\pdftrailerid{}\\fi\n\\begin{document}", 1)


# --- compiling -----------------------------------------------------------------------------------


def first_latex_error(log: str) -> str:
    """The first error of a pdflatex log as one line (file:line: message, or ! message)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(?:\./)?([^\s:]+\.tex):(\d+): (.*)$", line)
        if m or line.startswith("! "):
            msg = m.group(3) if m else line[2:]
            where = f"{m.group(1)} line {m.group(2)}: " if m else ""
            # LaTeX wraps long messages; the next line(s) until a blank one belong to it.
            for extra in lines[i + 1: i + 3]:
                if not extra.strip() or extra.startswith("l.") or extra.startswith("See the"):
                    break
                msg += " " + extra.strip()
            context = next((x.strip() for x in lines[i + 1: i + 12] if re.match(r"^l\.\d+ ", x)), "")
            return f"{where}{msg.strip()}" + (f" [{context[:80]}]" if context else "")
    return "unknown LaTeX error (see the log)"


def overfull_boxes(log: str, limit_pt: float = 1.0) -> list[float]:
    return [float(x) for x in re.findall(r"Overfull \\hbox \(([\d.]+)pt too wide\)", log) if float(x) > limit_pt]


def compile_pdf(tex: str, build_dir: Path, figures: Path, tables: Path) -> tuple[Path, str]:
    """Compile tex in build_dir (with copies of figures/ and tables/) -> (pdf path, log text)."""
    latexmk = shutil.which("latexmk")
    if latexmk is None:
        raise StageError("latexmk not found: install TeX Live (texlive-latex-recommended, latexmk; `make system-deps`)")
    shutil.copytree(figures, build_dir / "figures", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(tables, build_dir / "tables")
    (build_dir / "report.tex").write_text(tex, encoding="utf-8")
    env = dict(os.environ, SOURCE_DATE_EPOCH="0", FORCE_SOURCE_DATE="1", max_print_line="10000")
    cmd = [latexmk, "-pdf", "-interaction=nonstopmode", "-halt-on-error", "-file-line-error", "-norc", "report.tex"]
    try:
        proc = subprocess.run(cmd, cwd=build_dir, env=env, capture_output=True, text=True, timeout=LATEX_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StageError(f"latexmk did not finish in {LATEX_TIMEOUT_S} s") from None
    log_path = build_dir / "report.log"
    log = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else proc.stdout + proc.stderr
    pdf = build_dir / "report.pdf"
    if proc.returncode != 0 or not pdf.exists():
        raise StageError(f"report.tex: LaTeX failed: {first_latex_error(log)}")
    return pdf, log


def run(study) -> None:
    paths = report_paths(study)
    tex = render(study)
    out_dir = paths["pdf"].parent
    out_dir.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=".report-build.", dir=out_dir))
    try:
        pdf, log = compile_pdf(tex, build_dir, paths["figures"], paths["tables"])
        over = overfull_boxes(log)
        if over:
            print(f"[report] warning: {len(over)} overfull line(s), widest {max(over):.1f}pt", file=sys.stderr)
        staged = out_dir / f".{paths['pdf'].name}.tmp"
        shutil.copyfile(pdf, staged)
        os.replace(staged, paths["pdf"])
        atomic_write_text(paths["tex"], tex)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
        (out_dir / f".{paths['pdf'].name}.tmp").unlink(missing_ok=True)
    print(f"[report] {paths['pdf']} ({paths['pdf'].stat().st_size // 1024} KiB)", flush=True)
