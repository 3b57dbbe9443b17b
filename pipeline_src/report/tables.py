"""Tables stage: booktabs LaTeX fragments in reports/<study>/tables/ (+ index.json).

  datasets.tex          per task: dataset and source, rows per split after filtering, BPE
                        vocabulary and training tokens
  filtering.tex         every filter rule (and BPE token-length cut): rows before / after
  hyperparameters.tex   the resolved base configuration of every task (rows = settings)
  cells.tex             the ablation cells: family, label, what each overrides, where it runs
  results_<task>.tex    every cell of a task: its metrics, mean +- std over seeds
  ablation_<family>.tex one per ablation family, in the style of Vaswani et al. (2017) Table 3:
                        per task, the baseline and the family's cells, the hyper-parameters
                        they change, the headline metric and test perplexity with the
                        difference to the baseline and its significance
  cost.tex              training cost per task x cell

Conventions in every table: mean +- sample std over runs; \\dag q < 0.05 and \\ddag q < 0.01
against the task's baseline (seed-level paired t, Benjamini-Hochberg over distinct comparisons;
significance.csv's "runs" rows); the best non-leaking value of a column in bold; cells that leak
the future marked \\S and never bolded; cells with a run that failed to train marked with a cross.
Fragments need booktabs, graphicx, array and (for filtering/cells/cost) longtable in the preamble.
Every string from the params file or data is LaTeX-escaped.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from ..common import StageError, atomic_dir
from ..study.paths import data_paths
from .aggregate import RUN_LEVEL
from . import (ALPHA, TABLE_METRICS, time_unit, display_name, fmt_count, fmt_int, fmt_num, higher_is_better, is_missing,
               latex_escape as esc, latex_tt, mask_token_level, metric_digits, other_tokenizer, primary_metric,
               read_csv, read_json, report_paths, safe_name)

FITWIDTH = (r"\providecommand{\fitwidth}[1]{\setbox0=\hbox{#1}\ifdim\wd0>\linewidth"
            r"\resizebox{\linewidth}{!}{\box0}\else\box0\fi}")
LEAK_MARK = r"\textsuperscript{\S}"
LEAK_NOTE = (r"\S\ leaks the future: a bidirectional model used as a language model sees the token it "
             r"predicts, so its perplexity is not comparable; it is never ranked or set in bold.")
SIG_NOTE = (r"\dag\ $q<0.05$, \ddag\ $q<0.01$: the cell differs from the task's baseline over training runs "
            r"(paired $t$-test of the per-seed differences, Benjamini--Hochberg over every mark of the study); "
            r"cells with fewer than 3 paired runs are not marked.")
FAILED_MARK = r"\textsuperscript{$\times$}"
FAILED_NOTE = (r"$\times$ failed to train in some runs (validation loss near the unigram level of the training "
               r"data, non-finite, or diverged): its numbers describe a broken run, not the ablation.")
UNCONVERGED_MARK = r"\textsuperscript{$\circ$}"
UNCONVERGED_NOTE = (r"$\circ$ not converged in some runs: validation was still improving when the run ended, so its "
                    r"numbers, and any comparison with it, hold at this training budget.")


def _arrow(metric: str) -> str:
    return r"$\uparrow$" if higher_is_better(metric) else r"$\downarrow$"


def _sig_mark(p) -> str:
    if is_missing(p):
        return ""
    return r"\ddag" if p < 0.01 else r"\dag" if p < 0.05 else ""


def _mean_std(mean, std, digits: int, bold: bool = False, mark: str = "") -> str:
    if is_missing(mean):
        return "--"
    text = fmt_num(mean, digits)
    if bold:
        text = rf"\textbf{{{text}}}"
    if mark:
        text += rf"\textsuperscript{{{mark}}}"
    if not is_missing(std):
        text += rf" {{\scriptsize$\pm${fmt_num(std, digits)}}}"
    return text


def _delta(value, digits: int, mark: str = "") -> str:
    if is_missing(value):
        return "--"
    text = f"{float(value):+.{digits}f}".replace("-", "$-$")
    return text + (rf"\rlap{{\textsuperscript{{{mark}}}}}" if mark else "")


def _label_id(name: str) -> str:
    """A \\label key without underscores or other specials."""
    return re.sub(r"[^A-Za-z0-9-]+", "-", str(name))


def _truthy(x) -> bool:
    return str(x).strip().lower() in ("true", "1", "yes")


def _table(body: list[str], colspec: str, caption: str, label: str, notes: list[str] = ()) -> str:
    """A table float: caption above, the tabular shrunk to the line width if wider, notes below."""
    lines = [FITWIDTH, r"\begin{table}", r"\centering", r"\small", rf"\caption{{{caption}}}", rf"\label{{{label}}}",
             rf"\fitwidth{{\begin{{tabular}}{{{colspec}}}", r"\toprule", *body, r"\bottomrule", r"\end{tabular}}"]
    if notes:
        lines.append(r"\par\smallskip\parbox{\linewidth}{\footnotesize " + " ".join(notes) + "}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def _longtable(header: str, body: list[str], colspec: str, caption: str, label: str, ncols: int,
               notes: list[str] = ()) -> str:
    """A longtable (breaks across pages); columns must be narrow enough by construction."""
    lines = [r"{\small", rf"\begin{{longtable}}{{{colspec}}}", rf"\caption{{{caption}}}\label{{{label}}}\\",
             r"\toprule", header, r"\midrule", r"\endfirsthead",
             rf"\multicolumn{{{ncols}}}{{l}}{{\footnotesize\itshape (continued)}}\\", r"\toprule", header, r"\midrule",
             r"\endhead", r"\bottomrule", r"\endfoot", *body]
    if notes:
        lines.append(rf"\midrule\multicolumn{{{ncols}}}{{p{{0.9\linewidth}}}}{{\footnotesize " + " ".join(notes) + r"}\\")
    lines += [r"\end{longtable}}"]
    return "\n".join(lines) + "\n"


# --- inputs --------------------------------------------------------------------------------------


class Inputs:
    def __init__(self, study):
        self.study = study
        paths = report_paths(study)
        self.summary = read_csv(paths["summary"])
        self.sig = read_csv(paths["significance"])
        for col in ("task", "cell", "label", "leaks_future", "n_seeds"):
            if col not in self.summary:
                raise StageError(f"{paths['summary']}: column {col} missing (rerun the aggregate stage)")
        self.summary_path = paths["summary"]
        for task in study.tasks.values():
            have = set(self.summary.loc[self.summary["task"] == task.name, "cell"])
            missing = [c for c in task.cells if c not in have]
            if missing:
                raise StageError(f"{paths['summary']}: no row for {task.name}/{missing[0]} (rerun the aggregate stage)")

    def rows(self, task) -> pd.DataFrame:
        frame = self.summary[self.summary["task"] == task.name].set_index("cell")
        return mask_token_level(self.study, task, frame.reindex(list(task.cells)))

    def metrics(self, task) -> list[str]:
        rows = self.rows(task)
        return [m for m in TABLE_METRICS[task.kind] if f"{m}_mean" in rows and rows[f"{m}_mean"].notna().any()]

    def headline(self, task) -> str:
        rows = self.rows(task)
        return primary_metric(task.kind, [c[:-5] for c in rows.columns if c.endswith("_mean") and rows[c].notna().any()])

    def p(self, task, cell, metric):
        """The Benjamini-Hochberg q-value of the cell's seed-level test against the baseline."""
        if self.sig.empty:
            return None
        s = self.sig[(self.sig["task"] == task) & (self.sig["cell"] == cell) & (self.sig["metric"] == metric)
                     & (self.sig["seed"].astype(str) == RUN_LEVEL)]
        return float(s["q_value"].iloc[0]) if len(s) and not is_missing(s["q_value"].iloc[0]) else None

    def failed(self, task, cell) -> bool:
        return self._count(task, cell, "n_failed") > 0

    def unconverged(self, task, cell) -> bool:
        return self._count(task, cell, "n_unconverged") > 0

    def _count(self, task, cell, column: str) -> float:
        r = self.summary[(self.summary["task"] == task) & (self.summary["cell"] == cell)]
        return float(r[column].iloc[0] or 0) if len(r) and column in r and not is_missing(r[column].iloc[0]) else 0.0


