"""Do the CPU study's PTB position results hold with a unit-size token table?

In the committed CPU study (reports/reference/cpu), the two PTB cells without the additive
sinusoids did better than the sinusoidal baseline: rotary positions by 44 test perplexity, no
positions by 11. Its token table is Xavier-uniform (`model.embed_init: xavier`): scaled by
sqrt(d_model) about 0.16 per dimension against 0.71 for the sinusoids, so in the baseline the
positions outweigh the tokens at the start, and in those two cells nothing does. This probe re-runs
the three cells exactly as the study ran them (workflow/studies/cpu/params.yaml: PTB, 2 post-LN
layers, d128, 800 steps of 2,048 words, lr 3e-3, fp32), with the token table drawn from
N(0, d^-1/2) (`model.embed_init: normal`), through the pipeline's own stages (`python -m
pipeline_src download/filter/bpe/train/evaluate`, one thread a job), in a work folder of its own,
and sets each run beside the committed run of the same cell and seed (reports/reference/cpu/
results.csv). A control re-runs the study's own baseline (Xavier, seed 0) here: how far it lands
from the committed run (made on another CPU type, whose arithmetic differs in the last bits) is
the size of difference that is not the table's. A run the work folder already holds is read, not
redone, so the same command continues an interrupted probe.

    python bench/probe_positions_init.py [--seeds 0 1 2] [--jobs 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from common import REPO, md_table, mirror_dir, run_stage, write_report

CELLS = ("baseline", "pe_none", "pe_rope")
COMMITTED = REPO / "reports/reference/cpu/results.csv"


def _study(init: str, seeds: list[int]) -> dict:
    cpu = yaml.safe_load((REPO / "workflow/studies/cpu/params.yaml").read_text())
    task = cpu["tasks"]["ptb"]
    task["cells"] = list(CELLS)
    task["model"]["embed_init"] = init
    return {"study": f"probe_pos_{init}", "description": f"the CPU study's PTB position cells, token table {init}",
            "mirror": str(mirror_dir()), "device": "cpu", "seeds": seeds,
            "datasets": {"ptb": cpu["datasets"]["ptb"]}, "tasks": {"ptb": task},
            "cells": {c: cpu["cells"][c] for c in CELLS}}


def _stage(work: Path, init: str, *args: str) -> None:
    run_stage(work, f"{init}.yaml", *args)


def _run(work: Path, init: str, cell: str, seed: int) -> dict:
    where = ["--task", "ptb", "--cell", cell, "--seed", str(seed)]
    evaluated = work / f"data/probe_pos_{init}/eval/ptb/{cell}/seed{seed}/eval_metrics.json"
    if not evaluated.exists():  # a run this work folder already finished is read, not redone
        _stage(work, init, "train", *where)
        _stage(work, init, "evaluate", *where)
    tm = json.loads((work / f"data/probe_pos_{init}/runs/ptb/{cell}/seed{seed}/train_metrics.json").read_text())
    em = json.loads(evaluated.read_text())
    cost = json.loads((work / f"data/probe_pos_{init}/runs/ptb/{cell}/seed{seed}/cost.json").read_text())
    return {"init": init, "cell": cell, "seed": seed, "best_val_loss": tm["best_val_loss"],
            "unigram_val_loss": tm["unigram_val_loss"], "test_ppl_word": em["metrics"]["test_ppl_word"],
            "device_name": cost["device_name"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "probe_positions_init"))
    ap.add_argument("--out", default=str(REPO / "reports" / "bench"), help="where the record goes")
    args = ap.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for init in ("xavier", "normal"):
        (work / f"{init}.yaml").write_text(yaml.safe_dump(_study(init, args.seeds)))
        for stage in (["download", "--dataset", "ptb"], ["filter", "--task", "ptb"], ["bpe", "--task", "ptb"]):
            _stage(work, init, *stage)
    runs = [("xavier", "baseline", args.seeds[0])] + [("normal", c, s) for s in args.seeds for c in CELLS]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda r: _run(work, *r), runs))

    committed = {(r["cell"], int(r["seed"])): r for r in csv.DictReader(COMMITTED.open()) if r["task"] == "ptb"}
    control = results[0]
    control_ref = committed[("baseline", control["seed"])]
    ref_cost = json.loads((COMMITTED.parent / f"check/ptb/baseline/seed{control['seed']}/cost.json").read_text())
    control_gap = control["test_ppl_word"] - float(control_ref["test_ppl_word"])
    rows = [["xavier (control)", "baseline", control["seed"], f"{control['best_val_loss']:.4f}",
             f"{float(control_ref['best_val_loss']):.4f}", f"{control['test_ppl_word']:.1f}",
             f"{float(control_ref['test_ppl_word']):.1f}"]]
    for r in results[1:]:
        ref = committed[(r["cell"], r["seed"])]
        rows.append(["normal", r["cell"], r["seed"], f"{r['best_val_loss']:.4f}", f"{float(ref['best_val_loss']):.4f}",
                     f"{r['test_ppl_word']:.1f}", f"{float(ref['test_ppl_word']):.1f}"])
    # Per seed, cell minus baseline (test perplexity), with each table: the seed pairs the runs.
    diffs = []
    by = {(r["cell"], r["seed"]): r for r in results[1:]}
    for cell in CELLS[1:]:
        for init in ("normal", "xavier"):
            d = []
            for s in args.seeds:
                if init == "normal":
                    d.append(by[(cell, s)]["test_ppl_word"] - by[("baseline", s)]["test_ppl_word"])
                else:
                    d.append(float(committed[(cell, s)]["test_ppl_word"]) - float(committed[("baseline", s)]["test_ppl_word"]))
            sd = statistics.stdev(d) if len(d) > 1 else None
            diffs.append([cell, init, len(d), f"{statistics.mean(d):+.1f}", "–" if sd is None else f"{sd:.1f}",
                          f"{min(d):+.1f} .. {max(d):+.1f}"])
    body = ("The CPU study's PTB cells (2 post-LN layers, d128, 800 steps) re-run with the token table drawn from "
            "N(0, d^-1/2), beside the committed runs (Xavier-uniform table) of the same cell and seed.\n\n"
            + md_table(["table", "cell", "seed", "best val loss", "committed (xavier)", "test ppl", "committed (xavier)"],
                       rows)
            + f"\n\nControl: the study's own baseline (Xavier table, seed {control['seed']}) re-run here gives test "
            f"perplexity {control['test_ppl_word']:.2f} against the committed {float(control_ref['test_ppl_word']):.2f} "
            f"({control_gap:+.2f}); the committed runs were made on another CPU type ({ref_cost['device_name']}, "
            f"here {control['device_name']}), whose float arithmetic differs in the last bits. Differences between "
            "the tables much larger than that are the table's."
            + "\n\nTest perplexity, cell minus baseline, paired by seed:\n\n"
            + md_table(["cell", "table", "seeds", "mean", "sd", "range"], diffs))
    write_report("probe_positions_init", "The CPU study's PTB position cells with a unit-size token table",
                 {"runs": results, "control_test_ppl_gap": control_gap, "differences": diffs}, body, out_dir=args.out)


if __name__ == "__main__":
    main()
