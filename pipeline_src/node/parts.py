"""A study in parts, for GPU nodes reached in short job slots: each part trains and evaluates some
of the study's runs and packs what finished into one small archive; the report is built from the
archives on any CPU machine, by the pipeline's own report stages.

    python -m pipeline_src parts predict --params P                 the parts, their runs, predicted minutes
    python -m pipeline_src parts targets --params P --part NAME     a part's Snakemake targets, one a line
    python -m pipeline_src parts pack    --params P --part NAME --out DIR [--started UTC] [--status N]
                                         [--log FILE] [--gpu-util FILE] [--cores N]
    python -m pipeline_src parts build   ARCHIVE_OR_DIR... --params P [--reference DIR]

The layout is `parts.yaml` beside the params file (when its `study:` is this study; otherwise one
part per task):

    study: gpu
    gpu: NVIDIA H100 80GB HBM3   # the GPU the prediction is for (`validate` prints it)
    jobs_per_gpu: 8              # training/evaluation jobs sharing the GPU
    limit_s: 300                 # each part stops its jobs at this and packs what finished
    study_limit_s: 480           # the target for all parts together (checked by the prediction)
    archive_mib: 16              # the most one archive may weigh
    parts:                       # in order; every run of the study in exactly one part, at most 8 parts
      - {name: multi30k, tasks: [multi30k_en_de]}
      - {name: ptb, tasks: [ptb], cells: [...], seeds: [...]}   # cells/seeds: optional subsets

An archive (<study>-<index>-<part>.tar.gz, written under a temporary name and renamed, so a part
killed while packing leaves none) holds, for every run of the part that finished training AND
evaluation: train_metrics/info/log and cost.json, the evaluation's metrics, info and per-example
outputs, the Snakemake logs and benchmark records of its jobs; the data files the report stages
read for the part's tasks (filter and BPE statistics, the SentencePiece model, the encoded
validation and test splits); part.json (runs finished and missing, times, exit status, the
prediction); versions.txt; the part's console log and GPU utilisation samples. No checkpoints,
with one exception: the weights of each task's first run (first cell, first seed), which the
figures stage's attention heat map reads, without optimizer state, in fp32 when the archive has
room, else rounded to fp16, else to int8 with one scale per row (part.json records which, and
how far the heat map's attention weights move).

`build` puts the archives' files where the pipeline keeps them, then runs aggregate, figures,
tables, claims and report. When runs are missing (a part that did not come back, or runs a part
did not finish), it prints them in one message, builds the report of what came back (the cells
whose every seed came back, of the tasks whose baseline cell did; claims and references that need
a missing cell are left out) from a derived params file whose title and description say that it
is partial and which runs are missing, writes reports/<study>/missing_runs.txt, and exits 3.
"""
from __future__ import annotations

import datetime
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

from ..common import (ConfigError, StageError, atomic_write_json, atomic_write_text, git_commit, package_versions,
                      utc_stamp)
from ..study.config import Study
from ..study.paths import OUTPUTS, data_paths, output_path
from .parts_layout import Layout, Run, archive_name, load_layout, study_runs

PARTIAL_EXIT = 3  # build: a report was built, but of fewer runs than the study has


def run_files(study: Study, run: Run) -> dict[str, Path]:
    """A run's records that travel (not its checkpoint) and the one that says it is complete."""
    t, c, s = run
    path_fields = dict(study=study.name, task=t, cell=c, seed=s)
    files = {f"train.{n}": Path(output_path("train", n, **path_fields)) for n in OUTPUTS["train"] if n != "ckpt"}
    files.update({f"evaluate.{n}": Path(output_path("evaluate", n, **path_fields)) for n in OUTPUTS["evaluate"]})
    return files


def run_complete(study: Study, run: Run) -> bool:
    """Trained and evaluated: every output exists (each stage writes its info/metrics file last)."""
    return all(p.exists() for p in run_files(study, run).values())


def job_logs(study: Study, run: Run) -> list[Path]:
    t, c, s = run
    name = f"{t}-{c}-s{s}"
    return [Path(f"logs/{study.name}/{stage}/{name}.log") for stage in ("train", "evaluate")] + \
           [Path(f"logs/{study.name}/bench/{stage}/{name}.tsv") for stage in ("train", "evaluate")]