def _best(rows: pd.DataFrame, metric: str):
    """Index (cell) of the best non-leaking mean, or None."""
    col = f"{metric}_mean"
    if col not in rows:
        return None
    ok = rows[~rows["leaks_future"].map(_truthy)][col].dropna()
    if ok.empty:
        return None
    return ok.idxmax() if higher_is_better(metric) else ok.idxmin()


# --- datasets and filtering ----------------------------------------------------------------------


def _stats(study, stage: str, task: str) -> dict:
    # The task's data as its baseline cell sees it (cells may train on other data variants).
    filtered, bpe = data_paths(study, task)
    return read_json(Path(filtered if stage == "filter" else bpe) / "stats.json")


def _source(ds) -> str:
    if ds.generator:
        return f"generated ({ds.generator})"
    from ..data.download import hub_label
    return hub_label(ds)


def datasets_table(study) -> str:
    body = [r"Task & Kind & Dataset & Source & Train & Val. & Test & Vocab. & Train tokens \\", r"\midrule"]
    notes = []
    for task in study.tasks.values():
        fs, bs = _stats(study, "filter", task.name), _stats(study, "bpe", task.name)
        rows = bs.get("sequences") or fs.get("rows") or {}
        tokens = (bs.get("tokens") or {}).get("train") or {}
        tok = sum(v for v in tokens.values() if isinstance(v, (int, float)))
        ds = study.datasets[task.dataset]
        source = esc(_source(ds)) if ds.generator else latex_tt(_source(ds))
        if ds.processing:
            source += f"$^{{{len(notes) + 1}}}$"
            notes.append(f"$^{{{len(notes) + 1}}}$ {esc(ds.name)}: {esc(ds.processing)}")
        body.append(" & ".join([esc(task.name), esc(task.kind), esc(ds.name, breakable=True), source,
                                fmt_int(rows.get("train")), fmt_int(rows.get("validation")), fmt_int(rows.get("test")),
                                fmt_int(bs.get("vocab_size")), fmt_count(tok) if tok else "--"]) + r" \\")
    return _table(body, r"llp{2.4cm}>{\raggedright\arraybackslash}p{3.4cm}rrrrr", "Datasets: examples per split after filtering (and the BPE stage's "
                  "token-length cuts), shared BPE vocabulary size and training-set BPE tokens (all sides).",
                  "tab:datasets", notes)


