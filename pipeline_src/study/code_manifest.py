"""The code stage: one file per stage kind that records the hashes of the code files its jobs run.

Every job of a stage kind (all the training runs, say) depends on that kind's code files: the
import closure of its module plus the non-Python files it reads (stages.CODE). Listed on each
job, they were nine entries in ten of a study's dependencies: DVC rewrites its whole dvc.lock
after every stage, and each entry was in it once per job; `dvc exp show` loaded them all. So
one job per kind depends on the files and writes their hashes here, and the kind's jobs depend
on this one file instead. Editing a module still reruns exactly the jobs that run it, under
both drivers: the manifest of each kind that imports the module is re-made with another hash
in it, and the jobs of those kinds rerun; the other kinds' manifests are not touched.

    data/<study>/code/<kind>.json   {"kind": "train", "files": {"pipeline_src/model/layers.py": "<sha256>", ...}}
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..common import atomic_write_json
from .config import Study
from .paths import code_manifest_path


def file_hashes(files: list[str], root: Path) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in sorted(files)}


def run(study: Study, kind: str) -> None:
    from .stages import CODE, ROOT  # the stage table: a driver module, not this job's code

    if kind not in CODE:
        raise ValueError(f"--kind {kind!r} is not a stage kind ({', '.join(CODE)})")
    atomic_write_json(code_manifest_path(study, kind), {"kind": kind, "files": file_hashes(CODE[kind], ROOT)})
