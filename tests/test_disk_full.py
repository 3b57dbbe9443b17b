"""A disk that fills up, or is read-only, under a training run, on a real file system: a small
tmpfs mounted over the run's scratch state, then over its outputs, and filled. The train stage
says it in one line (the file, the free space, what the write needed, what to do), leaves no
partial file and marks nothing complete; once space is back, the same command gives the metrics
and weights of a run that was never interrupted, byte for byte.

Mounting needs root (CI runs as root); elsewhere these tests are skipped and tests/test_faults.py
still proves the disk-full line through a link to /dev/full."""
import contextlib
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_src.train import state as train_state
from pipeline_src.common import StageError, human_size
from test_train import _clear, _env, _outputs, _prepare_data, _write_params

JOB = ["--task", "reorder", "--cell", "baseline", "--seed", "0"]
SCRATCH = "data/tiny/scratch/reorder/baseline/seed0"
RUN = "data/tiny/runs/reorder/baseline/seed0"


def _cannot_mount(probe: Path) -> str | None:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (CI runs the tests as root)"
    if not shutil.which("mount"):
        return "no `mount` command (util-linux) on this machine"
    probe.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return f"cannot mount a tmpfs here ({' '.join((proc.stderr or proc.stdout).split())[:200]})"
    subprocess.run(["umount", str(probe)], check=True)
    return None


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The tiny study's data, and the outputs of an uninterrupted run to compare with."""
    d = tmp_path_factory.mktemp("disk_full")
    reason = _cannot_mount(d / "probe")
    if reason:
        pytest.skip(reason)
    _prepare_data(d, _write_params(d, max_steps=20, eval_every=10, log_every=10))
    assert _train(d).returncode == 0
    metrics, ckpt, _ = _outputs(d)
    reference = {p: p.read_bytes() for p in (metrics, ckpt / "last.pt", ckpt / "best.pt")}
    _clear(d)
    return d, reference


