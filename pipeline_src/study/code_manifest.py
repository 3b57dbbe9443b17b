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

from ..common import atomic_write_json
from ..data import sha256_file
from .config import Study
from .paths import code_manifest_path


def run(study: Study, kind: str) -> None:
    from .stages import CODE, ROOT  # the stage table: a driver module, not this job's code

    if kind not in CODE:
        raise ValueError(f"--kind {kind!r} is not a stage kind ({', '.join(CODE)})")
    files = {f: sha256_file(ROOT / f) for f in sorted(CODE[kind])}
    atomic_write_json(code_manifest_path(study, kind), {"kind": kind, "files": files})