def _rule_label(task, rule: str) -> str:
    if rule.startswith("sample_eval ("):  # "sample_eval (test)": a random subset of an evaluation split
        split = rule[len("sample_eval ("):-1]
        return f"sample_eval.{split} = {task.filter.sample_eval.get(split, '?')} rows"
    value = getattr(task.filter, rule, None) if hasattr(task.filter, rule) else getattr(task.bpe, rule, None)
    if isinstance(value, bool) or value is None:
        return rule
    unit = f" {task.filter.unit}" if rule.endswith("_len") else (" BPE tokens" if rule.endswith("_tokens") else "")
    if value == 1 and unit.endswith("s"):
        unit = unit[:-1]
    return f"{rule} = {value}{unit}"


def filtering_table(study) -> str:
    header = r"Task & Split & Rule & Before & After & Removed & Source text kept \\"
    body = []
    for i, task in enumerate(study.tasks.values()):
        fs, bs = _stats(study, "filter", task.name), _stats(study, "bpe", task.name)
        rules = [dict(r, stage="filter") for r in fs.get("rules", [])]
        rules += [dict(r, stage="bpe") for r in bs.get("dropped", [])]
        if i:
            body.append(r"\midrule")
        if not rules:
            body.append(rf"{esc(task.name)} & \multicolumn{{6}}{{l}}{{no rules applied}} \\")
            continue
        for j, r in enumerate(rules):
            before, after = r.get("before"), r.get("after")
            removed = "--"
            if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before:
                removed = f"{before - after:,}".replace(",", "{,}") + f" ({100 * (before - after) / before:.1f}\\%)"
            rule = _rule_label(task, str(r.get("rule", "?")))
            if r["stage"] == "bpe":
                rule = "BPE: " + rule
            units_before, units_after = r.get("src_units_before"), r.get("src_units_after")
            kept = "--"
            if isinstance(units_before, (int, float)) and units_before:
                kept = fmt_count(units_after) + f" ({100 * units_after / units_before:.1f}\\%)"
            body.append(" & ".join([esc(task.name) if j == 0 else "", esc(r.get("split", "")), esc(rule, breakable=True),
                                    fmt_int(before), fmt_int(after), removed, kept]) + r" \\")
    units = esc(", ".join(sorted({t.filter.unit for t in study.tasks.values()})))
    return _longtable(header, body, r"ll>{\raggedright\arraybackslash}p{4.6cm}rrrr", "Filtering: rows before and after every "
                      f"rule, in the order applied (length rules count {units}; BPE rules count tokens), and the source "
                      f"text ({units}) a rule keeps of what reached it.", "tab:filtering", 7)


# --- configuration -------------------------------------------------------------------------------

