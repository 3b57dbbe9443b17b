"""Small helpers every stage shares: one-line errors, atomic writes, provenance, seeding."""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path


class StageError(RuntimeError):
    """A stage could not do its work (bad data, missing corpus...). str(err) is one line."""


class ConfigError(ValueError):
    """A bad params file. str(err) is a single line naming the key."""


# ---------------------------------------------------------------------------------------------
# Faults of the machine, said in the user's words: which file, what is wrong, how to get back.


_FULL = (errno.ENOSPC, errno.EDQUOT)  # a quota that is used up is a full disk to the user
_WRITE_FAULTS = _FULL + (errno.EROFS,)


def no_space_error(path: str | Path, needed_bytes: int | None = None, *, temporary: str | Path | None = None,
                   replacing: bool = False, written: tuple[Path, int] | None = None) -> StageError:
    """Disk full while writing `path` (the write was abandoned: nothing is marked complete).
    `temporary`: the temporary file `path` is written through could not even be created;
    `replacing`: the new file was written beside an old `path`, which stays until it is complete;
    `written`: (directory, bytes) of a directory built in place before the disk filled."""
    where = _existing_dir(path)
    st = os.statvfs(where)
    free, mount = human_size(st.f_bavail * st.f_frsize), _mount_point(where)
    if st.f_files and not st.f_favail:  # bytes left but no inode: only deleting files helps
        room, fix = f"no file entries (inodes) left on the file system at {mount} ({free} free)", \
            "delete some files there"
    else:
        room, fix = f"{free} free on the file system at {mount}", "free some space there"
    if temporary is not None:
        return StageError(f"no space left on the device to create {_shown(temporary)}, the temporary file "
                          f"{_shown(path)} is written through: {room}; {fix} and run the same command "
                          f"(nothing was marked complete)")
    needed, before = "", ""
    if needed_bytes:
        needed = f", about {human_size(needed_bytes)} needed"
        old = Path(path)
        if replacing and old.is_file():
            needed += f" (the old {old.name}, {human_size(old.stat().st_size)}, is kept until the new one is complete)"
    shown = _shown(path)
    if written and written[1]:
        whole = Path(written[0]) == Path(path)
        shown += "/" if whole else ""
        before = (f" ({human_size(written[1])}{'' if whole else ' of ' + _shown(written[0]) + '/'} written before "
                  f"the disk filled, removed again)")
    return StageError(f"no space left on the device writing {shown}{before}: {room}{needed}; {fix} and run the same "
                      f"command (nothing was marked complete)")


def read_only_error(path: str | Path) -> StageError:
    mount = _mount_point(_existing_dir(path))
    return StageError(f"read-only file system: cannot write {_shown(path)} (the file system at {mount} is mounted "
                      f"read-only); make it writable (e.g. `mount -o remount,rw {mount}`) and run the same command "
                      f"(nothing was marked complete)")


def write_error(path: str | Path, err: BaseException, needed=None, *, temporary: str | Path | None = None,
                replacing: bool = False, written: tuple[Path, int] | None = None) -> StageError | None:
    """The one-line error for a write of `path` that its file system refused (full, out of quota
    or inodes, read-only), or None when `err` is another failure. `needed` is a size in bytes or
    a function giving it, called only when the disk is full.

    Some writers lose the errno: torch's checkpoint writer reports a failed write as a
    RuntimeError ("PytorchStreamWriter failed writing file", "[enforce fail at
    inline_container.cc] unexpected pos"), with the file object's OSError, if there was one, only
    as its context; numpy's array writer as an OSError without errno ("5927 requested and 992
    written"). For those the file system is asked whether it is read-only or short of room."""
    fault, size = _fault_errno(err), None
    if fault is None and _is_short_write(err):
        try:
            st = os.statvfs(_existing_dir(path))
        except OSError:
            return None
        if st.f_flag & os.ST_RDONLY:
            fault = errno.EROFS
        else:
            size = _size(needed)
            if st.f_bavail * st.f_frsize < (size or 0) + 65536:  # 64 KiB: room for the records' alignment
                fault = errno.ENOSPC
    if fault is None:
        return None
    if fault == errno.EROFS:
        return read_only_error(path)
    return no_space_error(path, size if size is not None else _size(needed), temporary=temporary,
                          replacing=replacing, written=written)


def _size(needed) -> int | None:
    try:
        return needed() if callable(needed) else needed
    except Exception:  # noqa: BLE001 - the size is a courtesy; the error must still be said
        return None