def data_files(study: Study, task: str) -> list[Path]:
    """What the report stages read of a task's data: filter and BPE statistics, the tokenizer and
    the encoded validation and test splits (the attention figure's sample), for every data
    variant its cells use."""
    out = []
    for cell in study.tasks[task].cells:
        filtered, bpe = (Path(p) for p in data_paths(study, task, cell))
        out.append(filtered / "stats.json")
        if bpe.is_dir():
            out += sorted(p for p in bpe.iterdir() if p.is_file() and not p.name.startswith("train."))
    return list(dict.fromkeys(out))


def sample_run(study: Study, task: str) -> Run:
    """The run whose weights the attention figure reads when `task` is the figure's task."""
    return task, study.tasks[task].cells[0], study.seeds[0]


def _sample_file(study: Study, run: Run) -> Path:
    ckpt = Path(output_path("train", "ckpt", study=study.name, task=run[0], cell=run[1], seed=run[2]))
    return ckpt / ("averaged.pt" if (ckpt / "averaged.pt").exists() else "best.pt")


# --- the attention sample's weights, small ---------------------------------------------------------


def _encode_weights(state: dict, precision: str) -> dict:
    import torch

    out = {}
    for k, v in state.items():
        if not torch.is_floating_point(v) or precision == "fp32":
            out[k] = v.clone()
        elif precision == "fp16" or v.dim() < 2:
            out[k] = v.to(torch.float16)
        else:  # int8, one scale per row (per output unit)
            rows = v.float().reshape(v.shape[0], -1)
            scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            out[k] = {"q": torch.round(rows / scale).to(torch.int8), "scale": scale.to(torch.float32),
                      "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
    return out


def _decode_weights(state: dict) -> dict:
    import torch

    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = (v["q"].float() * v["scale"]).reshape(v["shape"]).to(getattr(torch, v["dtype"]))
        elif torch.is_floating_point(v):
            out[k] = v.float()
        else:
            out[k] = v
    return out


def _sample_blob(blob: dict, precision: str) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"meta": blob["meta"], "model": _encode_weights(blob["model"], precision), "precision": precision}, buf)
    return gzip.compress(buf.getvalue(), compresslevel=6)


def _attention_shift(study: Study, run: Run, blob: dict, packed: bytes) -> float | None:
    """The largest change of any attention weight of the figure's sample between the weights the
    node trained and the rounded ones the archive carries."""
    try:
        import torch

        from ..model import ModelConfig, Transformer
        from ..report.figures import sample_inputs

        task = study.tasks[run[0]]
        cfg = ModelConfig(**blob["meta"]["model_config"])
        src, tgt, _, _ = sample_inputs(task, Path(data_paths(study, run[0], run[1])[1]), cfg.arch)
        worst = 0.0
        maps = []
        for state in (blob["model"], _decode_weights(torch.load(io.BytesIO(gzip.decompress(packed)),
                                                                 weights_only=True)["model"])):
            model = Transformer(cfg)
            model.load_state_dict(state)
            model.eval()
            with torch.no_grad():
                maps.append(model.attention_weights(torch.tensor([src]) if src is not None else None, torch.tensor([tgt])))
        for key in maps[0]:
            worst = max(worst, float((maps[0][key].float() - maps[1][key].float()).abs().max()))
        return worst
    except Exception as e:  # noqa: BLE001 - a measurement for the record; never stops the packing
        print(f"parts: could not measure the attention figure's change ({type(e).__name__}: {e})", file=sys.stderr)
        return None


# --- pack (on the node) ------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions_text() -> str:
    lines = [f"git commit: {git_commit()}", f"python: {platform.python_version()} on {platform.platform()}, "
             f"{os.cpu_count()} CPUs"]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        lines.append(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"torch: not importable ({type(e).__name__})")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        lines.append(f"nvidia-smi: {smi.stdout.strip()}")
    lines += [f"{k}: {v}" for k, v in package_versions().items()]
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    return "\n".join(lines) + "\n\npip freeze:\n" + freeze


def _seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _missing(study: Study, runs, done) -> list[dict]:
    out = []
    for r in runs:
        if r in done:
            continue
        trained = Path(output_path("train", "metrics", study=study.name, task=r[0], cell=r[1], seed=r[2])).exists()
        out.append({"task": r[0], "cell": r[1], "seed": r[2],
                    "reason": "trained, not evaluated" if trained else "not trained to the end"})
    return out