HPARAMS = [
    ("Model", [("arch", "architecture"), ("d_model", "$d_{\\mathrm{model}}$"), ("n_heads", "heads $h$"),
               ("enc_layers", "encoder layers"), ("dec_layers", "decoder layers"), ("d_ff", "$d_{\\mathrm{ff}}$"),
               ("dropout", "dropout $P_{\\mathrm{drop}}$"), ("attention_dropout", "attention dropout"),
               ("pos_encoding", "positional encoding"), ("norm", "layer norm"), ("residual", "residual connections"),
               ("activation", "activation"), ("tie_embeddings", "tied embeddings"),
               ("copy_attention", "copy attention")]),
    ("Training", [("max_steps", "max. steps"), ("batch_tokens", "batch (tokens)"), ("grad_accum", "grad. accumulation"),
                  ("lr", "peak learning rate"), ("schedule", "schedule"), ("warmup_steps", "warm-up steps"),
                  ("label_smoothing", "label smoothing $\\epsilon_{ls}$"), ("clip_norm", "gradient clipping"),
                  ("weight_decay", "weight decay"), ("patience", "early-stopping patience"),
                  ("average_last", "checkpoints averaged"), ("lm_seq_len", "LM context (tokens)"),
                  ("max_src_len", "max. source tokens"), ("max_tgt_len", "max. target tokens")]),
    ("Decoding / evaluation", [("beam_size", "beam size"), ("length_penalty", "length penalty"),
                               ("max_len_a", "max. length $a$"), ("max_len_b", "max. length $b$"),
                               ("no_repeat_ngram", "no repeated $n$-gram"),
                               ("max_examples", "test examples (max.)"), ("bootstrap", "bootstrap resamples"),
                               ("lm_stride", "LM evaluation stride (tokens)")]),
]
LM_ONLY = {"lm_seq_len", "lm_stride"}
SEQ2SEQ_ONLY = {"max_src_len", "max_tgt_len", "beam_size", "length_penalty", "max_len_a", "max_len_b", "max_examples"}


def _data_configs(study, cfg) -> tuple:
    """The filter and bpe settings a resolved cell trains on (its data variant)."""
    return (study.filter_config(cfg.task, cfg.filter_variant),
            study.bpe_config(cfg.task, cfg.filter_variant, cfg.bpe_variant))


def _value(cfg, key, study=None):
    if key in cfg.model:
        return cfg.model[key]
    for part in (cfg.train, cfg.eval) + (_data_configs(study, cfg) if study is not None else ()):
        if hasattr(part, key):
            return getattr(part, key)
    return None


def _fmt_value(v) -> str:
    if v is None:
        return "--"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) < 1e-3 or abs(v) >= 1e5:
            m, e = f"{v:.1e}".split("e")
            return rf"${m}\times10^{{{int(e)}}}$"
        return f"{v:g}"
    if isinstance(v, int):
        return fmt_int(v)
    return esc(str(v).replace("_", " ").replace("encoder decoder", "encoder-decoder")
               .replace("decoder only", "decoder-only").replace("encoder only", "encoder-only"))


def hyperparameters_table(study) -> str:
    tasks = list(study.tasks.values())
    cfgs = [study.cell(t.name, t.baseline_cell) for t in tasks]
    body = [" & ".join(["Setting"] + [esc(t.name) for t in tasks]) + r" \\"]
    for section, items in HPARAMS:
        body += [r"\midrule", rf"\multicolumn{{{len(tasks) + 1}}}{{l}}{{\itshape {section}}} \\"]
        for key, label in items:
            vals = []
            for t, c in zip(tasks, cfgs):
                if (key in LM_ONLY and t.kind != "lm") or (key in SEQ2SEQ_ONLY and t.kind == "lm"):
                    vals.append("--")
                elif key in ("enc_layers",) and c.model["arch"] == "decoder_only":
                    vals.append("--")
                elif key in ("dec_layers",) and c.model["arch"] == "encoder_only":
                    vals.append("--")
                else:
                    vals.append(_fmt_value(_value(c, key)))
            body.append(" & ".join([label] + vals) + r" \\")
    body += [r"\midrule", rf"\multicolumn{{{len(tasks) + 1}}}{{l}}{{\itshape Data}} \\",
             " & ".join(["BPE vocabulary (requested)"] + [fmt_int(t.bpe.vocab_size) for t in tasks]) + r" \\",
             " & ".join(["seeds"] + [esc(", ".join(map(str, study.seeds)))] * len(tasks)) + r" \\"]
    return _table(body, "l" + "c" * len(tasks), "Base configuration of every task (its baseline cell, "
                  "fully resolved: defaults $\\oplus$ task settings). Ablation cells change only what "
                  "Table~\\ref{tab:cells} lists.", "tab:hparams")


