"""Does today's code still make a committed study's numbers? One run, re-made and compared.

A reference directory (e.g. reports/reference/cpu/) keeps, for the runs chosen to be re-checked,
the metrics files the train and evaluate stages wrote, under
`check/<task>/<cell>/seed<N>/{train_metrics,eval_metrics,cost,train_info}.json`. After the stages
have re-made that run from scratch (download -> ... -> evaluate; `.ci/run` does this),

    python -m pipeline_src check-reference --params P --task T --cell C --seed N --reference DIR

compares every figure, and first the machines (pipeline_src/runtime/machine.py; cost.json "machine"):
what decides the floats is the CPU's vendor and the instruction sets its kernels use (ATen's CPU
capability, the AVX-512/AMX flags oneDNN and MKL look at, any variable forcing lower kernels),
the torch and numpy versions, the thread count and the arithmetic (precision), not the model
name. Where every fact matches, identical bytes are expected, and a figure may move only within
its same-machine tolerance:

  BLEU +-0.3, chrF +-0.5, ROUGE +-0.5 (points); perplexities +-1 % (relative); losses +-0.01 (nats, ~1 %
  of perplexity); counts (parameters, FLOPs per token, steps, tokens, test sentences, words, and the
  window and stride a language model's perplexity was scored with): exact.

Elsewhere (or where the reference does not record a fact) the same run is computed with other
kernels, and its numbers are another draw of the run-to-run noise the study's seeds show: a
figure's tolerance is then the larger of the above and 3 standard deviations of that figure over
the cell's seeds in the reference's summary.csv. A perplexity's spread is proportional to its
level (it is the exponential of a loss, whose spread in nats is what carries over), and a check
run can sit at another level than the study's runs (a shortened run): its seeds' standard
deviation is taken relative to their mean, at the check run's level. A check run made from a
shortened copy of the study sits early in training, where runs differ far more than the study's
finished runs do: its params file then lists several seeds, `--make` trains them all and writes
their spread beside the run (check/<task>/<cell>/spread_over_seeds.json), and that spread, taken
at the check run's own length, replaces the study's. No tolerance reaches half of
the reference figure (a ROUGE of 0.96 may not move by 0.99): a run that learned nothing, or a
metric that broke to zero, always fails. Every line says which machine facts differed and which
rule gave each figure its tolerance.

With --make, the run's current files are copied into the reference instead (a deliberate
regeneration, for a code change that is meant to move the numbers).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import shutil
from pathlib import Path

from ..common import StageError, package_versions
from ..runtime import machine
from ..study.config import Study
from ..study.paths import output_path

ABSOLUTE = {"bleu": 0.3, "chrf": 0.5, "rouge1": 0.5, "rouge2": 0.5, "rougeLsum": 0.5}
RELATIVE_PPL = 0.01
LOSS_NATS = 0.01
EXACT = ("n_params", "flops_per_token", "steps", "epochs", "train_tokens", "n_test", "val_words", "test_words",
         "lm_window", "lm_stride")
NOT_COMPARED = ("best_step", "checkpoint_step")  # where the best validation fell: reported, not a result
SEED_SPREAD = 3.0
# No tolerance reaches this share of the reference figure, so that a zero never passes.
MAX_SHARE = 0.5
FILES = {"train_metrics.json": ("train", "metrics"), "eval_metrics.json": ("evaluate", "metrics"),
         "cost.json": ("train", "cost"), "train_info.json": ("train", "info")}


SPREAD_FILE = "spread_over_seeds.json"  # not seed*: the check scripts glob check/*/*/seed* for runs


def reference_run_dir(reference: Path, task: str, cell: str, seed: int) -> Path:
    return Path(reference) / "check" / task / cell / f"seed{seed}"


def _run_files(study: Study, task: str, cell: str, seed: int) -> dict[str, Path]:
    """The four files a run's check compares, where the train and evaluate stages wrote them."""
    return {name: Path(output_path(stage, key, study=study.name, task=task, cell=cell, seed=seed))
            for name, (stage, key) in FILES.items()}


@contextlib.contextmanager
def _side_by_side(files: dict[str, Path], folder: Path):
    """The run's files copied side by side into `folder`, as in a reference directory; removed after."""
    folder.mkdir(exist_ok=True)
    try:
        for name, path in files.items():
            shutil.copyfile(path, folder / name)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_seed_spread(reference: Path, task: str, cell: str) -> tuple[dict[str, float], dict[str, float], list] | None:
    """(standard deviation, mean, seeds) of every figure over the check run's own seeds, if made."""
    path = Path(reference) / "check" / task / cell / SPREAD_FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record["std"], record["mean"], record["seeds"]


