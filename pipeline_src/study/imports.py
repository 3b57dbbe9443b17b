"""The package's own import graph, read from the source: which code a stage runs.

A stage's code dependencies are the import closure of its entry module inside `pipeline_src`
(every `import`/`from ... import` statement, at the top of a module or inside a function, since
a function-local import runs as surely as a top-level one), plus the `__init__.py` of every
package on the way (Python runs them first). The stage table lists that closure as the stage's
dependencies, so that editing any module a stage runs makes both drivers rerun it: DVC hashes
the files, Snakemake compares their modification times. Nothing is listed by hand.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
from pathlib import Path

PACKAGE = "pipeline_src"
ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=1)
def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package."""
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imported(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, bool]]:
    """(module, at top level?) for every package module that `name` imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found += [(c, id(node) in top) for c in candidates if c in mods and c != name]
    return found


# Parsing the package takes ~0.3 s, and every stage DVC runs builds the stage table first (its
# staleness check): each module's imports are kept beside its bytecode until the file changes.
CACHE = ROOT / PACKAGE / "__pycache__" / "import_graph.json"


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the package modules it imports (anywhere in it)."""
    mods = modules()
    try:
        cache = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if cache.get("modules") != sorted(mods):  # a module added or removed changes what counts
        cache = {"modules": sorted(mods), "files": {}}
    files, changed = cache["files"], False
    for name, path in mods.items():
        st = path.stat()
        # The file's path is part of its stamp: a module name can move between `x.py` and
        # `x/__init__.py` (which also changes what its relative imports mean).
        stamp = [path.relative_to(ROOT).as_posix(), st.st_mtime_ns, st.st_size]
        if files.get(name, {}).get("stamp") != stamp:
            files[name] = {"stamp": stamp, "imports": sorted({m for m, _ in imported(name, path, mods)})}
            changed = True
    if changed:
        with contextlib.suppress(OSError):  # a read-only install parses every time
            CACHE.parent.mkdir(exist_ok=True)
            tmp = CACHE.with_name(f"{CACHE.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, CACHE)
    return {name: frozenset(files[name]["imports"]) for name in mods}


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def closure(*entries: str) -> set[str]:
    """Every package module that running `entries` can import, with the packages above each."""
    graph, seen = import_graph(), set()
    todo = [p for e in entries for p in _with_parents(e)]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        todo += [p for m in graph[name] for p in _with_parents(m)]
    return seen


def closure_files(*entries: str) -> list[str]:
    """closure() as repository-relative file paths, sorted."""
    mods = modules()
    return sorted(mods[m].relative_to(ROOT).as_posix() for m in closure(*entries))
