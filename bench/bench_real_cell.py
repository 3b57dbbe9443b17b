"""A real cell, end to end: the real `train` stage on Multi30k from the offline mirror for a fixed
time budget, then the real `evaluate` stage (perplexities, beam-4 decoding of the test set, BLEU).

Study: bench/real_cell.yaml (the real study's Multi30k task: filter, BPE 10k, base model,
batch_tokens 8192, train.length_buckets 8), prepared with the real download/filter/bpe stages in
a scratch directory. On a GPU the base model trains as params.yaml has it; on CPU (--small, the
default there) a d128/2+2 model with batch_tokens 2048 and a 200-sentence test set.

Reported (from the stages' own cost.json / metrics, plus timing of the stage commands):
target tok/s and MFU of the timed training steps (incl. data and logging), padding fraction,
distinct batch shapes and their warm-up (compile) seconds, device-seconds per epoch
(target tokens of an epoch / tok/s), the evaluate stage's wall time, and the seconds of
decode_all (the evaluate stage's beam-search function) on the test set, timed on its own.
--jobs K trains K cells (seeds) at once on the same device: aggregate tok/s and MFU (several
small cells per GPU; set PIPELINE_JOBS_PER_GPU on multi-GPU hosts).
Targets on an H100: the base Multi30k cell at >= 3x 112.7k target tok/s (its eager figure), the
compile warm-up <= 60 s in total, beam-4 decoding of the whole test set <= 10 s; aggregate MFU
>= 25 % with K = 1, 2, 4, 8 cells sharing the GPU. On a CPU it measures the one-thread job that
`validate` uses to estimate a CPU study's time (bench/results/cpu/real_cell_cpu.json).

    python bench/bench_real_cell.py [--quick] [--budget-s 60] [--buckets 8|0] [--compile [--compile-scope layers|model] [--compile-shapes auto|static]] [--cuda-graphs] [--decoding graphs] [--jobs K] [--test-sentences N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import OUT_DIR, REPO, md_table, mirror_dir, tool_env, write_report

import yaml

STUDY = REPO / "bench" / "real_cell.yaml"
TASK = "multi30k_en_de"
SMALL_MODEL = dict(d_model=128, n_heads=4, enc_layers=2, dec_layers=2, d_ff=512)


def stage(work: Path, *args: str) -> float:
    env = tool_env(REPO)
    tick = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline_src", *args, "--params", "study.yaml"], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - tick


def write_study(work: Path, args, cuda: bool) -> dict:
    params = yaml.safe_load(STUDY.read_text())
    params["mirror"] = str(mirror_dir())
    params["seeds"] = list(range(args.jobs))
    task = params["tasks"][TASK]
    train = task["train"]
    # A fixed budget: no step limit, no evaluation inside it (the stage evaluates once at the end).
    train.update(max_steps=10**7, eval_every=10**7, time_budget_s=args.budget_s, length_buckets=args.buckets,
                 compile=args.compile or args.cuda_graphs, cuda_graphs=args.cuda_graphs, patience=0,
                 compile_scope=args.compile_scope, compile_dynamic={"auto": None, "static": False}[args.compile_shapes])
    task["eval"]["decoding"] = args.decoding
    if args.small:
        task["model"].update(SMALL_MODEL)
        train["batch_tokens"] = 2048
        task["eval"]["max_examples"] = 100 if args.quick else 200
    if args.test_sentences:
        task["eval"]["max_examples"] = args.test_sentences
    if args.quick:
        task["model"].update(d_model=64, n_heads=4, enc_layers=1, dec_layers=1, d_ff=128)
    if not cuda:
        params["device"] = "cpu"
    (work / "study.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return params


def timed_decode(work: Path, params: dict, cuda: bool) -> tuple[float, int]:
    """decode_all (the evaluate stage's decoder) on the test set, timed on its own."""
    sys.path.insert(0, str(REPO))
    import torch
    from pipeline_src.train import batching
    from pipeline_src.study.config import load_study
    from pipeline_src.evaluate.evaluator import decode_all
    from pipeline_src.study.stages import data_paths, output_path
    from pipeline_src.train.trainer import load_trained_model

    cwd = os.getcwd()
    os.chdir(work)
    try:
        study = load_study("study.yaml")
        cell = study.cell(TASK, "baseline")
        device = torch.device("cuda" if cuda else "cpu")
        if cuda:
            torch.backends.cuda.enable_cudnn_sdp(False)  # as the evaluate stage
        ckpt = output_path("train", "ckpt", study=study.name, task=TASK, cell="baseline", seed=0)
        model, _ = load_trained_model(ckpt, device)
        bpe = data_paths(study, TASK, "baseline")[1]
        test = batching.load_seq2seq(bpe, "test", cell.train.max_src_len, cell.train.max_tgt_len,
                                     limit=cell.eval.max_examples)
        decode_all(model, batching.Seq2SeqData(test.src[:16], test.tgt[:16]), cell.eval, device, cell.train.precision,
                   "warm-up")
        if cuda:
            torch.cuda.synchronize()
        tick = time.perf_counter()
        decode_all(model, test, cell.eval, device, cell.train.precision, "decode")
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - tick, len(test)
    finally:
        os.chdir(cwd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 15 s budget, 100 test sentences (smoke test)")
    ap.add_argument("--budget-s", type=float, help="training budget per cell (default 150 GPU, 60 CPU, 15 quick)")
    ap.add_argument("--buckets", type=int, default=8, help="train.length_buckets (0 = dynamic shapes)")
    ap.add_argument("--compile", action="store_true", help="train.compile (CUDA only)")
    ap.add_argument("--cuda-graphs", action="store_true", help="train.cuda_graphs (with --compile; CUDA only)")
    ap.add_argument("--compile-scope", default="layers", choices=["layers", "model"], help="train.compile_scope")
    ap.add_argument("--compile-shapes", default="auto", choices=["auto", "static"],
                    help="train.compile_dynamic: auto = null (automatic dynamic), static = false")
    ap.add_argument("--decoding", default="auto", choices=["auto", "host", "static", "graphs"],
                    help="eval.decoding: the beam search implementation of the evaluate stage")
    ap.add_argument("--jobs", type=int, default=1, help="cells trained at once on the device")
    ap.add_argument("--test-sentences", type=int,
                    help="test sentences the evaluate stage decodes (default all on a GPU, 200 on CPU, 100 quick)")
    ap.add_argument("--small", action="store_true", help="the CPU model on any device (default on CPU)")
    ap.add_argument("--name", default="real_cell", help="report name under --out")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args()
    import torch
    cuda = torch.cuda.is_available()
    args.small = args.small or not cuda or args.quick
    args.budget_s = args.budget_s or (15 if args.quick else 150 if cuda else 60)
    if not (mirror_dir() / "multi30k").is_dir():
        sys.exit(f"error: no Multi30k in the mirror {mirror_dir()} (set PIPELINE_DATA_MIRROR)")

    with tempfile.TemporaryDirectory(prefix="bench_real_cell_") as tmp:
        work = Path(tmp)
        params = write_study(work, args, cuda)
        prep = sum(stage(work, *a) for a in (["download", "--dataset", "multi30k"], ["filter", "--task", TASK],
                                             ["bpe", "--task", TASK]))
        env = tool_env(REPO)
        tick = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "pipeline_src", "train", "--params", "study.yaml", "--task", TASK,
                                   "--cell", "baseline", "--seed", str(s)], cwd=work, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in range(args.jobs)]
        for p in procs:
            out, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"train failed:\n{out[-2000:]}{err[-3000:]}")
        train_wall = time.perf_counter() - tick
        runs = work / "data" / "realcell" / "runs" / TASK / "baseline"
        costs = [json.loads((runs / f"seed{s}" / "cost.json").read_text()) for s in range(args.jobs)]
        metrics = json.loads((runs / "seed0" / "train_metrics.json").read_text())
        eval_wall = stage(work, "evaluate", "--task", TASK, "--cell", "baseline", "--seed", "0")
        ev_info = json.loads((work / "data" / "realcell" / "eval" / TASK / "baseline" / "seed0" / "eval_info.json")
                             .read_text())
        ev = json.loads((work / "data" / "realcell" / "eval" / TASK / "baseline" / "seed0" / "eval_metrics.json")
                        .read_text())
        decode_s, n_test = timed_decode(work, params, cuda)
        sys.path.insert(0, str(REPO))
        from pipeline_src.train import batching
        from pipeline_src.study.config import load_study
        from pipeline_src.study.stages import data_paths
        bpe_dir = data_paths(load_study(work / "study.yaml"), TASK, "baseline")[1]  # relative to work/
        train_data = batching.load_seq2seq(work / bpe_dir, "train", 256, 256)
        epoch_tokens = sum(len(t) + 1 for t in train_data.tgt)

    cost = costs[0]
    tok_s = sum(c["tokens_per_s"] for c in costs)
    mfu = sum(c["mfu"] for c in costs) if all(c["mfu"] is not None for c in costs) else None
    results = {
        "config": {"budget_s": args.budget_s, "length_buckets": args.buckets, "compile": args.compile,
                   "cuda_graphs": args.cuda_graphs, "compile_scope": args.compile_scope,
                   "compile_shapes": args.compile_shapes, "decoding": args.decoding, "jobs": args.jobs, "small": args.small, "model": params["tasks"][TASK]["model"],
                   "batch_tokens": params["tasks"][TASK]["train"]["batch_tokens"]},
        "cost": dict(cost, tokens_per_s=tok_s, mfu=mfu), "per_job_cost": costs,
        "steps": metrics["steps"], "epochs": metrics["epochs"], "train_tokens": metrics["train_tokens"],
        "epoch_target_tokens": epoch_tokens, "device_s_per_epoch": epoch_tokens / cost["tokens_per_s"],
        "prep_s": prep, "train_wall_s": train_wall, "evaluate_wall_s": eval_wall, "decode_s": decode_s,
        "decode_sentences": n_test, "decoding_as_run": ev_info.get("decoding"), "bleu": ev["metrics"].get("bleu"), "val_loss": ev["metrics"].get("val_loss"),
    }
    rows = [["device", cost["device_name"]], ["cells at once", args.jobs],
            ["model", "base (params.yaml)" if not args.small else "d{d_model}/{enc_layers}+{dec_layers}".format(
                **params["tasks"][TASK]["model"])],
            ["train.length_buckets", args.buckets], ["train.compile", args.compile or args.cuda_graphs],
            ["train.cuda_graphs", args.cuda_graphs],
            ["train.compile_scope / shapes", f"{args.compile_scope} / {args.compile_shapes}"],
            ["eval.decoding", args.decoding],
            ["as run: compiled / CUDA graphs / decoding", f"{cost.get('compiled')} / {cost.get('cuda_graphs')} / "
                                                          f"{ev_info.get('decoding')}"],
            ["training budget s", args.budget_s], ["steps (cell 1)", metrics["steps"]],
            ["target tok/s (all cells)", tok_s], ["MFU (all cells)", f"{100 * mfu:.1f} %" if mfu is not None else None],
            ["padding fraction", f"{100 * cost['pad_fraction']:.1f} %"], ["batch shapes", cost["batch_shapes"]],
            ["first-step-of-shape (warm-up) s", cost["warmup_s"]], ["graphs compiled", cost.get("compiled_graphs")],
            ["device-s per epoch (cell 1)", results["device_s_per_epoch"]],
            ["evaluate stage wall s", eval_wall], [f"decode_all s ({n_test} test sentences, beam "
                                                   f"{params['tasks'][TASK]['eval']['beam_size']})", decode_s],
            ["BLEU after the budget", results["bleu"]]]
    body = md_table(["figure", "value"], rows)
    write_report(args.name, "A real Multi30k cell: train + evaluate stages", results, body, quick=args.quick,
                 out_dir=args.out)


if __name__ == "__main__":
    main()