@contextlib.contextmanager
def _tmpfs(where: Path, options: str = "size=1m"):
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _fill(where: Path, leave: int = 0) -> Path:
    """Write zeros into `where` until only `leave` bytes are free."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as f:
        while (room := os.statvfs(where).f_bavail * os.statvfs(where).f_frsize - leave) > 0:
            try:
                f.write(bytes(min(room, 1 << 16)))
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
    return filler


def _train(d):
    return subprocess.run([sys.executable, "-m", "pipeline_src", "train", "--params", "tiny.yaml", *JOB], cwd=d,
                          env=_env(), capture_output=True, text=True)


def _one_error_line(proc) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def _nothing_complete(d, mount: Path) -> None:
    metrics, ckpt, _ = _outputs(d)
    assert not metrics.exists() and not ckpt.exists()
    assert not [p for p in mount.rglob("*") if p.name.startswith(".")], "a partial (temporary) file was left"


def _same_as_uninterrupted(d, reference) -> None:
    proc = _train(d)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for path, data in reference.items():
        assert path.read_bytes() == data, f"{path} differs from the uninterrupted run's"


def test_a_full_disk_under_the_scratch_state(study):
    d, reference = study
    with _tmpfs(d / SCRATCH) as mount:
        filler = _fill(mount)
        line = _one_error_line(_train(d))
        assert line.startswith(f"error: no space left on the device writing {SCRATCH}/best.pt: 0 B free on the "
                               f"file system at {mount}, about ")
        assert line.endswith(" needed; free some space there and run the same command (nothing was marked complete)")
        _nothing_complete(d, mount)
        assert [p.name for p in mount.iterdir()] == ["filler"]
        filler.unlink()  # space is back
        _same_as_uninterrupted(d, reference)
    _clear(d)


def test_a_full_disk_under_the_run_outputs_while_the_checkpoint_is_written(study):
    """Room for the live log and the TensorBoard events, not for the checkpoint: torch's writer
    fails in the middle of last.pt."""
    d, reference = study
    last = next(p for p in reference if p.name == "last.pt")
    with _tmpfs(d / RUN) as mount:
        filler = _fill(mount, leave=24 << 10)
        line = _one_error_line(_train(d))
        assert line.startswith(f"error: no space left on the device writing {RUN}/ckpt/last.pt: ")
        assert f" free on the file system at {mount}, about {human_size(len(reference[last]))} needed; " in line
        _nothing_complete(d, mount)
        assert (mount / "train_log.tsv").read_text().endswith("\n")  # whole rows only
        filler.unlink()
        _same_as_uninterrupted(d, reference)  # resumes from the state saved at the last step
    _clear(d)


def test_a_full_disk_while_the_token_arrays_are_written(study):
    """Room for the tokenizer, not for the encoded splits (numpy's writer loses the errno)."""
    d, _ = study
    bpe = d / "data/tiny/bpe/reorder"
    tokenizer = next(bpe.rglob("spm.model")).stat().st_size + (16 << 10)
    with _tmpfs(bpe) as mount:
        _fill(mount, leave=tokenizer)
        proc = subprocess.run([sys.executable, "-m", "pipeline_src", "bpe", "--params", "tiny.yaml", "--task", "reorder"],
                              cwd=d, env=_env(), capture_output=True, text=True)
        line = _one_error_line(proc)
        shown = os.path.relpath(mount, d)
        assert line.startswith(f"error: no space left on the device writing {shown}/default/bpe60/")
        assert ".npy: " in line and f" free on the file system at {mount}, about " in line and " KiB needed; " in line
        assert [p.name for p in mount.rglob("*") if not p.is_dir()] == ["filler"]  # the half-built directory is gone


def test_no_room_for_the_temporary_file(study):
    """Bytes free but no inode: the temporary file a checkpoint is written through cannot be made."""
    d, _ = study
    with _tmpfs(d / SCRATCH, "size=1m,nr_inodes=16") as mount:
        n = 0
        with contextlib.suppress(OSError):
            while True:
                (mount / f"f{n}").touch()
                n += 1
        line = _one_error_line(_train(d))
        assert line == (f"error: no space left on the device to create {SCRATCH}/.best.pt.tmp, the temporary file "
                        f"{SCRATCH}/best.pt is written through: no file entries (inodes) left on the file system at "
                        f"{mount} ({human_size(os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize)} free); "
                        f"delete some files there and run the same command (nothing was marked complete)")
        _nothing_complete(d, mount)
    _clear(d)


def test_a_read_only_file_system_under_the_scratch_state(study):
    d, reference = study
    with _tmpfs(d / SCRATCH) as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        line = _one_error_line(_train(d))
        assert line == (f"error: read-only file system: cannot write {SCRATCH}/best.pt (the file system at {mount} "
                        f"is mounted read-only); make it writable (e.g. `mount -o remount,rw {mount}`) and run the "
                        f"same command (nothing was marked complete)")
        _nothing_complete(d, mount)
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        _same_as_uninterrupted(d, reference)
    _clear(d)


def test_a_read_only_file_system_under_the_run_outputs(study):
    d, _ = study
    with _tmpfs(d / RUN, "size=1m,ro") as mount:
        line = _one_error_line(_train(d))
        assert line.startswith(f"error: read-only file system: cannot write {RUN}/train_log.tsv (the file system at "
                               f"{mount} is mounted read-only); make it writable")
    _clear(d)


def test_snakemakes_directory_on_a_read_only_file_system(tmp_path):
    """The run lock the pipeline keeps in .snakemake/ is its first write of a Snakemake run."""
    reason = _cannot_mount(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    root = Path(__file__).resolve().parent.parent
    bin_dir = Path(sys.executable).parent
    with _tmpfs(tmp_path / ".snakemake", "size=64k,ro") as mount:
        proc = subprocess.run([bin_dir / "snakemake", "-s", root / "Snakefile", "--directory", tmp_path, "-n",
                               "--cores", "1", "--config", f"params={root / 'tests/fixtures/params/valid_tiny.yaml'}"],
                              cwd=tmp_path, capture_output=True, text=True,
                              env=dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}"))
        assert proc.returncode == 1
        assert proc.stderr.splitlines()[-1] == (
            f"error: read-only file system: cannot write .snakemake/pipeline-tiny.run (the file system at {mount} is "
            f"mounted read-only); make it writable (e.g. `mount -o remount,rw {mount}`) and run the same command "
            f"(nothing was marked complete)")


def test_torchs_own_error_for_a_short_write_is_the_disk_full_line(tmp_path):
    """torch's checkpoint writer turns the file's ENOSPC into a RuntimeError ("[enforce fail at
    inline_container.cc] unexpected pos"); the line is the same."""
    reason = _cannot_mount(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    import torch

    with _tmpfs(tmp_path / "full", "size=256k") as mount:
        _fill(mount, leave=64 << 10)
        obj = {"w": torch.zeros(100_000)}
        with pytest.raises(StageError) as err:
            train_state.save(mount / "big.pt", obj)
        assert isinstance(err.value.__cause__, RuntimeError) and "inline_container" in str(err.value.__cause__)
        needed = human_size(train_state.serialized_size(obj))
        assert f"writing {os.path.relpath(mount / 'big.pt')}: 64.0 KiB free on the file system at {mount}, " \
               f"about {needed} needed;" in str(err.value)
        assert sorted(p.name for p in mount.iterdir()) == ["filler"]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("tensorboard", ["1", "0"])
def test_the_live_log_keeps_whole_rows_when_the_disk_fills(tmp_path, monkeypatch, tensorboard):
    """Rows appended while training: the row that does not fit is cut off again, the line names
    the file (the TensorBoard events fill their page first), and TensorBoard's writer thread
    raises nothing of its own (the warning filter fails the test if it does)."""
    reason = _cannot_mount(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    from pipeline_src.train.live_log import LOG_COLUMNS, LiveLog

    monkeypatch.setenv("PIPELINE_TENSORBOARD", tensorboard)
    with _tmpfs(tmp_path / "run", "size=64k") as mount:
        live = LiveLog(mount / "train_log.tsv", [])
        _fill(mount)
        row = dict.fromkeys(LOG_COLUMNS, 1.5) | {"step": 0, "epoch": 0, "mem_mb": ""}
        sizes = {}
        with pytest.raises(StageError) as err:
            for step in range(1, 1000):
                sizes = {p: p.stat().st_size for p in mount.rglob("*") if p.is_file()}
                live.add(row | {"step": step})
        live.close()
        failed = next(p for p in sizes if str(err.value).startswith(
            f"no space left on the device writing {os.path.relpath(p)}: 0 B free on the file system at {mount}, about "))
        assert failed.name.startswith("events.out.tfevents." if tensorboard == "1" else "train_log.tsv")
        assert failed.stat().st_size == sizes[failed]  # the row that did not fit was cut off again
        assert (mount / "train_log.tsv").read_text().endswith("\n")


def test_a_directory_built_in_place_names_itself_and_what_it_held(tmp_path):
    """Writers that do not say which file failed (here Path.write_text, as pandas and matplotlib)."""
    reason = _cannot_mount(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    from pipeline_src.common import atomic_dir

    with _tmpfs(tmp_path / "out", "size=64k") as mount:
        _fill(mount, leave=8 << 10)
        with pytest.raises(StageError) as err:
            with atomic_dir(mount / "tables") as tmp:
                (tmp / "a.tex").write_text("x" * 3000)
                (tmp / "b.tex").write_text("y" * 20000)
        assert str(err.value).startswith(f"no space left on the device writing {os.path.relpath(mount)}/tables/ (")
        assert " written before the disk filled, removed again): 8.0 KiB free on the file system at " in str(err.value)
        assert [p.name for p in mount.iterdir()] == ["filler"]