def _part_files(study: Study, tasks, done) -> list[Path]:
    """The finished runs' records, outputs and job logs; the data files and logs of the tasks."""
    files: list[Path] = []
    for r in done:
        for p in run_files(study, r).values():
            files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        files += [p for p in job_logs(study, r) if p.is_file()]
    for t in tasks:
        files += [p for p in data_files(study, t) if p.is_file()]
        for stage in ("download", "filter", "bpe"):
            key = study.tasks[t].dataset if stage == "download" else t
            for d in (Path(f"logs/{study.name}/{stage}"), Path(f"logs/{study.name}/bench/{stage}")):
                if d.is_dir():
                    files += sorted(p for p in d.iterdir() if p.is_file() and p.name.startswith(key))
    return list(dict.fromkeys(files))


def _add_samples(study: Study, tasks, done, stage_dir: Path, room: float) -> list[dict]:
    """Each task's first run's weights (the attention figure's), as precise as the room allows."""
    import torch

    samples = []
    runs = [r for r in (sample_run(study, t) for t in tasks) if r in done and _sample_file(study, r).exists()]
    for i, run in enumerate(runs):
        blob = torch.load(_sample_file(study, run), map_location="cpu", weights_only=True)
        share = room / (len(runs) - i)  # the room left, shared by the samples still to place
        for precision in ("fp32", "fp16", "int8"):
            packed = _sample_blob(blob, precision)
            if len(packed) <= share:
                break
        (stage_dir / "sample").mkdir(exist_ok=True)
        name = f"sample/{run[0]}.pt.gz"
        (stage_dir / name).write_bytes(packed)
        room -= len(packed)
        shift = 0.0 if precision == "fp32" else _attention_shift(study, run, blob, packed)
        samples.append({"task": run[0], "cell": run[1], "seed": run[2], "file": name,
                        "checkpoint": _sample_file(study, run).name, "precision": precision,
                        "bytes": len(packed), "attention_max_abs_change": shift})
    return samples


def _tar(src: Path, arcname: str, dest: Path) -> None:
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(src, arcname=arcname)


def pack(study: Study, part_name: str, out_dir: str, started: str | None = None, status: int | None = None,
         log: str | None = None, gpu_util: str | None = None, cores: int | None = None) -> Path:
    """One archive of what the part finished, written under a temporary name and renamed."""
    import torch

    layout = load_layout(study)
    part = layout.part(part_name)
    ended = utc_stamp(zulu=True)  # a part's times end in "Z", as node.sh's start time does
    done = [r for r in part.runs if run_complete(study, r)]
    missing = _missing(study, part.runs, done)
    stem = archive_name(study, layout, part.name)[: -len(".tar.gz")]
    record = {
        "study": study.name, "part": part.name, "index": layout.index(part.name), "parts": [p.name for p in layout.parts],
        "params_file": study.path, "params_sha256": _sha256(Path(study.path)), "git_commit": git_commit(),
        "host": platform.node(), "started_utc": started, "ended_utc": ended,
        "wall_s": round(_seconds(ended) - _seconds(started), 1) if started else None,
        "limit_s": layout.limit_s, "jobs_per_gpu": layout.jobs_per_gpu, "snakemake_status": status,
        # jobs at once are at most min(jobs_per_gpu, cores): fewer cores than slots leave the GPU idle
        "snakemake_cores": cores,
        "runs": [{"task": t, "cell": c, "seed": s} for t, c, s in done], "missing": missing,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        from ..study.estimate import predict_parts

        record["predicted_s"] = predict_parts(study, layout)["parts"].get(part.name)
    except Exception:  # noqa: BLE001 - the prediction is context, never a reason to lose a part
        record["predicted_s"] = None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f".{stem}.*"):  # what a packing killed earlier left behind
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    with tempfile.TemporaryDirectory(prefix=f".{stem}.", dir=out) as tmp:
        stage_dir = Path(tmp) / stem
        (stage_dir / "files").mkdir(parents=True)
        for p in _part_files(study, part.tasks, done):
            (stage_dir / "files" / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, stage_dir / "files" / p)
        (stage_dir / "versions.txt").write_text(_versions_text())
        for src, name in ((log, "part.log"), (gpu_util, "gpu_util.csv")):
            if src and Path(src).is_file():
                shutil.copy2(src, stage_dir / name)
        _tar(stage_dir, stem, Path(tmp) / "probe.tar.gz")  # what all but the weights weighs: the room left
        room = layout.archive_mib * 2**20 - (Path(tmp) / "probe.tar.gz").stat().st_size - 64 * 1024
        record["samples"] = samples = _add_samples(study, part.tasks, done, stage_dir, room)
        (stage_dir / "part.json").write_text(json.dumps(record, indent=1) + "\n")
        _tar(stage_dir, stem, out / f".{stem}.tar.gz.partial")
        final = out / f"{stem}.tar.gz"
        os.replace(out / f".{stem}.tar.gz.partial", final)  # the archive appears whole or not at all
    size = final.stat().st_size
    over = f", OVER the {layout.archive_mib:g} MiB limit" if size > layout.archive_mib * 2**20 else ""
    print(f"part {part.name}: {len(done)} of {len(part.runs)} runs finished"
          + (f" ({len(missing)} missing: {_runs_text(missing)})" if missing else "")
          + f"; {final} ({size / 2**20:.1f} MiB{over})"
          + "".join(f"; {s['task']} weights for the attention figure in {s['precision']}" for s in samples))
    return final


