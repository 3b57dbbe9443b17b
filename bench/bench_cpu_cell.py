"""A CPU training job as the CPU study runs it: bf16 vs fp32, the allocator, the real cell vs its step.

What it measures, one thread per job (as `snakemake --cores N` runs N CPU jobs of one thread):
  1. the isolated training step (forward, label-smoothed loss, backward, AdamW) of our model at
     d128/2+2 and d256/3+3 on a batch shaped like a real Multi30k batch (240 sentences, 14 source
     and 16 target tokens: 3,840 target tokens, vocabulary 8,000), median of the timed steps, in
     fp32 and under bf16 autocast (`train.precision` fp32 / bf16), with whether this CPU has native
     bf16 (what `precision: auto` reads, pipeline_src/train/precision.py);
  2. the real `train` stage on the mirror's full Multi30k (BPE 8k, d128/2+2, batch_tokens 4096,
     --steps steps, no evaluation inside them) with the allocator options on (what every stage
     does, pipeline_src/runtime/allocator.py) and off (PIPELINE_MALLOC=system): target tok/s of the
     training loop, user and system CPU seconds of the job, and whether both wrote the same
     train_metrics.json bytes;
  3. the real cell's tok/s as a share of the isolated d128 fp32 step's.

Targets: real cell >= 80 % of its isolated step; >= 7,500 target tok/s for the real d128 cell;
bf16 / fp32 step time <= 1 / 1.8 at d256/3+3 where the CPU has native bf16 (on a CPU without
it bf16 is emulated and slower, and `precision: auto` stays on fp32).

    python bench/bench_cpu_cell.py [--quick] [--steps 80] [--precision auto|fp32|bf16] [--out DIR]

With --compile it measures instead the real cell eager against torch.compile at the layer scope
(train.compile and compile_on_cpu, compile_scope: layers: what a CPU study would switch on): each
variant is the train stage in a fresh process, the compiled one twice, first with an empty inductor cache
("cold": a fresh machine) and then with the cache the first left ("warm": every later job of a
study on the same machine). Per variant: the job's wall time (torch import, data, compile warm-up
and the steps), the training loop's steady target tok/s over the steps after the first --skip
(the trainer's live log), and the final training loss beside the eager one. From these it
extrapolates the wall time of a run of --run-steps steps; compiled pays where it is shorter there.
Target: compiled >= 1.3x the eager steady throughput, final loss within 0.01 nats of eager's.

    python bench/bench_cpu_cell.py --compile [--steps 200] [--run-steps 6000] [--name cpu_cell_compile]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import OUT_DIR, REPO, md_table, median, mirror_dir, tool_env, write_report

import torch
import yaml

from pipeline_src.train.compiling import token_loss
from pipeline_src.data.tokens import BOS, EOS, PAD
from pipeline_src.model import ModelConfig, Transformer
from pipeline_src.train.optim import adamw
from pipeline_src.train.precision import autocast, cpu_has_native_bf16
from pipeline_src.train.trainer import sequence_loss

TASK = "multi30k_en_de"
STEP_CONFIGS = {"d128/2+2": (128, 4, 2, 2), "d256/3+3": (256, 4, 3, 3)}  # d_model, heads, enc, dec; d_ff 4 d
QUICK_STEP_CONFIGS = {"d64/1+1": (64, 4, 1, 1)}
REAL_BATCH = (240, 14, 16)  # sentences, source tokens, target tokens: the mean shape of a real batch


def step_time(cfg: ModelConfig, batch_shape, precision: str, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    opt = adamw(model.parameters(), torch.device("cpu"), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    b, s, t = batch_shape
    g = torch.Generator().manual_seed(0)
    batch = {"src": torch.randint(4, cfg.vocab_size, (b, s), generator=g),
             "tgt_in": torch.randint(4, cfg.vocab_size, (b, t), generator=g),
             "tgt_out": torch.randint(4, cfg.vocab_size, (b, t), generator=g)}
    n_tokens = b * t
    cpu = torch.device("cpu")
    times = []
    for i in range(warmup + steps):
        tick = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast(cpu, precision):
            loss = sequence_loss(model, batch, label_smoothing=0.1, loss_fn=token_loss)
        (loss / n_tokens).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - tick)
    return median(times)


def isolated_steps(args) -> list[dict]:
    rows = []
    configs = QUICK_STEP_CONFIGS if args.quick else STEP_CONFIGS
    shape = (32, 14, 16) if args.quick else REAL_BATCH
    vocab = 1000 if args.quick else 8000
    for name, (d, h, e, dec) in configs.items():
        cfg = ModelConfig(vocab_size=vocab, d_model=d, n_heads=h, enc_layers=e, dec_layers=dec, d_ff=4 * d,
                          dropout=0.1, pad_id=PAD, bos_id=BOS, eos_id=EOS)
        times = {p: step_time(cfg, shape, p, args.step_reps, 1 if args.quick else 3) for p in ("fp32", "bf16")}
        tokens = shape[0] * shape[2]
        rows.append({"config": name, "batch": list(shape), "fp32_ms": 1e3 * times["fp32"], "bf16_ms": 1e3 * times["bf16"],
                     "fp32_tok_s": tokens / times["fp32"], "bf16_tok_s": tokens / times["bf16"],
                     "bf16_speedup": times["fp32"] / times["bf16"]})
    return rows


def write_study(work: Path, args, **train) -> None:
    params = yaml.safe_load((REPO / "bench" / "real_cell.yaml").read_text())
    params["mirror"] = str(mirror_dir())
    params["device"] = "cpu"
    task = params["tasks"][TASK]
    task["bpe"]["vocab_size"] = 2000 if args.quick else 8000
    task["filter"].update(max_ratio=3.0, **({"sample_size": 2000, "sample_seed": 0} if args.quick else {}))
    task["model"] = dict(d_model=64 if args.quick else 128, n_heads=4, enc_layers=1 if args.quick else 2,
                         dec_layers=1 if args.quick else 2, d_ff=256 if args.quick else 512, dropout=0.1, max_len=256)
    task["train"].update(max_steps=args.steps, batch_tokens=4096, warmup_steps=100, lr=2e-3, eval_every=10**6,
                         log_every=20, patience=0, precision=args.precision, max_src_len=128, max_tgt_len=128,
                         **train)
    (work / "study.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def stage(work: Path, env: dict, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline_src", *args, "--params", "study.yaml"], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def prepare_cell(work: Path, args, **env_extra) -> tuple[dict, Path]:
    """The real cell's study file and data in `work`: (the stages' environment, its run folder)."""
    write_study(work, args)
    env = dict(tool_env(REPO), PIPELINE_CPU_THREADS="1", **env_extra)
    for a in (["download", "--dataset", "multi30k"], ["filter", "--task", TASK], ["bpe", "--task", TASK]):
        stage(work, env, *a)
    return env, work / "data" / "realcell" / "runs" / TASK / "baseline" / "seed0"


def real_cell(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_cpu_cell_") as tmp:
        work = Path(tmp)
        env, run_dir = prepare_cell(work, args)
        for malloc in ("keep", "system"):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            stage(work, dict(env, PIPELINE_MALLOC=malloc), "train", "--task", TASK, "--cell", "baseline", "--seed", "0")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cost = json.loads((run_dir / "cost.json").read_text())
            rows.append({"allocator": cost["allocator"], "precision": cost["precision"],
                         "steps": args.steps, "tokens_per_s": cost["tokens_per_s"], "train_loop_s": cost["wall_s"],
                         "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
                         "metrics": (run_dir / "train_metrics.json").read_bytes().decode()})
            for p in run_dir.iterdir():  # the next variant trains from scratch
                subprocess.run(["rm", "-rf", str(p)], check=True)
    return rows


def _steady_tok_s(run_dir: Path, skip: int) -> float:
    """The median target tok/s of the training loop's logged windows (train.log_every steps each,
    train_log.tsv) after its first `skip` steps: compile warm-up and first steps left out."""
    import csv
    with open(run_dir / "train_log.tsv", newline="") as f:
        rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f, delimiter="\t")
                 if int(r["step"]) > skip and r.get("tokens_per_s")]
    if not rates:
        raise RuntimeError(f"train_log.tsv logs no step after step {skip}: raise --steps")
    return median(rates)


COMPILED = {"compile": True, "compile_on_cpu": True, "compile_scope": "layers"}


def compile_cells(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_cpu_compile_") as tmp:
        work = Path(tmp)
        env, run_dir = prepare_cell(work, args, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor_cache"))
        for variant, train in (("eager", {}), ("compiled, cold cache", COMPILED), ("compiled, warm cache", COMPILED)):
            write_study(work, args, **train)
            tick = time.perf_counter()
            stage(work, env, "train", "--task", TASK, "--cell", "baseline", "--seed", "0")
            job_s = time.perf_counter() - tick
            cost = json.loads((run_dir / "cost.json").read_text())
            metrics = json.loads((run_dir / "train_metrics.json").read_text())
            rows.append({"variant": variant, "steps": args.steps, "job_s": job_s, "train_loop_s": cost["wall_s"],
                         "steady_tok_s": _steady_tok_s(run_dir, args.skip), "compiled": cost.get("compiled"),
                         "final_train_loss": metrics.get("final_train_loss"),
                         "tgt_tokens_per_step": cost.get("target_tokens", 0) / max(args.steps, 1)})
            for p in run_dir.iterdir():  # the next variant trains from scratch
                subprocess.run(["rm", "-rf", str(p)], check=True)
    eager = rows[0]
    for r in rows:
        # what the job spends beyond its steady steps: process start, loading data, compile warm-up
        r["fixed_s"] = r["job_s"] - r["steps"] * r["tgt_tokens_per_step"] / r["steady_tok_s"]
        r["run_s"] = r["fixed_s"] + args.run_steps * r["tgt_tokens_per_step"] / r["steady_tok_s"]
        r["speedup"] = r["steady_tok_s"] / eager["steady_tok_s"]
        r["run_speedup"] = eager["run_s"] / r["run_s"]
        r["loss_diff"] = (r["final_train_loss"] - eager["final_train_loss"]) if r["final_train_loss"] is not None \
            and eager["final_train_loss"] is not None else None
    return rows


def main_compile(args) -> None:
    torch.set_num_threads(1)
    rows = compile_cells(args)
    best = rows[2]
    verdict = ("meets" if best["speedup"] >= 1.3 and abs(best["loss_diff"] or 0) <= 0.01 else "misses")
    if not all(r["compiled"] for r in rows[1:]):
        raise RuntimeError("the compiled variants' cost.json says compiled: false: the train stage did not compile")
    body = [f"The real train stage (Multi30k in full, d128/2+2, BPE 8k, batch_tokens 4096, precision "
            f"{args.precision}), {args.steps} steps, one thread, eager against torch.compile at the layer scope. "
            f"Steady throughput over the steps after step {args.skip}; a run of {args.run_steps:,} steps is "
            "extrapolated from each job's fixed seconds (start, data, warm-up) and its steady rate.", "",
            md_table(["variant", "job s", "training loop s", "steady target tok/s", "× eager",
                      f"fixed s", f"{args.run_steps:,}-step run s (extrapolated)", "× eager over the run",
                      "final train loss", "Δ loss vs eager"],
                     [[r["variant"], r["job_s"], r["train_loop_s"], r["steady_tok_s"], f"{r['speedup']:.2f}×",
                       r["fixed_s"], r["run_s"], f"{r['run_speedup']:.2f}×", r["final_train_loss"],
                       r["loss_diff"]] for r in rows]), "",
            f"- target: compiled (warm cache) ≥ 1.3× eager's steady throughput, final loss within 0.01 nats: "
            f"**{verdict}** it ({best['speedup']:.2f}×, Δ {best['loss_diff']:+.4f})"]
    write_report(args.name, "CPU training: eager vs torch.compile (layer scope) on the real cell",
                 {"compile_cells": rows, "run_steps": args.run_steps}, "\n".join(body), quick=args.quick,
                 out_dir=args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, a 2,000-pair sample, few steps (smoke test)")
    ap.add_argument("--steps", type=int, help="training steps of the real cell (default 80, quick 6)")
    ap.add_argument("--step-reps", type=int, help="timed isolated steps per variant (default 10, quick 2)")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="the real cell's train.precision")
    ap.add_argument("--compile", action="store_true", help="eager vs torch.compile (layer scope) instead")
    ap.add_argument("--skip", type=int, default=20, help="--compile: steps left out of the steady rate")
    ap.add_argument("--run-steps", type=int, default=6000, help="--compile: the run length to extrapolate to")
    ap.add_argument("--name")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args()
    args.name = args.name or ("cpu_cell_compile" if args.compile else "cpu_cell")
    if args.compile:
        args.steps = args.steps or (40 if args.quick else 200)
        args.skip = min(args.skip, args.steps // 2)
        if not (mirror_dir() / "multi30k").is_dir():
            sys.exit(f"error: no Multi30k in the mirror {mirror_dir()} (set PIPELINE_DATA_MIRROR)")
        return main_compile(args)
    args.steps = args.steps or (6 if args.quick else 80)
    args.step_reps = args.step_reps or (2 if args.quick else 10)
    if not (mirror_dir() / "multi30k").is_dir():
        sys.exit(f"error: no Multi30k in the mirror {mirror_dir()} (set PIPELINE_DATA_MIRROR)")
    torch.set_num_threads(1)
    native = cpu_has_native_bf16()
    steps = isolated_steps(args)
    cells = real_cell(args)
    keep = next(c for c in cells if c["allocator"] == "glibc-keep")
    system = next(c for c in cells if c["allocator"] == "system")
    iso = steps[0]["bf16_tok_s" if keep["precision"] == "bf16-autocast" else "fp32_tok_s"]
    share = keep["tokens_per_s"] / iso
    results = {"native_bf16": native, "isolated_steps": steps, "real_cell": cells,
               "real_vs_isolated": share, "allocator_speedup": keep["tokens_per_s"] / system["tokens_per_s"],
               "same_metrics_either_allocator": keep["metrics"] == system["metrics"]}
    body = [f"One thread per job. This CPU has native bf16: **{'yes' if native else 'no'}** "
            f"(`precision: auto` trains in {'bf16 autocast' if native else 'fp32'} here).", "",
            "### Isolated training step (batch shaped like a real Multi30k batch)", "",
            md_table(["config", "batch (sent. × src × tgt)", "fp32 ms", "bf16 ms", "fp32 tok/s", "bf16 tok/s",
                      "bf16 speed-up (target ≥ 1.8× at d256, native bf16)"],
                     [[r["config"], "×".join(map(str, r["batch"])), r["fp32_ms"], r["bf16_ms"], r["fp32_tok_s"],
                       r["bf16_tok_s"], f"{r['bf16_speedup']:.2f}×"] for r in steps]), "",
            f"### The real train stage, {args.steps} steps (Multi30k in full, d128/2+2, BPE 8k, batch_tokens 4096)", "",
            md_table(["allocator", "precision", "target tok/s (target ≥ 7,500)", "training loop s", "user CPU s",
                      "system CPU s"],
                     [[c["allocator"], c["precision"], c["tokens_per_s"], c["train_loop_s"], c["user_s"], c["sys_s"]]
                      for c in cells]), "",
            f"- allocator options on vs off: {results['allocator_speedup']:.2f}× target tok/s; train_metrics.json "
            f"{'byte-identical' if results['same_metrics_either_allocator'] else 'DIFFERENT'}",
            f"- real cell / isolated {steps[0]['config']} step ({keep['precision']}): **{100 * share:.0f} %** (target ≥ 80 %)"]
    write_report(args.name, "CPU training: bf16 vs fp32, allocator, real cell vs isolated step", results,
                 "\n".join(body), quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    main()
