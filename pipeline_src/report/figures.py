"""Figures stage: reports/<study>/figures/<name>.pdf (for LaTeX) and .png (for viewing).

  loss_<task>          training and validation loss against step, one line per cell (mean over
                       seeds; training loss lightly smoothed)
  ablation_<task>      the task's metrics per cell, mean +- std over seeds (bars), baseline
                       dashed, + marks p < 0.05 against the baseline (pooled paired test),
                       cells that leak the future hatched and labelled
  learning_curve_<task>
                       headline metric against training rows, for tasks with data-size cells
                       (cells overriding only filter.sample_fraction / sample_size)
  size                 headline metric against parameter count, one panel per task
  cost                 training wall time and throughput per cell, one row per task
  attention_<task>_<layer>
                       every head of one attention layer of the first training job's model
                       (report.attention_sample_task, default the first task; its first cell
                       and seed) on the first short validation example, tokens on the axes
index.json lists them with captions (plain text) for the report.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..common import StageError, atomic_dir
from ..study.paths import data_paths
from ..study.seed_plan import run_seeds
from .aggregate import RUN_LEVEL
from . import (ALPHA, data_size_cells, display_name, higher_is_better, mask_token_level, primary_metric, read_csv,
               report_paths, run_paths, safe_name)

WIDTH = 6.5  # inches; the report includes figures at \linewidth (about 6.3 in), so fonts stay ~as set
BASE_COLOR = "#1a1a1a"
STYLE = {
    "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "xtick.labelsize": 8, "ytick.labelsize": 8,
    "legend.fontsize": 8, "legend.frameon": False, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.25, "grid.linewidth": 0.5, "lines.linewidth": 1.3,
    "savefig.dpi": 150, "figure.constrained_layout.use": True,
    "text.parse_math": False,  # labels come from params files: "$x_1$" must print as typed
}
ATTENTION_MAX_TOKENS = 18


def _plt():
    # The backend is chosen here, not with MPLBACKEND in os.environ: a variable set at import
    # would reach every process the importing one starts (a test process's stage jobs, which the
    # start-up server then refuses as started differently and runs the normal way).
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(STYLE)
    return plt


def cell_colors(study) -> dict[str, str]:
    """One colour per cell name, the same in every figure; the baseline is near-black."""
    import matplotlib

    cells = list(dict.fromkeys(c for t in study.tasks.values() for c in t.cells))
    baselines = {t.baseline_cell for t in study.tasks.values()}
    palette = list(matplotlib.colormaps["tab20"].colors)
    palette = palette[0::2] + palette[1::2]  # the ten strong colours first
    out, i = {}, 0
    for c in cells:
        if c in baselines:
            out[c] = BASE_COLOR
        else:
            out[c] = matplotlib.colors.to_hex(palette[i % len(palette)])
            i += 1
    return out


def _save(fig, outdir: Path, name: str) -> None:
    fig.savefig(outdir / f"{name}.pdf", metadata={"CreationDate": None, "ModDate": None})
    # The PNG keeps the layout the PDF's save solved (constrained layout, in figure coordinates)
    # instead of solving it again: that solve is about a fifth of the stage's time.
    if fig.get_layout_engine() is not None:
        fig.set_layout_engine("none")
    fig.savefig(outdir / f"{name}.png", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


def _leak_label(label: str, leaks: bool) -> str:
    """A cell's label, with "[leaks]" appended when it leaks the future and does not say so."""
    return label + " [leaks]" if leaks and "leak" not in label.lower() else label


def _label(summary_row) -> str:
    return _leak_label(str(summary_row["label"]), _truthy(summary_row.get("leaks_future")))


def _truthy(x) -> bool:
    return str(x).strip().lower() in ("true", "1", "yes")


# --- loss curves ---------------------------------------------------------------------------------


