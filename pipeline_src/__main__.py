"""Command line: `python -m pipeline_src <stage> --params FILE [job keys]`.

Argument parsing only. Every stage validates the params file first and derives its input and
output paths from the stage table, so Snakemake and DVC run exactly the same command.
"""
from __future__ import annotations

import argparse
import os
import sys

from .train import preemption  # first: a job's time budget counts from its start


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline_src", description=__doc__)
    sub = p.add_subparsers(dest="stage", required=True)

    def stage(name: str, help: str, *keys: str):
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--params", default="params.yaml", help="the study's params file")
        for k in keys:
            if k in ("filter_variant", "bpe_variant"):  # the data variant; default: the task's own filter / tokenizer
                what = "filter variant" if k == "filter_variant" else "tokenizer variant"
                sp.add_argument(f"--{k.replace('_', '-')}", default="default" if k == "filter_variant" else None,
                                help=f"the data's {what} (the stage table names it; default: the task's own)")
                continue
            sp.add_argument(f"--{k}", required=True, type=int if k == "seed" else str)
        return sp

    stage("validate", "validate the params file and print a summary of the study")
    stage("code", "record the hashes of the code files a stage kind runs, which its jobs depend on", "kind")
    stage("download", "load a dataset from the Hub or the offline mirror (or generate demo data)", "dataset")
    stage("filter", "apply a task's length/ratio/dedup/sampling filters (one filter variant)", "task", "filter_variant")
    stage("bpe", "train a task's SentencePiece tokenizer (one data variant) and encode its splits",
          "task", "filter_variant", "bpe_variant")
    stage("tune", "choose a cell's peak lr on validation from its train.lr_grid (short trial runs)", "task", "cell")
    stage("train", "train one task x cell x seed", "task", "cell", "seed")
    stage("evaluate", "evaluate one trained task x cell x seed", "task", "cell", "seed")
    stage("promote", "rank a screening's stage-one families and record which stage two runs", "screen")
    stage("plan", "adaptive seeds: judge the claims on the first round and give unsettled comparisons more seeds")
    stage("aggregate", "collect every run into results/summary/significance tables")
    stage("figures", "draw the report's figures")
    stage("tables", "write the report's LaTeX tables")
    stage("claims", "test the study's claims and set its results beside published references")
    stage("report", "build report.tex and compile report.pdf")
    sp = stage("check-reference", "compare a re-made run's metrics with a committed reference copy",
               "task", "cell", "seed")
    sp.add_argument("--reference", required=True, help="the reference directory (e.g. reports/reference/cpu)")
    sp.add_argument("--make", action="store_true", help="copy the run's files into the reference instead")
    stage("exp-show", "dvc exp show for one study: each cell's headline metric and the cell settings that "
                      "differ between experiments (pipeline_src/report/exp_show.py); other options go to dvc exp show")
    sp = stage("dvc-yaml", "write the dvc.yaml for a study from the stage table")
    sp.add_argument("--check", action="store_true", help="exit 1 if the file on disk is out of date")
    sp = stage("parts", "a study in parts for short GPU job slots: predict, targets, pack, build "
                        "(pipeline_src/node/parts.py)")
    # `plan`: the former name of `predict`, still accepted
    sp.add_argument("action", choices=["predict", "layout", "targets", "pack", "build", "plan"],
                    metavar="{predict,layout,targets,pack,build}")
    sp.add_argument("archives", nargs="*", help="build: the parts' archives, or the folder that holds them (right after build)")
    sp.add_argument("--part", help="targets, pack: the part's name (parts.yaml)")
    sp.add_argument("--out", help="pack: the folder the archive goes to")
    sp.add_argument("--reference", help="build: also copy the products, times and versions into this folder")
    sp.add_argument("--started", help="pack: when the part started (UTC, ISO 8601)")
    sp.add_argument("--status", type=int, help="pack: the exit status of the part's Snakemake run")
    sp.add_argument("--log", help="pack: the part's console log, carried in the archive")
    sp.add_argument("--gpu-util", help="pack: the part's nvidia-smi samples, carried in the archive")
    sp.add_argument("--cores", type=int, help="pack: the cores the part's Snakemake run was given (--cores)")
    return p


