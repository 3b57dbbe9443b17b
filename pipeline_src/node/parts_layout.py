"""The parts of a study that runs in short GPU job slots: `parts.yaml` beside the params file.
(pipeline_src/node/parts.py runs, packs and builds them; study/estimate.py predicts their minutes.)"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..common import ConfigError
from ..study.config import NAME_RE, Study

MAX_PARTS = 8
Run = tuple  # (task, cell, seed)


@dataclass(frozen=True)
class Part:
    name: str
    tasks: tuple[str, ...]
    runs: tuple[Run, ...]
    # An extension part runs after the core parts, only if the slot still has time: the study's
    # time target (study_limit_s) is for the core parts; runs of an extension part that did not
    # come back are reported as missing, as any other.
    extension: bool = False


@dataclass(frozen=True)
class Layout:
    parts: tuple[Part, ...]
    gpu: str | None = None
    jobs_per_gpu: int = 1
    limit_s: float = 300.0
    study_limit_s: float | None = None
    archive_mib: float = 16.0
    path: str | None = None  # the parts file, if the study has one

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise ConfigError(f"{self.path or 'parts'}: no part {name!r} (parts: {', '.join(p.name for p in self.parts)})")

    def index(self, name: str) -> int:
        return [p.name for p in self.parts].index(name) + 1


def study_runs(study: Study) -> list[Run]:
    """Every run the study's report reads, in the order of the params file."""
    return [(t, c, s) for t, task in study.tasks.items() for c in task.cells for s in study.seeds]


def layout_path(study: Study) -> Path:
    return Path(study.path).parent / "parts.yaml"


def load_layout(study: Study) -> Layout:
    """The study's parts (parts.yaml beside the params file, if it names this study), else one
    part per task."""
    if study.screens:
        raise ConfigError(f"{study.path}: a study with screening stages cannot run in parts (its stage two "
                          "depends on stage one's results)")
    path = layout_path(study)
    raw = yaml.safe_load(path.read_text()) if path.is_file() else None
    if not isinstance(raw, dict) or raw.get("study") != study.name:
        return Layout(parts=tuple(Part(t, (t,), tuple(r for r in study_runs(study) if r[0] == t)) for t in study.tasks))
    where = str(path)
    known = {"study", "gpu", "jobs_per_gpu", "limit_s", "study_limit_s", "archive_mib", "parts"}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    specs = raw.get("parts") or []
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"{where}: parts: a list of parts ({{name, tasks, cells?, seeds?, extension?}}) is needed")
    if len(specs) > MAX_PARTS:
        raise ConfigError(f"{where}: parts: {len(specs)} parts; at most {MAX_PARTS} (one archive each)")
    left, parts = study_runs(study), []
    for i, spec in enumerate(specs):
        key = f"parts[{i}]"
        if not isinstance(spec, dict) or not NAME_RE.match(str(spec.get("name", ""))):
            raise ConfigError(f"{where}: {key}.name: a name of a-z, 0-9, _ and - is needed")
        extra = set(spec) - {"name", "tasks", "cells", "seeds", "extension"}
        if extra:
            raise ConfigError(f"{where}: {key}: unknown key {sorted(extra)[0]!r} (name, tasks, cells, seeds, extension)")
        extension = spec.get("extension", False)
        if not isinstance(extension, bool):
            raise ConfigError(f"{where}: {key}.extension: true or false, not {extension!r}")
        if parts and parts[-1].extension and not extension:
            raise ConfigError(f"{where}: {key} ({spec['name']}): a core part after an extension part; "
                              "extension parts come last (they run only if the slot has time left)")
        tasks = spec.get("tasks") or list(study.tasks)
        for t in tasks:
            if t not in study.tasks:
                raise ConfigError(f"{where}: {key}.tasks: {t!r} is not an enabled task of study {study.name}")
        cells, seeds = spec.get("cells"), spec.get("seeds")
        for c in cells or []:
            if not any(c in study.tasks[t].cells for t in tasks):
                raise ConfigError(f"{where}: {key}.cells: {c!r} is not a cell of {', '.join(tasks)}")
        for s in seeds or []:
            if s not in study.seeds:
                raise ConfigError(f"{where}: {key}.seeds: {s!r} is not one of the study's seeds {list(study.seeds)}")
        mine = tuple(r for r in left if r[0] in tasks and (cells is None or r[1] in cells)
                     and (seeds is None or r[2] in seeds))
        if not mine:
            raise ConfigError(f"{where}: {key} ({spec['name']}): no run left for it (an earlier part has them all)")
        left = [r for r in left if r not in mine]
        parts.append(Part(spec["name"], tuple(dict.fromkeys(r[0] for r in mine)), mine, extension))
    if len({p.name for p in parts}) < len(parts):
        raise ConfigError(f"{where}: parts: two parts have the same name")
    if left:
        shown = ", ".join(f"{t}/{c}/seed{s}" for t, c, s in left[:4]) + (" ..." if len(left) > 4 else "")
        raise ConfigError(f"{where}: parts: {len(left)} runs are in no part ({shown})")

    def number(k, default, cast=float):
        v = raw.get(k, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{where}: {k}: a positive number is needed, not {v!r}")
        return cast(v)

    return Layout(parts=tuple(parts), gpu=raw.get("gpu"), jobs_per_gpu=number("jobs_per_gpu", 1, int),
                  limit_s=number("limit_s", 300.0), study_limit_s=number("study_limit_s", None),
                  archive_mib=number("archive_mib", 16.0), path=where)


def archive_name(study: Study, layout: Layout, part: str) -> str:
    return f"{study.name}-{layout.index(part)}-{part}.tar.gz"