def _runs_text(runs: list[dict]) -> str:
    """Runs grouped by task and cell: 'ptb/baseline seeds 0,1; ptb/pe_none seed 2'."""
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r["task"], r["cell"]), []).append(r["seed"])
    return "; ".join(f"{t}/{c} seed{'s' if len(s) > 1 else ''} {','.join(map(str, sorted(s)))}"
                     for (t, c), s in groups.items())


# --- build (anywhere) ----------------------------------------------------------------------------------


def _archives(study: Study, paths: list[str]) -> list[Path]:
    """The archives named, and in a folder those of this study's parts (<study>-<n>-<part>.tar.gz)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            mine = sorted(p.glob(f"{study.name}-[0-9]*-*.tar.gz"))
            other = sorted(q.name for q in p.glob("*.tar.gz") if q not in mine and not q.name.startswith("."))
            if other:
                print(f"note: {p}: not parts of study {study.name}, left alone: {', '.join(other)}")
            out += mine
        elif p.is_file():
            out.append(p)
        else:
            raise StageError(f"{p}: no such archive or folder")
    return out


def _read_archive(path: Path, dest: Path) -> tuple[dict, Path]:
    try:
        with tarfile.open(path) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise StageError(f"{path}: not a readable archive ({type(e).__name__}: {e}); was it cut short on the way?") from None
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1 or not (tops[0] / "part.json").is_file():
        raise StageError(f"{path}: not an archive of `python -m pipeline_src parts pack` (no part.json)")
    return json.loads((tops[0] / "part.json").read_text()), tops[0]


def _same_settings(study: Study, rec: dict) -> bool:
    """The params file the archive was made with, read from its commit, holds the same settings as
    this one (only comments or layout differ)."""
    import yaml

    try:
        then = subprocess.run(["git", "show", f"{rec['git_commit']}:{rec['params_file']}"], capture_output=True,
                              check=True).stdout
    except (subprocess.CalledProcessError, OSError):
        return False
    if hashlib.sha256(then).hexdigest() != rec["params_sha256"]:
        return False
    same = yaml.safe_load(then) == yaml.safe_load(Path(study.path).read_text())
    if same:
        print(f"note: {study.path} differs from the one the archives were made with ({rec['git_commit'][:7]}) "
              "in comments or layout only")
    return same


def _unpack(study: Study, paths: list[Path]) -> list[dict]:
    """Every archive checked first (this study, this params file), then the study's outputs here
    replaced by theirs; a part that came back twice (run again after a cut): its latest archive last."""
    sha, s = _sha256(Path(study.path)), study.name
    with tempfile.TemporaryDirectory(prefix=".parts.", dir=".") as tmp:
        records = []
        for i, path in enumerate(paths):
            rec, top = _read_archive(path, Path(tmp) / str(i))
            if rec["study"] != s:
                raise StageError(f"{path}: an archive of study {rec['study']!r}, not {s!r}")
            if rec["params_sha256"] != sha and not _same_settings(study, rec):
                raise StageError(f"{path}: made with another version of {rec['params_file']} than {study.path} here "
                                 f"(check out the commit the bundle was made from: {rec['git_commit']})")
            if rec["git_commit"] != git_commit() and git_commit() != "unknown":
                print(f"note: {path.name} ran commit {rec['git_commit']}; this checkout is {git_commit()} "
                      "(the report stages here build the report)")
            records.append(dict(rec, top=top, archive=path.name))
        for d in (f"data/{s}/runs", f"data/{s}/eval", f"data/{s}/filtered", f"data/{s}/bpe", f"reports/{s}",
                  f"logs/{s}"):
            shutil.rmtree(d, ignore_errors=True)
        records.sort(key=lambda r: (r["index"], r["ended_utc"] or ""))
        for rec in records:
            top = rec.pop("top")
            if (top / "files").is_dir():
                shutil.copytree(top / "files", ".", dirs_exist_ok=True)
            for sample in rec.get("samples", []):
                _restore_sample(study, sample, top / sample["file"])
            rec["versions"] = (top / "versions.txt").read_text() if (top / "versions.txt").is_file() else ""
            for name, dest in (("part.log", f"logs/{s}/node_{rec['part']}.log"),
                               ("gpu_util.csv", f"logs/{s}/gpu_util_{rec['part']}.csv")):
                if (top / name).is_file():
                    shutil.copy2(top / name, dest)
            print(f"{rec['archive']}: part {rec['part']}, {len(rec['runs'])} runs"
                  + (f", {len(rec['missing'])} not finished" if rec["missing"] else "")
                  + (f", {rec['wall_s']:.0f} s on {rec['gpu'] or rec['host']}" if rec.get("wall_s") else ""))
    return records


def _slots_used(layout: Layout, rec: dict) -> int | None:
    """Jobs that could run at once in the part: its jobs_per_gpu, or fewer when Snakemake had fewer
    cores (part.json's snakemake_cores, else Snakemake's own "Provided cores: N" in the part's log)."""
    cores = rec.get("snakemake_cores")
    log = Path(f"logs/{rec['study']}/node_{rec['part']}.log")
    if not cores and log.is_file():
        found = re.search(r"^Provided cores: (\d+)", log.read_text(errors="replace"), re.M)
        cores = found and int(found.group(1))
    return min(layout.jobs_per_gpu, int(cores)) if cores else None


def _why_missing(layout: Layout, records: list[dict], missing: list[Run]) -> tuple[list[dict], list[str]]:
    lost_parts = [p.name for p in layout.parts if p.name not in {r["part"] for r in records}]
    why = {}
    for rec in records:
        for m in rec["missing"]:
            why[(m["task"], m["cell"], m["seed"])] = f"part {rec['part']}: {m['reason']} when it stopped"
    for p in layout.parts:
        if p.name in lost_parts:
            for r in p.runs:
                why.setdefault(r, f"part {p.name} did not come back")
    return [{"task": t, "cell": c, "seed": sd, "reason": why.get((t, c, sd), "not in any archive")}
            for t, c, sd in missing], lost_parts


def build(study: Study, inputs: list[str], reference: str | None = None) -> int:
    layout = load_layout(study)
    paths = _archives(study, inputs)
    if not paths:
        raise StageError(f"no archive of study {study.name}'s parts ({study.name}-<n>-<part>.tar.gz) in "
                         f"{' '.join(inputs)}")
    records = _unpack(study, paths)
    s, n = study.name, len(study_runs(study))
    missing = [r for r in study_runs(study) if not run_complete(study, r)]
    if reference:
        Path(reference).mkdir(parents=True, exist_ok=True)
    if not missing:
        _report_stages(study.path)
        if reference:
            _write_reference_copy(study, layout, records, reference, missing=[])
        print(f"report: {output_path('report', 'pdf', study=s)} (all {n} runs, {len(records)} archives)")
        return 0
    rows, lost_parts = _why_missing(layout, records, missing)
    text = _missing_text(study, rows, lost_parts)
    print(text, file=sys.stderr)
    derived, kept, dropped = _partial_params(study, missing, rows)
    if derived is None:
        print("error: no task has its baseline cell complete: no report can be built", file=sys.stderr)
        return 1
    print(f"building the report of what came back: {kept}" + (f"; left out: {dropped}" if dropped else ""),
          file=sys.stderr)
    _report_stages(str(derived))
    atomic_write_text(Path(f"reports/{s}/missing_runs.txt"), text + "\n")
    if reference:
        _write_reference_copy(study, layout, records, reference, missing=rows)
    print(f"PARTIAL report: {output_path('report', 'pdf', study=s)} ({n - len(missing)} of {n} runs; "
          f"missing runs in reports/{s}/missing_runs.txt)", file=sys.stderr)
    return PARTIAL_EXIT


def _missing_text(study: Study, rows: list[dict], lost_parts: list[str]) -> str:
    n = len(study_runs(study))
    head = f"MISSING RUNS: {len(rows)} of the {n} runs of study {study.name} did not come back"
    if lost_parts:
        head += f" (no archive of part{'s' if len(lost_parts) > 1 else ''} {', '.join(lost_parts)})"
    by_reason: dict[str, list] = {}
    for r in rows:
        by_reason.setdefault(r["reason"], []).append(r)
    return "\n".join([head + ":"] + [f"  {reason}: {_runs_text(rs)}" for reason, rs in by_reason.items()])


def _restore_sample(study: Study, sample: dict, path: Path) -> None:
    """The attention figure's weights back as the checkpoint file the figures stage loads."""
    import torch

    blob = torch.load(io.BytesIO(gzip.decompress(path.read_bytes())), map_location="cpu", weights_only=True)
    ckpt = Path(output_path("train", "ckpt", study=study.name, task=sample["task"], cell=sample["cell"],
                            seed=sample["seed"]))
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / f".{sample['checkpoint']}.tmp"
    torch.save({"model": _decode_weights(blob["model"]), "meta": blob["meta"]}, tmp)
    os.replace(tmp, ckpt / sample["checkpoint"])


def _report_stages(params: str) -> None:
    """aggregate, figures, tables, claims, report: the stage commands of the stage table."""
    from ..study.config import load_study
    from ..study.stages import build_jobs

    study = load_study(params)
    order = ("aggregate", "figures", "tables", "claims", "report")
    jobs = sorted((j for j in build_jobs(study) if j.stage in order), key=lambda j: order.index(j.stage))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for job in jobs:
        cmd = [sys.executable, "-m", "pipeline_src", job.stage, "--params", params]
        print("+ " + " ".join(["python", *cmd[1:]]), flush=True)
        tick = time.perf_counter()
        proc = subprocess.run(cmd, env=env)
        if proc.returncode:
            raise StageError(f"the {job.stage} stage failed on the returned runs (exit status {proc.returncode}; "
                             "its message is above)")
        print(f"  {job.stage}: {time.perf_counter() - tick:.1f} s", flush=True)


def _partial_params(study: Study, missing: list[Run], rows: list[dict]):
    """A params file for the report of what came back: the cells whose every seed came back, of
    the tasks whose baseline cell did; claims and references that need anything else left out."""
    raw = yaml.safe_load(Path(study.path).read_text())
    gone = set(missing)
    kept_cells = {}
    for t, task in study.tasks.items():
        cells = [c for c in task.cells if not any((t, c, s) in gone for s in study.seeds)]
        if task.baseline_cell in cells:
            kept_cells[t] = cells
    if not kept_cells:
        return None, "", ""
    for t in study.tasks:
        entry = raw["tasks"][t]
        if t in kept_cells:
            entry["cells"] = kept_cells[t]
        else:
            entry["enabled"] = False

    def ok(task, *cells):
        return task in kept_cells and all(c is None or c in kept_cells[task] for c in cells)

    dropped_claims = [name for name, claim in (raw.get("claims") or {}).items()
                      if not all(ok(c["task"], c.get("cell"), c.get("versus")) for c in claim.get("compare", []))]
    for name in dropped_claims:
        del raw["claims"][name]
    if "claims" in raw and not raw["claims"]:
        del raw["claims"]
    refs = raw.get("references") or []
    kept_refs = [r for r in refs if ok(r["task"], r.get("cell"), r.get("versus"))]
    if "references" in raw:
        raw["references"] = kept_refs
        if not kept_refs:
            del raw["references"]
    report = raw.setdefault("report", {}) or {}
    raw["report"] = report
    if report.get("attention_sample_task") and report["attention_sample_task"] not in kept_cells:
        del report["attention_sample_task"]
    n, got = len(study_runs(study)), len(study_runs(study)) - len(missing)
    report["title"] = f"{report.get('title') or f'Transformer ablations: study {study.name}'} (PARTIAL: {got} of {n} runs)"
    note = (f"PARTIAL REPORT: {len(missing)} of the study's {n} runs did not come back from the GPU node "
            f"({_runs_text(rows)}). This report covers "
            + "; ".join(f"{t}: {', '.join(cs)}" for t, cs in kept_cells.items())
            + (f". Claims not judged (they need a missing run): {', '.join(dropped_claims)}" if dropped_claims else "")
            + ".")
    raw["description"] = note + " " + " ".join(str(raw.get("description") or "").split())
    path = Path(f"data/{study.name}/partial_params.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "# Made by `python -m pipeline_src parts build` from " + study.path
                      + ": the report of the runs that came back.\n" + yaml.safe_dump(raw, sort_keys=False))
    kept = "; ".join(f"{t} ({len(cs)} of {len(study.tasks[t].cells)} cells)" for t, cs in kept_cells.items())
    dropped = ", ".join([f"task {t}" for t in study.tasks if t not in kept_cells]
                        + ([f"claims {', '.join(dropped_claims)}"] if dropped_claims else []))
    return path, kept, dropped


# --- the reference copy (reports/reference/<gpu>/) ---------------------------------------------------


def _write_reference_copy(study: Study, layout: Layout, records: list[dict], out: str, missing: list[dict]) -> None:
    """The report's products, each part's time beside its prediction, versions and utilisation."""
    import pandas as pd

    out_dir, s = Path(out), study.name
    for name in ("report.pdf", "report.tex", "results.csv", "summary.csv", "significance.csv", "claims.csv",
                 "references.csv"):
        if Path(f"reports/{s}/{name}").is_file():
            shutil.copy2(f"reports/{s}/{name}", out_dir / name)
    if Path(f"reports/{s}/tables/cost.tex").is_file():
        shutil.copy2(f"reports/{s}/tables/cost.tex", out_dir / "cost_table.tex")
    results = pd.read_csv(f"reports/{s}/results.csv")
    cols = ["task", "cell", "seed", "steps", "train_tokens", "wall_s", "tokens_per_s", "mfu", "peak_mem_mb",
            "device_name", "precision"]
    results[[c for c in cols if c in results]].to_csv(out_dir / "cost.csv", index=False, float_format="%.6g")
    try:
        from ..study.estimate import predict_parts

        predicted = predict_parts(study, layout)
    except Exception as e:  # noqa: BLE001
        predicted = {"parts": {}, "study_s": None, "basis": f"no prediction ({type(e).__name__}: {e})"}
    parts = []
    for p in layout.parts:
        rec = next((r for r in reversed(records) if r["part"] == p.name), None)
        # the prediction the node printed when the part ran, where the archive has it (this build's
        # own prediction may already rest on the part's measured runs)
        ahead = rec and rec.get("predicted_s")
        parts.append({"part": p.name, "runs": len(p.runs),
                      "predicted_s": ahead if ahead is not None else predicted["parts"].get(p.name),
                      "measured_s": rec and rec.get("wall_s"), "limit_s": layout.limit_s,
                      "finished_runs": rec and len(rec["runs"]), "snakemake_status": rec and rec.get("snakemake_status"),
                      "job_slots_used": rec and _slots_used(layout, rec),
                      "gpu": rec and rec.get("gpu"), "started_utc": rec and rec.get("started_utc"),
                      "samples": rec and rec.get("samples")})
    measured = [p["measured_s"] for p in parts if p["measured_s"] is not None]
    node_predicted = all(r.get("predicted_s") is not None for r in records) and len(records) == len(parts)
    timing = {"study": s, "jobs_per_gpu": layout.jobs_per_gpu, "parts": parts,
              "predicted_study_s": (round(sum(p["predicted_s"] for p in parts), 1) if node_predicted
                                    else predicted.get("study_s")),
              "prediction_basis": ("each part's prediction as the node printed it when the part ran (part.json)"
                                   if node_predicted else predicted.get("basis")),
              "prediction_now": {"parts": predicted["parts"], "study_s": predicted.get("study_s"),
                                 "basis": predicted.get("basis")},
              "measured_study_s": round(sum(measured), 1) if len(measured) == len(parts) else None,
              "missing_runs": missing}
    atomic_write_json(out_dir / "timing.json", timing)
    pd.DataFrame([{k: v for k, v in p.items() if k != "samples"} for p in parts]).to_csv(out_dir / "parts.csv", index=False)
    atomic_write_text(out_dir / "versions.txt", "".join(
        f"== part {rec['part']} (host {rec['host']}, {rec['started_utc']} - {rec['ended_utc']})\n{rec['versions']}\n"
        for rec in records))
    util = [Path(f"logs/{s}/gpu_util_{rec['part']}.csv") for rec in records]
    if any(u.is_file() for u in util):  # every part's samples, for the throughput summary's utilisation
        atomic_write_text(Path(f"logs/{s}/gpu_util.csv"), "".join(u.read_text() for u in util if u.is_file()))
        shutil.copy2(f"logs/{s}/gpu_util.csv", out_dir / "gpu_util.csv")
    script = Path(__file__).resolve().parents[2] / "bench" / "study_throughput.py"
    if script.is_file():  # per-run and aggregate tok/s and MFU over each task's training window
        proc = subprocess.run([sys.executable, str(script), "--study", s, "--out", str(out_dir), "--name", "throughput",
                               "--state", "failed" if missing else "finished", "--source", "the parts' archives"],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"note: bench/study_throughput.py failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
    atomic_write_text(out_dir / "command.txt",
                      f"bash bundle/node.sh parts {study.path} ARCHIVES_DIR   # on the GPU node, from `make bundle`\n"
                      f"python -m pipeline_src parts build ARCHIVES_DIR --params {study.path} --reference {out}\n")
    if missing:
        shutil.copy2(f"reports/{s}/missing_runs.txt", out_dir / "missing_runs.txt")
    else:
        (out_dir / "missing_runs.txt").unlink(missing_ok=True)  # an earlier, partial build's


# --- prediction and targets --------------------------------------------------------------------------


def targets(study: Study, part_name: str) -> list[str]:
    """The files that make Snakemake train and evaluate the part's runs (and their data)."""
    part = load_layout(study).part(part_name)
    return [str(run_files(study, r)["evaluate.info"]) for r in part.runs]


def predict(study: Study) -> str:
    """The parts of the study, their runs and predicted minutes (`parts predict`)."""
    from ..study.estimate import predict_parts

    layout = load_layout(study)
    lines = [f"study {study.name}: {len(study_runs(study))} runs in {len(layout.parts)} parts"
             + (f" ({layout.path})" if layout.path else " (one per task: no parts.yaml for this study)")
             + f"; each part stops at {layout.limit_s:g} s and packs at most {layout.archive_mib:g} MiB"]
    predicted = predict_parts(study, layout)
    for i, p in enumerate(layout.parts, 1):
        sec = predicted["parts"].get(p.name)
        lines.append(f"  {i}. {p.name}{' (extension: only if time is left)' if p.extension else ''}: "
                     f"{len(p.runs)} runs of {', '.join(p.tasks)}"
                     + (f", predicted {sec / 60:.1f} min" if sec else "") + f" -> {archive_name(study, layout, p.name)}")
    lines.append(predicted["text"])
    return "\n".join(lines)


def run(study: Study, action: str, part: str | None, out: str | None, inputs: list[str], reference: str | None,
        started: str | None, status: int | None, log: str | None, gpu_util: str | None,
        cores: int | None = None) -> int:
    if action == "plan":  # the action's former name
        print("note: `parts plan` is now `parts predict`", file=sys.stderr)
        action = "predict"
    if action == "predict":
        print(predict(study))
        return 0
    if action in ("targets", "pack") and not part:
        raise ConfigError(f"parts {action}: --part NAME is needed")
    if action == "layout":  # for workflow/node/node.sh: shell assignments
        layout = load_layout(study)
        print(f"jobs_per_gpu={layout.jobs_per_gpu} limit_s={int(layout.limit_s)} device={study.device} "
              f"parts='{' '.join(p.name for p in layout.parts)}'")
        return 0
    if action == "targets":
        print("\n".join(targets(study, part)))
        return 0
    if action == "pack":
        if not out:
            raise ConfigError("parts pack: --out DIR is needed (the folder the archives go to)")
        pack(study, part, out, started=started, status=status, log=log, gpu_util=gpu_util, cores=cores)
        return 0
    if action == "build":
        if not inputs:
            raise ConfigError("parts build: name the archives, or the folder that holds them")
        return build(study, inputs, reference)
    raise ConfigError(f"parts: unknown action {action!r} (predict, layout, targets, pack, build)")