def _write_check_spread(study: Study, reference: Path, task: str, cell: str) -> str:
    """Write the spread of every figure over the check params' seeds (all must have run)."""
    by_seed = {}
    for seed in study.seeds:
        files = _run_files(study, task, cell, seed)
        missing = [str(p) for p in files.values() if not p.exists()]
        if missing:
            raise StageError(f"check-reference: {missing[0]} is missing: the spread over the check run's seeds "
                             f"needs seed {seed} trained and evaluated too")
        with _side_by_side(files, files["train_metrics.json"].parent / ".spread") as staged:
            by_seed[seed] = _figures(staged)
    names = sorted(set.intersection(*(set(f) for f in by_seed.values())))
    std, mean = {}, {}
    for name in names:
        values = [float(by_seed[seed][name]) for seed in by_seed]
        if any(math.isnan(v) for v in values):
            continue
        mean[name] = sum(values) / len(values)
        std[name] = math.sqrt(sum((v - mean[name]) ** 2 for v in values) / (len(values) - 1))
    path = Path(reference) / "check" / task / cell / SPREAD_FILE
    path.write_text(json.dumps({"seeds": list(by_seed), "std": std, "mean": mean,
                                "what": "standard deviation (n - 1) and mean of each figure over the check "
                                        "params' seeds; the tolerance on another machine kind"}, indent=1))
    return str(path)


def _figures(run_dir: Path) -> dict[str, float]:
    train = json.loads((run_dir / "train_metrics.json").read_text())
    evaluation = json.loads((run_dir / "eval_metrics.json").read_text())
    figures = {k: v for k, v in train.items()}
    figures.update({k: v for k, v in evaluation["metrics"].items() if isinstance(v, (int, float))})
    figures["n_test"] = evaluation["n_test"]
    # The perplexity's window and stride (settings, but a changed stride moves the perplexity, and
    # this line says why); the mean context they give is not compared: it follows from them.
    lm = evaluation.get("lm_eval")
    if lm is None:
        info = json.loads((run_dir / "train_info.json").read_text())
        if info.get("kind") == "lm":  # evaluated before lm_eval was written: non-overlapping windows
            window = info["config"]["train"]["lm_seq_len"]
            lm = {"lm_window": window, "lm_stride": window}
    figures.update({k: lm[k] for k in ("lm_window", "lm_stride") if lm and k in lm})
    return figures


def _machine(run_dir: Path) -> dict:
    cost = json.loads((run_dir / "cost.json").read_text())
    if "machine" in cost:
        return cost["machine"]
    return machine.legacy_facts(cost, json.loads((run_dir / "train_info.json").read_text()))


def tolerance(name: str, value: float) -> tuple[float, str]:
    """(allowed absolute difference, how it is stated) of a figure on the same machine type."""
    if name in EXACT:
        return 0.0, "exact"
    if name in ABSOLUTE:
        return ABSOLUTE[name], f"+-{ABSOLUTE[name]:g}"
    if "ppl" in name:
        return abs(value) * RELATIVE_PPL, f"+-{100 * RELATIVE_PPL:g} %"
    if "loss" in name:
        return LOSS_NATS, f"+-{LOSS_NATS:g}"
    return 0.0, "exact"


