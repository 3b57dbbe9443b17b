"""Does the token-embedding init decide whether a deeper post-LN language model trains?

The GPU study's 6-layer post-LN PTB baseline stayed near the unigram distribution in all three
seeds (reports/reference/h100/README.md), while the same model without positions trained. Our
token table is Xavier-uniform (TokenEmbedding, pipeline_src/model/positions.py): for a 10k x d
table that is std sqrt(2 / (10004 + d)), times sqrt(d) in the forward pass, about 0.22 per
dimension at d = 256 (0.16 at d = 128), against 0.71 for the sinusoids. Positions then outweigh
tokens at the start. fairseq draws the table from N(0, d^-1/2), which the scale brings to 1.

This probe trains the CPU study's PTB task (workflow/studies/cpu/params.yaml: d128, 2,048 words a
step, lr 3e-3, 200 warm-up steps, 800 steps, fp32, one thread) with DEPTH post-LN layers and
sinusoidal positions, per seed, once with the pipeline's init and once with the table drawn from
N(0, d^-1/2) (`model.embed_init`: xavier, normal). Everything else is the pipeline's own train
stage (`python -m pipeline_src train`), in a work folder of its own. It prints each run's best validation loss beside the unigram loss and
whether the run trained by the report's rule (pipeline_src/report/aggregate.py: failure).

    python bench/probe_embed_init.py [--depth 4] [--seeds 0 1 2] [--steps 800] [--jobs 2] [--out DIR]

The committed record was made before `model.embed_init` existed, with the same draw patched into
TokenEmbedding in the probe's own processes (same RNG calls, so the same tables).
"""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from common import REPO, md_table, mirror_dir, run_stage, write_report

INITS = ("xavier", "normal")


def _study(init: str, depth: int, seeds: list[int], steps: int) -> dict:
    cpu = yaml.safe_load((REPO / "workflow/studies/cpu/params.yaml").read_text())
    task = cpu["tasks"]["ptb"]
    task["cells"] = ["deep"]
    task["train"]["max_steps"] = steps
    return {"study": f"probe_{init}", "description": f"PTB, {depth} post-LN layers, token table init {init}",
            "mirror": str(mirror_dir()), "device": "cpu", "seeds": seeds,
            "datasets": {"ptb": cpu["datasets"]["ptb"]}, "tasks": {"ptb": task},
            "cells": {"deep": {"family": "layers", "label": f"{depth} layers",
                               "model": {"dec_layers": depth, "enc_layers": depth, "embed_init": init}}}}


def _stage(work: Path, init: str, *args: str) -> None:
    run_stage(work, f"{init}.yaml", *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--jobs", type=int, default=2, help="training runs at once (one thread each)")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "probe_embed_init"))
    ap.add_argument("--out", default=str(REPO / "reports" / "bench"), help="where the record goes")
    args = ap.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for init in INITS:
        (work / f"{init}.yaml").write_text(yaml.safe_dump(_study(init, args.depth, args.seeds, args.steps)))
        for stage in (["download", "--dataset", "ptb"], ["filter", "--task", "ptb"], ["bpe", "--task", "ptb"]):
            _stage(work, init, *stage)
    runs = [(init, seed) for seed in args.seeds for init in INITS]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda r: _stage(work, r[0], "train", "--task", "ptb", "--cell", "deep", "--seed", str(r[1])),
                      runs))

    from pipeline_src.report.aggregate import failure

    rows, results = [], []
    for init, seed in runs:
        tm = json.loads((work / f"data/probe_{init}/runs/ptb/deep/seed{seed}/train_metrics.json").read_text())
        why = failure(tm, {})
        results.append({"init": init, "seed": seed, **{k: tm[k] for k in ("best_val_loss", "best_step",
                        "final_val_loss", "unigram_val_loss", "steps")}, "failed": why})
        rows.append([init, seed, f"{tm['best_val_loss']:.4f}", tm["best_step"], f"{tm['unigram_val_loss']:.4f}",
                     why or "trained"])
    body = (f"PTB (the CPU study's task), {args.depth} post-LN decoder layers, sinusoidal positions, "
            f"{args.steps} steps; token table Xavier-uniform (the pipeline's) or N(0, d^-1/2).\n\n"
            + md_table(["init", "seed", "best val loss", "at step", "unigram", "run"], rows))
    write_report("probe_embed_init", "Token-embedding init and a deeper post-LN LM", {"runs": results,
                 "depth": args.depth, "steps": args.steps}, body, out_dir=args.out)


if __name__ == "__main__":
    main()
