"""Stage `tune`: a cell's peak learning rate chosen on validation before its runs.

Comparing two cells at one learning rate compares the cells *and* how well that rate suits
each (Melis et al. 2018: every arm tuned equally). A cell with `train.lr_grid` gets a short trial
run per rate in the grid (seed: the study's first; `train.lr_tune_steps` steps, or the full
budget), and its runs train at the rate whose trial reached the lowest validation loss. The test
set is never read. A trial whose loss turned non-finite counts as failed (infinite loss).

data/<study>/tune/<task>/<cell>/tune.json    the grid, every trial's validation losses, the
                                             choice; trial_lr<rate>.tsv: each trial's log.
Trials finished before a crash are kept (scratch) and not run again.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

from ..common import StageError, atomic_dir, atomic_write_json
from ..study.config import Study
from ..study.paths import SCRATCH, tune_record
from ..train.live_log import log_tsv
from ..train.trainer import NonFiniteLoss, Trainer


def _rate_name(lr: float) -> str:
    return f"{lr:g}".replace(".", "p").replace("-", "m")


def run(study: Study, task: str, cell_name: str) -> None:
    cell = study.cell(task, cell_name)
    t = cell.train
    if not t.lr_grid:
        raise StageError(f"{study.cell_where(cell_name)} (task {task}): train.lr_grid is not set; nothing to tune")
    seed = study.first_seeds[0]
    steps = t.lr_tune_steps or t.max_steps
    scratch = Path(SCRATCH.format(study=study.name, task=task, cell=cell_name, seed=seed)).parent / "tune"
    trials = []
    for lr in t.lr_grid:
        trial_dir = scratch / f"lr{_rate_name(lr)}"
        done = trial_dir / "trial.json"
        if not done.is_file():
            settings = dataclasses.replace(t, lr=lr, max_steps=steps, max_target_tokens=None, lr_grid=None,
                                           eval_every=min(t.eval_every, steps), patience=0)
            trainer = Trainer(study, task, cell_name, seed, cell=dataclasses.replace(cell, train=settings),
                              out_dir=trial_dir)
            failure = ""
            try:
                trainer.train()
                trainer.evaluate_if_never_evaluated()
            except NonFiniteLoss as err:
                failure = f"non-finite training loss at step {err.step}"
            state = trainer.state
            atomic_write_json(done, {
                "lr": lr, "steps": state["step"], "failure": failure,
                "best_val_loss": math.inf if failure else state["best_val"],
                "best_step": state["best_step"], "final_val_loss": math.inf if failure else state.get("final_val"),
                "unigram_val_loss": trainer.data.unigram_val_loss(trainer.vocab_size)})
            (trial_dir / "trial_log.tsv").write_text(log_tsv(state["log"]))
            shutil.rmtree(trainer.scratch, ignore_errors=True)
        trials.append(json.loads(done.read_text()))
    best = min(trials, key=lambda r: (r["best_val_loss"], r["lr"]))
    record = {"task": task, "cell": cell_name, "seed": seed, "steps": steps, "grid": list(t.lr_grid),
              "criterion": "lowest best validation loss of the trial (ties: the smaller lr)",
              "trials": trials, "chosen_lr": best["lr"]}
    record_path = tune_record(study, task, cell_name)
    with atomic_dir(record_path.parent) as tmp:
        (tmp / record_path.name).write_text(json.dumps(record, indent=1) + "\n")
        for lr in t.lr_grid:
            shutil.copy(scratch / f"lr{_rate_name(lr)}" / "trial_log.tsv", tmp / f"trial_lr{_rate_name(lr)}.tsv")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"[tune] {task}/{cell_name}: lr {best['lr']:g} of {list(t.lr_grid)} "
          + ", ".join(f"{r['lr']:g}: {r['best_val_loss']:.4f}" for r in trials)
          + f" (best validation loss after {steps} steps, seed {seed})", flush=True)