def _overrides(cell_def: dict) -> list[str]:
    out = []
    for section in ("model", "train", "eval", "filter", "bpe"):
        for k, v in (cell_def.get(section) or {}).items():
            out.append(f"{k} = {v}")
    return out


def cells_table(study) -> str:
    header = r"Cell & Family & Label & Overrides & Tasks \\"
    body = []
    used = list(dict.fromkeys(c for t in study.tasks.values() for c in t.cells))
    for c in used:
        d = study.cells[c]
        tasks = [t.name for t in study.tasks.values() if c in t.cells]
        leaks = any(study.cell(t, c).leaks_future for t in tasks)
        body.append(" & ".join([latex_tt(c), esc(d["family"], breakable=True),
                                esc(d.get("label", c)) + (LEAK_MARK if leaks else ""),
                                esc("; ".join(_overrides(d)), breakable=True) or "--", esc(", ".join(tasks))]) + r" \\")
    any_leak = any(study.cell(t.name, c).leaks_future for t in study.tasks.values() for c in t.cells)
    rr = r">{\raggedright\arraybackslash}"
    return _longtable(header, body, f"{rr}p{{2.6cm}}{rr}p{{2.3cm}}{rr}p{{3.6cm}}{rr}p{{3.7cm}}{rr}p{{2.2cm}}",
                      "Ablation cells: each is the task's base configuration with the listed overrides.",
                      "tab:cells", 5, [LEAK_NOTE] if any_leak else [])


# --- results -------------------------------------------------------------------------------------


def _word_note(rows) -> str:
    """The per-word denominator an lm table used (evaluate's test_words), stated under the table."""
    words = rows["test_words_mean"].dropna() if "test_words_mean" in rows else []
    note = "; PPL (word) renormalises the same likelihood per word"
    if len(words):
        note += (f", over the test split's {int(words.iloc[0]):,} words: every whitespace token plus one end of line "
                 "per line, blank lines and headings included, as published PTB and WikiText results count them")
    return note


def results_table(inp: Inputs, task) -> str:
    rows = inp.rows(task)
    mets = inp.metrics(task)
    best = {m: _best(rows, m) for m in mets}
    head = ["Cell", "Params"] + [f"{esc(display_name(m))} {_arrow(m)}" for m in mets]
    body = [" & ".join(head) + r" \\", r"\midrule"]
    any_leak = any_sig = any_failed = any_unconverged = False
    for cell, r in rows.iterrows():
        leaks, failed, unconverged = _truthy(r["leaks_future"]), inp.failed(task.name, cell), inp.unconverged(task.name, cell)
        any_leak |= leaks
        any_failed |= failed
        any_unconverged |= unconverged
        label = (esc(r["label"]) + (LEAK_MARK if leaks else "") + (FAILED_MARK if failed else "")
                 + (UNCONVERGED_MARK if unconverged else ""))
        if cell == task.baseline_cell:
            label = rf"\textit{{{label}}} (base)"
        cols = [label, fmt_count(r.get("n_params_mean"))]
        for m in mets:
            mark = "" if cell == task.baseline_cell else _sig_mark(inp.p(task.name, cell, m))
            any_sig |= bool(mark)
            d = metric_digits(m, r.get(f"{m}_mean"))
            cols.append(_mean_std(r.get(f"{m}_mean"), r.get(f"{m}_std"), d, bold=(best[m] == cell and not leaks),
                                  mark=mark))
        body.append(" & ".join(cols) + r" \\")
    if task.kind == "summarization":
        base = rows.loc[task.baseline_cell] if task.baseline_cell in rows.index else rows.iloc[0]
        cols = [r"\textit{Lead-3 (first three sentences, same test rows)}", "--"]
        for m in mets:
            v = base.get(f"lead3_{m}_mean")
            cols.append(fmt_num(v, 2) if not is_missing(v) else "--")
        body += [r"\midrule", " & ".join(cols) + r" \\"]
    runs = sorted({int(x) for x in rows["n_seeds"].dropna()}) or [0]
    n_runs = f"{runs[0]}" if len(runs) == 1 else f"{runs[0]}--{runs[-1]}"
    notes = [f"Mean {{\\scriptsize$\\pm$ std}} over {n_runs} run{'s' if runs != [1] else ''} per cell (seeds); best "
             "non-leaking value in bold. Test PPL is per BPE token"
             + (_word_note(rows) if task.kind == "lm" else "") + "."]
    if task.kind == "summarization":
        notes.append(_rouge_note(inp.study.datasets[task.dataset]))
    if any_sig:
        notes.append(SIG_NOTE)
    if any_leak:
        notes.append(LEAK_NOTE)
    if any_failed:
        notes.append(FAILED_NOTE)
    if any_unconverged:
        notes.append(UNCONVERGED_NOTE)
    kind = {"translation": "translation", "summarization": "summarisation", "lm": "language modelling"}[task.kind]
    return _table(body, "l" + "r" * (len(mets) + 1),
                  f"Results on {esc(task.name)} ({kind}, dataset {esc(task.dataset)}): every cell of the task.",
                  f"tab:results-{_label_id(task.name)}", notes)