def _read_log(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise StageError(f"{path}: missing (run the train stage first)")
    try:
        frame = pd.read_csv(path, sep="\t")
    except (ValueError, pd.errors.ParserError) as e:
        raise StageError(f"{path}: not a valid training log ({str(e).splitlines()[0]})") from None
    for col in ("step", "train_loss", "val_loss"):
        if col not in frame:
            raise StageError(f"{path}: column {col} missing")
    for col in ("step", "train_loss", "val_loss"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame


def loss_figure(study, task, colors, outdir: Path) -> dict:
    plt = _plt()
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(WIDTH, 3.4 + 0.16 * ((len(task.cells) + 2) // 3)))
    values = []
    for cell in task.cells:
        cfg = study.cell(task.name, cell)
        logs = [_read_log(run_paths(study, task.name, cell, s)["log"]) for s in run_seeds(study, task.name, cell)]
        both = pd.concat(logs)
        train = both.dropna(subset=["train_loss"]).groupby("step")["train_loss"].mean()
        val = both.dropna(subset=["val_loss"]).groupby("step")["val_loss"].mean()
        window = max(1, len(train) // 25)
        train = train.rolling(window, center=True, min_periods=1).mean()
        style = dict(color=colors[cell], linestyle="--" if cfg.leaks_future else "-",
                     linewidth=1.8 if cell == task.baseline_cell else 1.2, zorder=3 if cell == task.baseline_cell else 2)
        label = _leak_label(cfg.label, cfg.leaks_future)
        ax_t.plot(train.index, train.values, label=label, **style)
        ax_v.plot(val.index, val.values, marker="o", markersize=3, **style)
        for s in (train, val):
            if len(s):
                cut = s.index.max() * 0.15
                values += list(s[s.index >= cut].values)
    ax_t.set_title("training loss (per token, smoothed)")
    ax_v.set_title("validation loss (per token)")
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        if values:
            lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
            pad = 0.08 * max(hi - lo, 1e-3)
            ax.set_ylim(max(0.0, lo - pad), hi + 3 * pad)
    fig.legend(loc="outside lower center", ncol=3)
    name = f"loss_{safe_name(task.name)}"
    _save(fig, outdir, name)
    return {"name": name, "kind": "loss", "task": task.name,
            "caption": f"Training and validation loss on {task.name}, one line per cell (mean over its runs; "
                       "dashed: leaks the future)."}


# --- ablation bars -------------------------------------------------------------------------------


def _panels(kind: str, summary: pd.DataFrame) -> list[list[str]]:
    have = {c[:-5] for c in summary.columns if c.endswith("_mean") and summary[c].notna().any()}
    panels = {"translation": [["bleu"], ["chrf"], ["test_ppl"]],
              "summarization": [["rouge1", "rouge2", "rougeLsum"], ["test_ppl"]],
              "lm": [["test_ppl_word"], ["test_ppl"]]}[kind]
    out = [[m for m in p if m in have] for p in panels]
    return [p for p in out if p]


def _run_level_q(sig: pd.DataFrame, task: str) -> dict[tuple[str, str], float]:
    """(cell, metric) -> the Benjamini-Hochberg q of the seed-level test against the baseline."""
    if sig is None or sig.empty:
        return {}
    rows = sig[(sig["task"] == task) & (sig["seed"].astype(str) == RUN_LEVEL) & sig["q_value"].notna()]
    return {(r["cell"], r["metric"]): float(r["q_value"]) for _, r in rows.iterrows()}


def ablation_figure(study, task, summary: pd.DataFrame, sig: pd.DataFrame, colors, outdir: Path) -> dict:
    plt = _plt()
    rows = mask_token_level(study, task, summary[summary["task"] == task.name].set_index("cell")
                            .reindex(list(task.cells)))
    panels = _panels(task.kind, rows)
    pvals = _run_level_q(sig, task.name)
    n = len(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(WIDTH, 1.0 + 0.27 * n * (1.4 if len(panels[0]) > 1 else 1)),
                             sharey=True, squeeze=False)
    y = np.arange(n)
    labels = [_label(r) for _, r in rows.reset_index().iterrows()]
    for ax, metrics in zip(axes[0], panels):
        h = 0.8 / len(metrics)
        xmax = 0.0
        for j, m in enumerate(metrics):
            mean = rows[f"{m}_mean"].to_numpy(float)
            std = np.nan_to_num(rows[f"{m}_std"].to_numpy(float)) if f"{m}_std" in rows else np.zeros(n)
            off = (j - (len(metrics) - 1) / 2) * h
            if len(metrics) == 1:
                face = [colors[c] for c in rows.index]
            else:
                face = [plt.cm.Blues(0.45 + 0.25 * j)] * n
            bars = ax.barh(y + off, mean, height=h * 0.9, xerr=std, color=face, alpha=0.9,
                           error_kw=dict(elinewidth=0.8, capsize=2, ecolor="#444444"),
                           label=display_name(m) if len(metrics) > 1 else None)
            for k, (bar, cell) in enumerate(zip(bars, rows.index)):
                leaks = _truthy(rows.loc[cell, "leaks_future"])
                failed = float(rows.loc[cell].get("n_failed", 0) or 0) > 0
                unconverged = float(rows.loc[cell].get("n_unconverged", 0) or 0) > 0
                if leaks:
                    bar.set_hatch("///")
                    bar.set_edgecolor("#b00000")
                if failed:
                    bar.set_hatch("xxx")
                    bar.set_edgecolor("#555555")
                    bar.set_alpha(0.45)
                p = pvals.get((cell, m))
                end = (mean[k] if np.isfinite(mean[k]) else 0) + std[k]
                xmax = max(xmax, end if np.isfinite(end) else 0)
                mark = ("\u2020" if p is not None and p < ALPHA else "") + (" leaks" if leaks and j == 0 else "") \
                    + (" failed to train" if failed and j == 0 else "") \
                    + (" \u25e6" if unconverged and j == 0 else "")
                if mark:
                    ax.text(end, y[k] + off, " " + mark, va="center", ha="left", fontsize=7,
                            color="#b00000" if leaks else "#222222")
            if len(metrics) == 1 and task.baseline_cell in rows.index:
                b = rows.loc[task.baseline_cell, f"{m}_mean"]
                if np.isfinite(b):
                    ax.axvline(b, color=BASE_COLOR, linestyle=":", linewidth=0.9, zorder=0)
        ax.set_xlim(0, xmax * 1.18 if xmax > 0 else 1)
        title = " / ".join(display_name(m) for m in metrics)
        arrow = "\u2191" if higher_is_better(metrics[0]) else "\u2193"
        ax.set_title(f"{title} ({arrow} better)")
        ax.grid(axis="y", visible=False)
        if len(metrics) > 1:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07 - 0.25 / max(n, 1)), ncol=len(metrics),
                      fontsize=7.5)
    axes[0][0].set_yticks(y, labels)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"{task.name} ({task.kind}): mean \u00b1 std over runs; "
                 f"\u2020 q < {ALPHA} vs baseline over runs", fontsize=9)
    name = f"ablation_{safe_name(task.name)}"
    _save(fig, outdir, name)
    return {"name": name, "kind": "ablation", "task": task.name,
            "caption": f"Ablations on {task.name}: mean and standard deviation over seeds; dotted line: the "
                       f"baseline cell ({task.baseline_cell}); \u2020: different from the baseline over training "
                       f"runs (paired t over seeds, Benjamini-Hochberg q < {ALPHA}); hatched: leaks the future; "
                       "cross-hatched and faded: a run failed to train; \u25e6: some runs had not converged (validation "
                       "still improving when they ended: the bar holds at this budget)."}


# --- data size: learning curves ------------------------------------------------------------------

def learning_curve_figure(study, task, summary: pd.DataFrame, outdir: Path) -> dict | None:
    """Headline metric against the number of training rows (nested subsets), mean +- std."""
    from . import read_json

    cells = data_size_cells(study, task)
    if len(cells) < 2:
        return None
    plt = _plt()
    rows = summary[summary["task"] == task.name].set_index("cell").reindex(cells)
    metric = primary_metric(task.kind, [c[:-5] for c in rows.columns if c.endswith("_mean") and rows[c].notna().any()])
    n_train = [read_json(Path(data_paths(study, task.name, c)[0]) / "stats.json")["rows"]["train"] for c in cells]
    order = np.argsort(n_train, kind="stable")
    x = np.asarray(n_train, float)[order]
    mean = rows[f"{metric}_mean"].to_numpy(float)[order]
    std = np.nan_to_num(rows[f"{metric}_std"].to_numpy(float))[order] if f"{metric}_std" in rows else 0 * mean
    fig, ax = plt.subplots(figsize=(WIDTH * 0.6, 2.4))
    ax.errorbar(x, mean, yerr=std, marker="o", color=BASE_COLOR, capsize=3, linewidth=1.2)
    for xi, yi, c in zip(x, mean, np.asarray(cells)[order]):
        ax.annotate(str(rows.loc[c, "label"]) if c != task.baseline_cell else "baseline (all)", (xi, yi),
                    textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("training rows (nested random subsets)")
    arrow = "\u2191" if higher_is_better(metric) else "\u2193"
    ax.set_ylabel(f"{display_name(metric)} ({arrow} better)")
    ax.set_title(f"{task.name}: learning curve (mean over runs)")
    name = f"learning_curve_{safe_name(task.name)}"
    _save(fig, outdir, name)
    return {"name": name, "kind": "learning_curve", "task": task.name,
            "caption": f"Data size on {task.name}: {display_name(metric)} (mean and standard deviation over seeds) "
                       f"against the number of training rows. Smaller samples are subsets of larger ones "
                       f"(one fixed random order of the rows, independent of the training seed); validation "
                       f"and test sets are the same for every point."}


# --- metric vs model size ------------------------------------------------------------------------


def _count_label(x: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            v = x / div
            return f"{v:.0f}{suffix}" if v >= 10 or v == int(v) else f"{v:.1f}{suffix}"
    return f"{x:.0f}"


def _log_params_axis(ax, values) -> None:
    """Log x axis with a few readable ticks (1, 2, 5 x 10^k, as 20k / 1.5M), never crowded."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    values = values[np.isfinite(values) & (values > 0)]
    if not len(values):
        return
    lo, hi = float(values.min()) / 1.35, float(values.max()) * 1.35
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ticks = [m * 10 ** e for e in range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
             for m in (1, 2, 5) if lo <= m * 10 ** e <= hi]
    while len(ticks) > 4:
        ticks = ticks[::2]
    if len(ticks) < 2:
        ticks = [float(f"{v:.2g}") for v in (lo * 1.2, hi / 1.2)] if hi / lo > 1.8 else [float(f"{np.sqrt(lo * hi):.2g}")]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _count_label(x)))



def size_figure(study, summary: pd.DataFrame, colors, outdir: Path) -> dict:
    plt = _plt()
    tasks = list(study.tasks.values())
    ncol = min(3, len(tasks))
    nrow = (len(tasks) + ncol - 1) // ncol
    all_cells = list(dict.fromkeys(c for t in tasks for c in t.cells))
    fig, axes = plt.subplots(nrow, ncol, figsize=(WIDTH, 2.5 * nrow + 0.25 * ((len(all_cells) + 2) // 3) + 0.3),
                             squeeze=False)
    handles = {}
    for ax, task in zip(axes.flat, tasks):
        rows = summary[summary["task"] == task.name]
        m = primary_metric(task.kind, [c[:-5] for c in rows.columns if c.endswith("_mean") and rows[c].notna().any()])
        for _, r in rows.iterrows():
            leaks = _truthy(r["leaks_future"])
            x, yv = r["n_params_mean"], r[f"{m}_mean"]
            err = r.get(f"{m}_std")
            h = ax.errorbar([x], [yv], yerr=[0 if pd.isna(err) else err], fmt="X" if leaks else "o",
                            color=colors[r["cell"]], markersize=6 if r["cell"] == task.baseline_cell else 5,
                            capsize=2, elinewidth=0.8, markeredgecolor="white", markeredgewidth=0.4)
            handles.setdefault(r["cell"], (h, _leak_label(study.cell(task.name, r["cell"]).label, leaks)))
        _log_params_axis(ax, rows["n_params_mean"].to_numpy(float))
        ax.set_xlabel("parameters")
        arrow = "\u2191" if higher_is_better(m) else "\u2193"
        ax.set_ylabel(f"{display_name(m)} ({arrow} better)")
        ax.set_title(task.name)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    ordered = [handles[c] for c in all_cells if c in handles]
    fig.legend([h for h, _ in ordered], [l for _, l in ordered], loc="outside lower center", ncol=3)
    _save(fig, outdir, "size")
    return {"name": "size", "kind": "size", "task": None,
            "caption": "Headline metric against parameter count (log scale), mean and standard deviation over "
                       "seeds; crosses: cells that leak the future."}


# --- cost ----------------------------------------------------------------------------------------


def cost_figure(study, summary: pd.DataFrame, colors, outdir: Path) -> dict:
    plt = _plt()
    tasks = list(study.tasks.values())
    from . import time_unit

    unit, div = time_unit(summary["wall_s_mean"])
    heights = [len(t.cells) + 1.2 for t in tasks]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(WIDTH, 0.6 + 0.2 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, sharex="col")
    for (ax_w, ax_t), task in zip(axes, tasks):
        rows = summary[summary["task"] == task.name].set_index("cell").reindex(list(task.cells))
        y = np.arange(len(rows))
        face = [colors[c] for c in rows.index]
        for ax, col, scale in ((ax_w, "wall_s", 1 / div), (ax_t, "tokens_per_s", 1 / 1000)):
            mean = rows[f"{col}_mean"].to_numpy(float) * scale
            std = np.nan_to_num(rows[f"{col}_std"].to_numpy(float)) * scale
            ax.barh(y, mean, xerr=std, color=face, height=0.75,
                    error_kw=dict(elinewidth=0.8, capsize=2, ecolor="#444444"))
            ax.grid(axis="y", visible=False)
            ax.invert_yaxis() if not ax.yaxis_inverted() else None
        ax_w.set_yticks(y, [_label(r) for _, r in rows.reset_index().iterrows()])
        ax_t.set_yticks(y, [""] * len(y))
        ax_w.set_title(f"{task.name}: training wall time", loc="left")
        ax_t.set_title(f"{task.name}: throughput", loc="left")
    axes[-1][0].set_xlabel({"s": "seconds", "min": "minutes", "h": "hours"}[unit] + " (mean \u00b1 std over seeds)")
    axes[-1][1].set_xlabel("thousand tokens / s")
    _save(fig, outdir, "cost")
    return {"name": "cost", "kind": "cost", "task": None,
            "caption": "Training cost per cell: wall-clock time and training throughput (target tokens per "
                       "second), mean and standard deviation over seeds."}


# --- attention heat maps -------------------------------------------------------------------------


def attention_task(study):
    name = (study.report or {}).get("attention_sample_task") or next(iter(study.tasks))
    if name not in study.tasks:
        raise StageError(f"{study.path}: report.attention_sample_task: {name!r} is not an enabled task")
    return study.tasks[name]


def load_model(ckpt_dir: Path):
    """(model, meta) of a trained checkpoint; CPU, eval mode."""
    if not ckpt_dir.is_dir():
        raise StageError(f"{ckpt_dir}: missing (run the train stage first)")
    from ..model.checkpoint import load_trained_model

    try:
        return load_trained_model(ckpt_dir)
    except (OSError, KeyError, RuntimeError, ValueError) as e:
        raise StageError(f"{ckpt_dir}: cannot load the checkpoint ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _pieces(sp, ids) -> list[str]:
    special = {0: "<pad>", 1: "<unk>", 2: "<s>", 3: "</s>"}
    return [special.get(int(i)) or sp.id_to_piece(int(i)) for i in ids]


def sample_inputs(task, bpe_dir: Path, arch: str):
    """(src ids | None, tgt ids, src pieces, tgt pieces) for the first short validation example
    (test if there is no validation split), built exactly as the trainer feeds the model."""
    from ..data.tokens import BOS, EOS, load_sequences, load_spm

    if not (bpe_dir / "spm.model").exists():
        raise StageError(f"{bpe_dir}/spm.model: missing (run the bpe stage first)")
    sp = load_spm(bpe_dir)
    sides = ("text",) if task.kind == "lm" else ("src", "tgt")
    seqs = None
    for split in ("validation", "test"):
        try:
            seqs = {side: load_sequences(bpe_dir, split, side) for side in sides}
            break
        except FileNotFoundError:
            continue
    if not seqs or not len(seqs[sides[0]]):
        raise StageError(f"{bpe_dir}: no encoded validation or test split for the attention sample")
    n = ATTENTION_MAX_TOKENS - 2
    lengths = [max(len(seqs[s][i]) for s in sides) for i in range(min(200, len(seqs[sides[0]])))]
    fits = [i for i, k in enumerate(lengths) if 4 <= k <= n]
    i = fits[0] if fits else 0
    if task.kind == "lm":
        tgt = [int(t) for t in seqs["text"][i][:n]]
        return None, tgt, None, _pieces(sp, tgt)
    src = [int(t) for t in seqs["src"][i][:n]] + [EOS]
    tgt = [BOS] + [int(t) for t in seqs["tgt"][i][:n]]
    if arch == "decoder_only":
        joined = src + tgt
        return None, joined, None, _pieces(sp, joined)
    return src, tgt, _pieces(sp, src), _pieces(sp, tgt)


def attention_figures(study, outdir: Path, model_loader=load_model, inputs=sample_inputs) -> list[dict]:
    import torch

    plt = _plt()
    task = attention_task(study)
    cell, seed = task.cells[0], study.seeds[0]
    ckpt = run_paths(study, task.name, cell, seed)["ckpt"]
    bpe_dir = Path(data_paths(study, task.name, cell)[1])
    model, meta = model_loader(ckpt)
    arch = getattr(getattr(model, "cfg", None), "arch", None) or meta["config"]["model"]["arch"]
    src, tgt, src_p, tgt_p = inputs(task, bpe_dir, arch)
    src_t = torch.tensor([src]) if src is not None else None
    weights = model.attention_weights(src_t, torch.tensor([tgt]))
    layers = sorted({k.rsplit(".", 1)[0] for k in weights})  # "encoder.0", "decoder.1", ...
    picks = []
    for stack in ("encoder", "decoder"):
        idx = [int(k.split(".")[1]) for k in layers if k.startswith(stack + ".")]
        if not idx:
            continue
        last = max(idx)
        if stack == "decoder" and f"decoder.{last}.cross" in weights:
            picks.append(f"decoder.{last}.cross")
        else:
            picks.append(f"{stack}.{last}.self")
    entries = []
    for key in picks:
        w = weights[key][0].float().numpy()  # (H, Tq, Tk)
        stack, layer, kind = key.split(".")
        q_p = tgt_p if stack == "decoder" else (src_p if src_p is not None else tgt_p)
        k_p = (src_p if kind == "cross" else q_p)
        heads = w.shape[0]
        ncol = 2 if heads <= 4 else 4
        nrow = (heads + ncol - 1) // ncol
        size = WIDTH / ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(WIDTH, size * nrow * 1.05 + 0.5), squeeze=False,
                                 constrained_layout=True)
        fs = 7.5 if ncol <= 2 else 5.5
        vmax = float(w.max()) if w.size else 1.0
        for h, ax in enumerate(axes.flat):
            if h >= heads:
                ax.set_visible(False)
                continue
            # pcolormesh, rasterized in the PDF: no hairline seams between cells in PDF viewers
            im = ax.pcolormesh(w[h], cmap="viridis", vmin=0, vmax=vmax, edgecolors="none", rasterized=True)
            ax.set_xlim(0, w.shape[2])
            ax.set_ylim(w.shape[1], 0)
            ax.set_aspect("equal")
            ax.set_title(f"head {h + 1}", fontsize=8)
            ax.grid(False)
            ax.set_xticks(np.arange(len(k_p)) + 0.5, k_p, rotation=90, fontsize=fs)
            ax.set_yticks(np.arange(len(q_p)) + 0.5, q_p if h % ncol == 0 else [""] * len(q_p), fontsize=fs)
            ax.tick_params(length=0)
        fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
        what = {"self": "self-attention", "cross": "encoder-decoder attention"}[kind]
        fig.suptitle(f"{task.name} / {cell} (seed {seed}): {stack} layer {int(layer) + 1} {what}", fontsize=9)
        name = f"attention_{safe_name(task.name)}_{stack}{layer}_{kind}"
        _save(fig, outdir, name)
        entries.append({"name": name, "kind": "attention", "task": task.name,
                        "caption": f"Attention weights of every head in {stack} layer {int(layer) + 1} ({what}) of "
                                   f"the {task.name} model (cell {cell}, seed {seed}) on one validation example; "
                                   f"rows are queries, columns keys (SentencePiece tokens)."})
    return entries


# --- stage entry ---------------------------------------------------------------------------------


def run(study, model_loader=load_model, inputs=sample_inputs) -> None:
    paths = report_paths(study)
    summary = read_csv(paths["summary"])
    sig = read_csv(paths["significance"])
    for col in ("task", "cell", "label", "leaks_future", "n_params_mean", "wall_s_mean", "tokens_per_s_mean"):
        if col not in summary:
            raise StageError(f"{paths['summary']}: column {col} missing (rerun the aggregate stage)")
    colors = cell_colors(study)
    with atomic_dir(paths["figures"]) as tmp:
        index = []
        for task in study.tasks.values():
            index.append(loss_figure(study, task, colors, tmp))
        for task in study.tasks.values():
            index.append(ablation_figure(study, task, summary, sig, colors, tmp))
        for task in study.tasks.values():
            curve = learning_curve_figure(study, task, summary, tmp)
            if curve is not None:
                index.append(curve)
        index.append(size_figure(study, summary, colors, tmp))
        index.append(cost_figure(study, summary, colors, tmp))
        index += attention_figures(study, tmp, model_loader, inputs)
        (tmp / "index.json").write_text(json.dumps(index, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[figures] {len(index)} figures: {paths['figures']}", flush=True)