def main(argv: list[str] | None = None) -> int:
    from .runtime.allocator import keep_freed_memory

    keep_freed_memory()  # before torch allocates: large freed buffers are reused, not unmapped
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.stage != "exp-show":  # exp-show hands the rest to dvc exp show
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    from .common import StageError
    from .study.config import ConfigError, load_study

    try:
        study = load_study(args.params)
        if os.environ.get("DVC_STAGE") and args.stage not in ("validate", "dvc-yaml"):
            from .runtime.dvc_yaml import stale_message

            message = stale_message(study)  # before the stage touches anything
            if message:
                raise ConfigError(message)
        return _run(args, study) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except preemption.SavedForLater as e:  # stopped on purpose, nothing lost: not an error, but not done either
        print(f"stopped: {e}", file=sys.stderr)
        return preemption.EXIT_SAVED
    except BrokenPipeError:  # output piped into `head` and cut short: not an error of the stage
        sys.stdout = None  # nothing more can be written; keeps the interpreter's exit flush quiet
        return 0
    except Exception as e:  # noqa: BLE001 - anything unforeseen is still one line
        if os.environ.get("PIPELINE_TRACEBACK") == "1":
            raise
        from .common import is_out_of_memory, write_error

        if is_out_of_memory(e):
            print(f"error: {_out_of_memory(args, study, e)}", file=sys.stderr)
            return 1
        # a write outside the atomic helpers that its file system refused (the error names the file)
        if isinstance(getattr(e, "filename", None), str) and (line := write_error(e.filename, e)) is not None:
            print(f"error: {line}", file=sys.stderr)
            return 1
        import traceback

        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if os.sep + "pipeline_src" + os.sep in f.filename] or frames
        where = f"{os.path.relpath(ours[-1].filename, os.path.dirname(os.path.dirname(__file__)))}:{ours[-1].lineno}"
        print(f"error: {args.stage}: {type(e).__name__}: {' '.join(str(e).split())[:300]} (in {where}; "
              f"PIPELINE_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 1


def _run(args, study) -> int | None:
    stage = args.stage
    if stage == "validate":
        from .study.stages import build_jobs

        jobs = build_jobs(study)
        print(f"{study.path}: study {study.name!r} is valid: {len(study.tasks)} tasks, "
              f"{len(jobs)} jobs ({sum(j.stage == 'train' for j in jobs)} training runs)")
        from .study.estimate import matched_parameters, summary
        matched = matched_parameters(study)
        if matched:
            print("cells matched in parameters (params_match):\n" + "\n".join(matched))
        print(summary(study))
        return 0
    if stage == "code":
        from .study.code_manifest import run
        return run(study, args.kind)
    if stage == "download":
        from .data.download import run
        return run(study, args.dataset)
    if stage == "filter":
        from .data.filter import run
        return run(study, args.task, args.filter_variant)
    if stage == "bpe":
        from .data.bpe import run
        return run(study, args.task, args.filter_variant, args.bpe_variant)
    if stage == "tune":
        from .tune.lr_trials import run
        return run(study, args.task, args.cell)
    if stage == "train":
        from .train.trainer import run
        return run(study, args.task, args.cell, args.seed)
    if stage == "evaluate":
        from .evaluate.evaluator import run
        return run(study, args.task, args.cell, args.seed)
    if stage == "promote":
        from .report.promote import run_promote
        return run_promote(study, args.screen)
    if stage == "plan":
        from .report.plan import run
        return run(study)
    if stage == "aggregate":
        from .report.aggregate import run
        return run(study)
    if stage == "figures":
        from .report.figures import run
        return run(study)
    if stage == "tables":
        from .report.tables import run
        return run(study)
    if stage == "claims":
        from .report.claims import run
        return run(study)
    if stage == "report":
        from .report.build import run
        return run(study)
    if stage == "check-reference":
        from .report.reference import run
        return run(study, args.task, args.cell, args.seed, args.reference, make=args.make)
    if stage == "dvc-yaml":
        from .runtime.dvc_yaml import run
        return run(study, check=args.check)
    if stage == "exp-show":
        from .report.exp_show import run
        return run(study, args.rest)
    if stage == "parts":
        from .node.parts import run
        return run(study, args.action, args.part, args.out, args.archives, args.reference, args.started, args.status,
                   args.log, args.gpu_util, args.cores)
    raise AssertionError(stage)


def _out_of_memory(args, study, err: Exception) -> str:
    """Which job ran out of memory, where, and the setting that lowers what it needs."""
    from .common import human_size
    job = "/".join(str(getattr(args, k)) for k in ("task", "cell", "seed") if getattr(args, k, None) is not None)
    device = "GPU" if type(err).__name__ == "OutOfMemoryError" else "CPU"
    fix = "give the job more memory"
    if args.stage in ("train", "evaluate"):
        cell = study.cell(args.task, args.cell)
        where = f"tasks.{args.task}" + (f" or {study.cell_key(args.cell)}" if args.cell in study.cells else "")
        if args.stage == "train":
            fix = (f"lower train.batch_tokens ({cell.train.batch_tokens} now; raise train.grad_accum, "
                   f"{cell.train.grad_accum} now, to keep the batch) in {where}, or give the job more memory")
        else:
            fix = (f"lower eval.batch_size ({cell.eval.batch_size} now) or eval.beam_size "
                   f"({cell.eval.beam_size}) in {where}, or give the job more memory")
    import re

    asked = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B|\d+ bytes)", str(err))
    size = asked and (human_size(int(asked[1].split()[0])) if asked[1].endswith(" bytes") else asked[1])
    detail = f" while allocating {size}" if asked else ""
    return f"{args.stage} {job}: out of memory on the {device}{detail}; {fix}"