def _rouge_note(ds) -> str:
    """How ROUGE was computed, and on what text: beside every table of ROUGE scores."""
    split = ("sentences split at standalone . ! ? tokens (the text is tokenised)" if ds.text_format == "tokenized"
             else "sentences split by a regular expression")
    text = (f"ROUGE-1/2/Lsum F1 $\\times$100 by rouge-score with Porter stemming; ROUGE-Lsum over {split}, the "
            "references one highlight per line")
    if ds.processing:
        text += f". References and articles: {esc(ds.processing)}"
    return text + "."


def _changed_keys(study, task, cells) -> list[str]:
    base = study.cell(task.name, task.baseline_cell)
    keys = []
    for c in cells:
        cfg = study.cell(task.name, c)
        for k, v in cfg.model.items():
            if base.model.get(k) != v and k not in keys:
                keys.append(k)
        for part, bpart in ((cfg.train, base.train), (cfg.eval, base.eval),
                            *zip(_data_configs(study, cfg), _data_configs(study, base))):
            for k in part.__dataclass_fields__:
                if getattr(part, k) != getattr(bpart, k) and k not in keys:
                    keys.append(k)
    return keys


HP_SHORT = {"d_model": "$d_{\\mathrm{model}}$", "n_heads": "$h$", "enc_layers": "$N_{\\mathrm{enc}}$",
            "dec_layers": "$N_{\\mathrm{dec}}$", "d_ff": "$d_{\\mathrm{ff}}$", "dropout": "$P_{\\mathrm{drop}}$",
            "label_smoothing": "$\\epsilon_{ls}$", "pos_encoding": "PE", "warmup_steps": "warm-up", "norm": "norm",
            "residual": "residual", "arch": "architecture", "lr": "lr", "max_steps": "steps"}


def families(study) -> list[str]:
    out = []
    for task in study.tasks.values():
        for c in task.cells:
            if c != task.baseline_cell:
                fam = study.cells[c]["family"]
                if fam not in out:
                    out.append(fam)
    return out