def _fault_errno(err: BaseException | None) -> int | None:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _WRITE_FAULTS:
            return errno.ENOSPC if err.errno in _FULL else err.errno
        err = err.__cause__ or err.__context__
    return None


def _is_short_write(err: BaseException) -> bool:
    text = str(err)
    if isinstance(err, OSError):
        return err.errno is None and " requested and " in text and text.endswith(" written")
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("PytorchStreamWriter", "inline_container", "iostream error"))


@contextlib.contextmanager
def writing(path: str | Path, needed=None):
    """Around the write of one file: a full or read-only file system becomes one line naming it."""
    try:
        yield
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - writers (torch above all) wrap a failed write in anything
        line = write_error(path, e, needed)
        if line is None:
            raise
        raise line from e


@contextlib.contextmanager
def atomic_file(path: str | Path, needed=None):
    """A binary file to write `path` through: `.<name>.tmp` beside it, renamed over `path` when
    the block ends without an error and removed when it does not, so that a kill or a full disk
    never leaves a torn file under the real name. A full or read-only file system is one line
    naming `path` (`needed`: bytes, or a function giving them, for the message)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "wb")  # a fixed name: a temporary file left by a killed run is reused, not piled up
        created = True
        try:
            with f:
                yield f
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # before the free space is measured for the message
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - see writing()
        line = write_error(path, e, needed, temporary=None if created else tmp, replacing=True)
        if line is None:
            raise
        raise line from e


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
    """A path as the user knows it: relative, and under the final name of a directory that
    atomic_dir is still building under a temporary one."""
    path = Path(path)
    for tmp, final in _BUILDING.items():
        if path.absolute().is_relative_to(tmp):
            path = final / path.absolute().relative_to(tmp)
            break
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _existing_dir(path: str | Path) -> Path:
    where = Path(path).absolute().parent
    while not where.exists() and where != where.parent:
        where = where.parent
    return where


def _mount_point(path: str | Path) -> str:
    where = os.path.realpath(path)
    while not os.path.ismount(where):
        where = os.path.dirname(where)
    return where


def human_size(n: float) -> str:
    """Bytes for a reader: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write via a temporary file + rename, so a crash never leaves a half-written file."""
    with atomic_file(path, len(data)) as f:
        f.write(data)


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


_BUILDING: dict[Path, Path] = {}  # atomic_dir's temporary directories -> their final names


@contextlib.contextmanager
def atomic_dir(path: str | Path):
    """Build a directory under a temporary name and move it into place only on success. A full
    or read-only file system while it is built is one line naming the file (or the directory)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        line = write_error(path, e, temporary=path.parent / f".{path.name}.tmp")
        if line is None:
            raise
        raise line from e
    os.chmod(tmp, 0o755)
    _BUILDING[tmp.absolute()] = path.absolute()
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - any writer of the directory's files (numpy, pandas, matplotlib...)
        name = getattr(_os_error_of(e), "filename", None)
        inside = isinstance(name, str) and Path(name).absolute().is_relative_to(tmp.absolute())
        target = path / Path(name).absolute().relative_to(tmp.absolute()) if inside else path
        written = _tree_size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        line = write_error(target, e, written=(path, written))
        if line is None:
            raise
        raise line from e
    finally:
        _BUILDING.pop(tmp.absolute(), None)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _os_error_of(err: BaseException | None) -> OSError | None:
    while err is not None and not isinstance(err, OSError):
        err = err.__cause__ or err.__context__
    return err


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def save_array(path: str | Path, array) -> None:
    """np.save through atomic_file: a full disk names the array's file and its size."""
    import numpy as np

    with atomic_file(path, array.nbytes + 128) as f:  # 128: the .npy header
        np.save(f, array)


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


def utc_stamp(unix_s: float | None = None, timespec: str = "seconds", zulu: bool = False) -> str:
    """An ISO 8601 UTC time ("...+00:00"), of `unix_s` or now, to `timespec` precision; with
    zulu=True it ends in "Z" instead, as `date -u +%FT%TZ` writes it."""
    when = time.time() if unix_s is None else unix_s
    stamp = datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(timespec=timespec)
    return stamp.replace("+00:00", "Z") if zulu else stamp


def git_commit() -> str:
    """HEAD of the checkout the code runs from; PIPELINE_GIT_COMMIT where the copy has no .git
    (workflow/node/node.sh sets it from the bundle it unpacked)."""
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