def seed_spread(reference: Path, task: str, cell: str) -> tuple[dict[str, float], dict[str, float]]:
    """(standard deviation, mean) over seeds of every figure of the cell, from the reference's summary.csv."""
    path = Path(reference) / "summary.csv"
    if not path.exists():
        return {}, {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["task"] == task and row["cell"] == cell:
                def column(suffix):
                    return {k[:-len(suffix)]: float(v) for k, v in row.items()
                            if k.endswith(suffix) and v not in ("", "nan")}
                return column("_std"), column("_mean")
    return {}, {}


def compare(reference_dir: Path, run_dir: Path, spread: dict[str, float] | None = None,
            level: dict[str, float] | None = None,
            spread_from: str = "the reference study's seeds") -> tuple[bool, list[str]]:
    """(passed, report lines) for one run against its reference copy. `spread` and `level`: the
    standard deviation and mean of each figure over the seeds `spread_from` names."""
    ref_machine, run_machine = _machine(reference_dir), _machine(run_dir)
    differ = machine.differences(ref_machine, run_machine)
    same_machine = not differ
    lines = [f"reference machine: {machine.describe(ref_machine)}",
             f"this machine:      {machine.describe(run_machine)}"]
    if (reference_dir / "train_metrics.json").read_bytes() == (run_dir / "train_metrics.json").read_bytes() and \
            (reference_dir / "eval_metrics.json").read_bytes() == (run_dir / "eval_metrics.json").read_bytes():
        lines.append("identical: train_metrics.json and eval_metrics.json have the reference's bytes")
        return True, lines
    if same_machine:
        lines.append(f"same machine kind as the reference (equal {', '.join(machine.COMPARED)}): identical bytes "
                     f"were expected; figures compared with the same-machine tolerances")
    else:
        lines.append(f"another machine kind ({'; '.join(differ)}): a figure may move by the larger of its "
                     f"same-machine tolerance and {SEED_SPREAD:g} standard deviations over {spread_from}, "
                     f"never by {100 * MAX_SHARE:g} % of its value")
    ref, now = _figures(reference_dir), _figures(run_dir)
    passed = True
    for name in sorted(set(ref) | set(now)):
        if name in NOT_COMPARED:
            if ref.get(name) != now.get(name):
                lines.append(f"  {name}: {ref.get(name)} -> {now.get(name)} (not compared)")
            continue
        if name not in ref or name not in now:
            passed = False
            lines.append(f"  FAIL {name}: only in the {'reference' if name in ref else 'new run'}")
            continue
        a, b = float(ref[name]), float(now[name])
        if a == b or (math.isnan(a) and math.isnan(b)):
            continue
        allowed, stated = tolerance(name, a)
        if not same_machine and name not in EXACT and spread and name in spread:
            by_seeds, relative = SEED_SPREAD * spread[name], ""
            if "ppl" in name and level and level.get(name):  # relative to the seeds' mean, at this run's level
                by_seeds *= abs(a) / level[name]
                relative = f" ({100 * SEED_SPREAD * spread[name] / level[name]:.3g} % of {a:.6g})"
            if by_seeds > allowed:
                allowed, stated = by_seeds, f"+-{SEED_SPREAD:g} seed std = +-{by_seeds:.4g}{relative}"
        if allowed >= MAX_SHARE * abs(a) and a:
            allowed = MAX_SHARE * abs(a) * (1 - 1e-9)
            stated += f", capped below {100 * MAX_SHARE:g} % of the reference = +-{allowed:.4g}"
        diff = b - a
        ok = abs(diff) <= allowed + 1e-12
        passed &= ok
        rel = f", {100 * diff / a:+.3f} %" if a else ""
        lines.append(f"  {'ok  ' if ok else 'FAIL'} {name}: {a:.6g} -> {b:.6g} ({diff:+.4g}{rel}; tolerance {stated})")
    return passed, lines


def check_lr_matches(study: Study, reference: Path, task: str, cell: str) -> None:
    """A check run made from its own params file (e.g. a shortened copy of the study) must train
    at the peak lr the reference study trained that cell at: the study may have chosen it on an
    lr grid, and a check at another lr compares two different experiments. A reference whose
    results.csv has no `lr` column (made before it was recorded) is not checked."""
    results = reference / "results.csv"
    if not results.exists():
        return
    with open(results, newline="") as f:
        chosen = {row["lr"] for row in csv.DictReader(f)
                  if row.get("task") == task and row.get("cell") == cell and row.get("lr") not in (None, "")}
    train = study.cell(task, cell).train
    if not chosen or train.lr_grid:  # nothing recorded, or the check run chooses its lr itself
        return
    if len(chosen) > 1:
        raise StageError(f"check-reference: {results} lists several lrs for {task}/{cell} ({sorted(chosen)}); "
                         f"a check run needs one")
    want = float(chosen.pop())
    if not math.isclose(train.lr, want, rel_tol=1e-9):
        raise StageError(f"check-reference: {study.path} trains {task}/{cell} at lr {train.lr:g}, but the reference "
                         f"study trained it at {want:g} ({results}): set tasks.{task}.train.lr to {want:g}")


def run(study: Study, task: str, cell: str, seed: int, reference: str, make: bool = False) -> int:
    check_lr_matches(study, Path(reference), task, cell)
    run_files = _run_files(study, task, cell, seed)
    missing = [str(p) for p in run_files.values() if not p.exists()]
    if missing:
        raise StageError(f"check-reference: {missing[0]} is missing: run the train and evaluate stages of "
                         f"{task}/{cell}/seed{seed} first")
    ref_dir = reference_run_dir(Path(reference), task, cell, seed)
    if make:
        ref_dir.mkdir(parents=True, exist_ok=True)
        for name, path in run_files.items():
            shutil.copyfile(path, ref_dir / name)
        print(f"reference for {task}/{cell}/seed{seed} written to {ref_dir} (torch {package_versions()['torch']})")
        if len(study.seeds) > 1 and not study.adaptive_seeds:  # a fixed list: every seed has run
            print(f"spread over seeds {', '.join(map(str, study.seeds))} written to "
                  f"{_write_check_spread(study, Path(reference), task, cell)}")
        return 0
    if not (ref_dir / "eval_metrics.json").exists():
        raise StageError(f"check-reference: no reference run in {ref_dir} (make one with --make)")
    own = check_seed_spread(Path(reference), task, cell)
    if own:
        std, mean, seeds = own
        spread_args = (std, mean, f"the check run's own seeds ({', '.join(map(str, seeds))})")
    else:
        spread_args = (*seed_spread(Path(reference), task, cell), "the reference study's seeds")
    with _side_by_side(run_files, run_files["train_metrics.json"].parent / ".check") as staged:
        passed, lines = compare(ref_dir, staged, *spread_args)
    print(f"{task}/{cell}/seed{seed} against {ref_dir}:")
    print("\n".join(lines))
    if not passed:
        raise StageError(f"check-reference: {task}/{cell}/seed{seed} moved beyond its tolerance (figures above); "
                         f"if the change is meant to move the numbers, regenerate the reference study and its "
                         f"check run in the same commit series")
    print("PASS")
    return 0