def family_table(inp: Inputs, family: str) -> str:
    study = inp.study
    groups = []
    for task in study.tasks.values():
        cells = [c for c in task.cells if c != task.baseline_cell and study.cells[c]["family"] == family]
        if cells:
            groups.append((task, cells))
    keys = []
    for task, cells in groups:
        for k in _changed_keys(study, task, cells):
            if k not in keys:
                keys.append(k)
    ncols = 1 + len(keys) + 5
    head = ["", *[HP_SHORT.get(k, esc(k)) for k in keys], "Params", "Score", r"$\Delta$", "Test PPL", r"$\Delta$"]
    body = [" & ".join(head) + r" \\"]
    ppl_heads: list[str] = []
    any_leak = any_sig = any_failed = any_unconverged = False
    for task, cells in groups:
        rows = inp.rows(task)
        score = inp.headline(task)
        shown = [task.baseline_cell] + cells
        sub = rows.loc[shown]
        # Cells on another tokenizer have no comparable per-token PPL: show the per-word one.
        ppl = "test_ppl_word" if any(other_tokenizer(study, task.name, c) for c in cells) \
            and "test_ppl_word_mean" in sub and sub["test_ppl_word_mean"].notna().any() else "test_ppl"
        ppl_heads.append(ppl)
        best_s, best_p = _best(sub, score), _best(sub, ppl)
        body += [r"\midrule", rf"\multicolumn{{{ncols}}}{{l}}{{\textit{{{esc(task.name)}}} ({esc(task.kind)}); "
                              rf"score: {esc(display_name(score))} {_arrow(score)}}} \\"]
        base_cfg = study.cell(task.name, task.baseline_cell)
        base_row = rows.loc[task.baseline_cell]
        for c in shown:
            cfg = study.cell(task.name, c)
            r = rows.loc[c]
            leaks, failed, unconverged = _truthy(r["leaks_future"]), inp.failed(task.name, c), inp.unconverged(task.name, c)
            any_leak |= leaks
            any_failed |= failed
            any_unconverged |= unconverged
            is_base = c == task.baseline_cell
            label = (("base" if is_base else esc(cfg.label)) + (LEAK_MARK if leaks else "") + (FAILED_MARK if failed else "")
                     + (UNCONVERGED_MARK if unconverged else ""))
            hp = []
            for k in keys:
                v, bv = _value(cfg, k, study), _value(base_cfg, k, study)
                hp.append(_fmt_value(v) if (is_base or v != bv) else "")
            cols = [label, *hp, fmt_count(r.get("n_params_mean"))]
            for k, (m, best) in enumerate(((score, best_s), (ppl, best_p))):
                if k == 1 and ppl == score:  # the headline already is the per-word PPL
                    cols += ["--", ""]
                    continue
                d = metric_digits(m, r.get(f"{m}_mean"))
                cols.append(_mean_std(r.get(f"{m}_mean"), r.get(f"{m}_std"), d, bold=(best == c and not leaks)))
                if is_base:
                    cols.append("")
                else:
                    mark = _sig_mark(inp.p(task.name, c, m))
                    any_sig |= bool(mark)
                    delta = r.get(f"{m}_mean") - base_row.get(f"{m}_mean") \
                        if not (is_missing(r.get(f"{m}_mean")) or is_missing(base_row.get(f"{m}_mean"))) else None
                    cols.append(_delta(delta, d, mark))
            body.append(" & ".join(cols) + r" \\")
    notes = [r"Blank: as in the base model. Mean {\scriptsize$\pm$ std} over seeds; $\Delta$ = cell $-$ base"
             + (r"; \dag\ $q<0.05$, \ddag\ $q<0.01$ (paired $t$ over runs, Benjamini--Hochberg)" if any_sig else "")
             + "."]
    if "test_ppl_word" in ppl_heads:
        notes.append("Test PPL is per word for tasks whose cells use another tokenizer model than the base "
                     "(per-token perplexities of different tokenizers are not comparable).")
    if any_leak:
        notes.append(LEAK_NOTE)
    if any_failed:
        notes.append(FAILED_NOTE)
    if any_unconverged:
        notes.append(UNCONVERGED_NOTE)
    title = family.replace("_", " ")
    return _table(body, "l" + "c" * len(keys) + "rrrrr", f"Ablation family \\emph{{{esc(title)}}}.",
                  f"tab:ablation-{_label_id(family)}", notes)


def screening_table(study, screen_name: str) -> str:
    """Two-stage screening: stage one's ranking and promotion, stage two's test of each promoted
    family on the full data, and whether the stage-one conclusion held."""
    from .promote import held

    screen = study.screens[screen_name]
    rows = held(study, screen_name, ALPHA)
    metric = rows[0]["metric"] if rows else "?"
    d = metric_digits(metric, rows[0]["base"] if rows else None)
    s1, s2 = screen.stage_tasks
    body = [r"Rank & Family (cell) & $\Delta_1$ & $p_1$ & Promoted & $\Delta_2$ & $p_2$ & Held \\", r"\midrule"]
    for r in rows:
        cells = [str(r["rank"]), f"{esc(r['family'].replace('_', ' '))} ({esc(study.cell(s1, r['cell']).label)})",
                 _delta(r["delta"], d), fmt_num(r["p_value"], 3), "yes" if r["promoted"] else "no",
                 _delta(r["delta2"], d) if r["promoted"] else "not run",
                 fmt_num(r["p_value2"], 3) if r["promoted"] else "--",
                 "--" if r["held"] is None else "yes" if r["held"] else r"\textbf{no}"]
        body.append(" & ".join(cells) + r" \\")
    rule = " and ".join(x for x in (f"p_1 < {screen.max_p:g}" if screen.max_p is not None else "",
                                    f"at most {screen.top_k} famil{'y' if screen.top_k == 1 else 'ies'}"
                                    if screen.top_k is not None else "") if x)
    f1 = study.filter_config(s1, study.data_variant(s1, screen.cells[0])[0])
    steps1, steps2 = (study.cell(t, screen.cells[0]).train.max_steps for t in (s1, s2))
    # Stage-two cells that the task's own grid trains are those runs, not retrained.
    shared = [esc(study.cell(s2, c).label) for c in screen.cells if study.run_task(s2, c) != s2]
    shared_note = f"; {', '.join(shared)}: the runs of {esc(screen.task)}'s own grid" if shared else ""
    notes = [f"Stage one: every cell on a subset of {esc(screen.task)} (task {esc(s1)}: sample fraction "
             f"{f1.sample_fraction:g}{', at most ' + fmt_int(f1.sample_size) + ' rows' if f1.sample_size else ''}"
             f"{f', {fmt_int(steps1)} training steps instead of {fmt_int(steps2)}' if steps1 != steps2 else ''}); "
             f"stage two: the full data (task {esc(s2)}{shared_note}). "
             f"$\\Delta$ = cell $-$ baseline in "
             f"{esc(display_name(metric))} {_arrow(metric)}, $p$ from the two-sided paired bootstrap, seeds pooled. "
             f"A family's effect is that of its cell with the smallest $p_1$. Promotion rule (recorded in "
             f"promotion.json before stage two ran): families ranked by $p_1$, then $|\\Delta_1|$; promoted: "
             f"{esc(rule) if rule else 'all'}. Held: stage two reaches the same verdict at $p<{ALPHA}$ "
             f"(significant or not), in the same direction. Families not promoted are not tested at full scale."]
    return _table(body, "rlrrcrrc", f"Two-stage screening \\emph{{{esc(screen_name)}}}: did the stage-one "
                  f"conclusions hold on the full data?", f"tab:screening-{_label_id(screen_name)}", notes)


