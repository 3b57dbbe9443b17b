"""Small helpers every stage shares: one-line errors, atomic writes, provenance, seeding."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


class StageError(RuntimeError):
    """A stage could not do its work (bad data, missing corpus...). str(err) is one line."""


class ConfigError(ValueError):
    """A bad params file. str(err) is a single line naming the key."""


# ---------------------------------------------------------------------------------------------
# Faults of the machine, said in the user's words: which file, what is wrong, how to get back.


def no_space_error(path: str | Path, needed_bytes: int | None = None) -> StageError:
    """Disk full while writing `path` (the write was abandoned: nothing is marked complete)."""
    where = Path(path).resolve().parent
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    needed = f", about {human_size(needed_bytes)} needed" if needed_bytes else ""
    return StageError(f"no space left on the device writing {_shown(path)}: {human_size(free)} free there{needed}; "
                      f"free some space and run the same command (nothing was marked complete)")


def unreadable_error(path: str | Path, err: BaseException) -> StageError:
    """A file a stage reads is truncated or corrupted: name it and the way to restore it."""
    path = Path(path)
    detail = " ".join(str(err).split())[:120]
    output = _shown(path.parent)  # every stage output that holds files is a directory of them
    if "scratch" in path.parts:  # a run's resumable state: not tracked, made again by training
        fix = f"delete {output} and run the same command (the run starts again from its first step)"
    else:
        fix = (f"restore it with `dvc checkout {output}` (or `dvc pull {output}` from a remote), or delete "
               f"{output} and run the same command, which makes it again")
    return StageError(f"{_shown(path)}: unreadable, truncated or corrupted ({type(err).__name__}: {detail}); {fix}")


@contextlib.contextmanager
def reading(path: str | Path):
    """Around the read of one file: any failure of the reader becomes unreadable_error(path)."""
    try:
        yield
    except (StageError, MemoryError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - readers raise anything on a torn file
        raise unreadable_error(path, e) from e


def is_out_of_memory(err: BaseException) -> bool:
    """CPU or GPU allocation failure (torch raises a plain RuntimeError on the CPU)."""
    return isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def _shown(path: str | Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def human_size(n: float) -> str:
    """Bytes for a reader: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _tmp_sibling(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs should read like any other file
    return Path(tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write via a temporary file + rename, so a crash never leaves a half-written file."""
    path = Path(path)
    tmp = _tmp_sibling(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise no_space_error(path, len(data)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


@contextlib.contextmanager
def atomic_dir(path: str | Path):
    """Build a directory under a temporary name and move it into place only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_PACKAGES = ("torch", "numpy", "sentencepiece", "sacrebleu", "rouge-score", "datasets", "pandas", "matplotlib",
             "snakemake", "dvc", "pyarrow")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def git_commit() -> str:
    """HEAD of the checkout the code runs from; PIPELINE_GIT_COMMIT where the copy has no .git
    (bench/node/node.sh sets it from the bundle it unpacked)."""
    if os.environ.get("PIPELINE_GIT_COMMIT"):
        return os.environ["PIPELINE_GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(study, **extra) -> dict:
    """What every output carries about how it was made. Deliberately no timestamps or host
    names, so that re-running the same commit with the same params gives identical bytes."""
    return {"params_file": study.path, "study": study.name, "git_commit": git_commit(),
            "command": " ".join(["python -m pipeline_src"] + sys.argv[1:]), "versions": package_versions(), **extra}


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def progress(iterable=None, **kw):
    """tqdm progress bar on stderr; quiet when PIPELINE_QUIET=1 (tests)."""
    from tqdm.auto import tqdm

    kw.setdefault("disable", os.environ.get("PIPELINE_QUIET") == "1")
    kw.setdefault("dynamic_ncols", True)
    kw.setdefault("mininterval", 1.0)
    return tqdm(iterable, **kw)