def _drop_torch_library_finalizers() -> None:
    """torch unregisters each of the ~130 operator libraries its Python code defined when the
    interpreter exits; this process ends right after, so that undoes nothing that outlives it. In
    a job forked from the start-up server it also writes to pages shared with the server, which the
    kernel must copy first: ~37 ms of such a job's exit instead of ~5 ms."""
    library = sys.modules.get("torch.library")
    unregister = getattr(library, "_del_library", None)
    if unregister is None:
        return
    import weakref

    for finalizer, info in list(weakref.finalize._registry.items()):  # noqa: SLF001 - no public way to list them
        if info.func is unregister:
            finalizer.detach()


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown once everything the stage wrote is closed.

    With torch loaded, tearing the interpreter down (module clean-up, libtorch's static
    destructors) takes ~0.3 s, on top of the ~0.8 s that importing torch took, in every job of a
    study. What a normal exit does that matters still happens: atexit handlers (logging's flush,
    temporary directories, multiprocessing's children) and the flush of stdout/stderr. A process
    that still has a non-daemon thread running exits the normal way, which waits for it, and so
    does one under a profiler or debugger (`python -m cProfile -m pipeline_src ...` writes its
    stats after the stage returns).
    """
    import atexit
    import contextlib
    import threading

    if sys.getprofile() or sys.gettrace() or any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    _drop_torch_library_finalizers()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # main() sets stdout to None when its reader went away
            with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
                stream.flush()
    os._exit(code)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .runtime import preload

    if sys.argv[1:2] == ["preload"]:  # python -m pipeline_src preload COMMAND...: pipeline_src/runtime/preload.py
        sys.exit(preload.serve(sys.argv[2:]))
    status = preload.run_in_preloaded()  # under it, the stage runs in a copy of the server
    if status is not None:
        sys.exit(status)
    exit_now(main())