def cost_table(inp: Inputs) -> str:
    unit, div = time_unit(inp.summary["wall_s_mean"]) if "wall_s_mean" in inp.summary else ("s", 1.0)
    header = rf"Cell & Params & Steps & Wall ({unit}) & k tok/s & Peak MB & MFU \\"
    body = []
    devices = set()
    for i, task in enumerate(inp.study.tasks.values()):
        rows = inp.rows(task)
        if i:
            body.append(r"\midrule")
        body.append(rf"\multicolumn{{7}}{{l}}{{\textit{{{esc(task.name)}}}}} \\")
        for cell, r in rows.iterrows():
            devices.add(str(r.get("device_name", "")))
            wall = r.get("wall_s_mean")
            mfu = r.get("mfu_mean")
            body.append(" & ".join([
                esc(r["label"]) + (LEAK_MARK if _truthy(r["leaks_future"]) else ""), fmt_count(r.get("n_params_mean")),
                fmt_int(r.get("steps_mean")),
                _mean_std(wall / div if not is_missing(wall) else None,
                          r.get("wall_s_std") / div if not is_missing(r.get("wall_s_std")) else None,
                          0 if unit == "s" else 1),
                fmt_num(r.get("tokens_per_s_mean") / 1000 if not is_missing(r.get("tokens_per_s_mean")) else None, 1),
                fmt_num(r.get("peak_mem_mb_mean"), 0),
                (fmt_num(100 * mfu, 1) + r"\%") if not is_missing(mfu) else "--"]) + r" \\")
    devices.discard("")
    devices.discard("nan")
    note = ("Wall-clock training time and throughput (training target tokens per second), mean over seeds; "
            "peak memory of the device; MFU = model FLOPs utilisation (-- on CPU, where no peak is known). "
            "Device: " + esc("; ".join(sorted(devices)) or "unknown") + ".")
    return _longtable(header, body, r">{\raggedright\arraybackslash}p{5.0cm}rrrrrr", "Training cost per cell.", "tab:cost", 7, [note])


# --- stage entry ---------------------------------------------------------------------------------


def run(study) -> None:
    paths = report_paths(study)
    inp = Inputs(study)
    files: list[tuple[str, str, dict]] = [
        ("datasets", datasets_table(study), {"kind": "datasets"}),
        ("filtering", filtering_table(study), {"kind": "filtering"}),
        ("hyperparameters", hyperparameters_table(study), {"kind": "hyperparameters"}),
        ("cells", cells_table(study), {"kind": "cells"}),
    ]
    for task in study.tasks.values():
        files.append((f"results_{safe_name(task.name)}", results_table(inp, task), {"kind": "results", "task": task.name}))
    for fam in families(study):
        files.append((f"ablation_{safe_name(fam)}", family_table(inp, fam), {"kind": "ablation", "family": fam}))
    files.append(("cost", cost_table(inp), {"kind": "cost"}))
    for name in study.screens:
        files.append((f"screening_{safe_name(name)}", screening_table(study, name), {"kind": "screening", "screen": name}))
    with atomic_dir(paths["tables"]) as tmp:
        for name, text, _ in files:
            (tmp / f"{name}.tex").write_text(text, encoding="utf-8")
        index = [{"name": name, **meta} for name, _, meta in files]
        (tmp / "index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    print(f"[tables] {len(files)} tables: {paths['tables']}", flush=True)
