"""The scripts that carry the GPU work to a lent machine and back (bench/device.sh, from_device.sh).
A lent GPU is rare: a script that fails there wastes it, so what can be checked without one is."""
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["bench/device.sh", "bench/from_device.sh", "bench/gpu_session.sh", "bench/gpu_carry.sh",
           "workflow/studies/gpu/run.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_device_refuses_an_unknown_job_before_installing_anything(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device.sh"), "everything"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: bash bench/device.sh a|b|c|study")
    assert list(tmp_path.iterdir()) == []


def _tarball(path: Path, files: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.parent / (path.name + ".src")
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src, arcname=".")
    return path


def _from_device(tmp_path, *tarballs):
    env = {"PATH": "/usr/bin:/bin", "RESULTS_DIR": str(tmp_path / "results"), "REFERENCE_DIR": str(tmp_path / "ref")}
    return subprocess.run(["bash", str(ROOT / "bench" / "from_device.sh"), *map(str, tarballs)], capture_output=True,
                          text=True, env=env)


def test_from_device_puts_a_bench_part_in_the_results_and_shows_its_failures(tmp_path):
    part = _tarball(tmp_path / "bench_a.tar.gz", {
        "real_cell_eager_static.md": "| figure | value |\n", "real_cell_eager_static.json": "{}\n",
        "session_a.log": "SKIPPED [2] tests/test_model_gpu.py:97: needs a CUDA GPU\n+ python bench/bench_decode.py\n"
                         "!! FAILED rc=124 (out of time): python bench/bench_decode.py\n"})
    proc = _from_device(tmp_path, part)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "real_cell_eager_static.json", "real_cell_eager_static.md", "session_a.log"]
    assert "!! FAILED rc=124 (out of time)" in proc.stdout and "needs a CUDA GPU" not in proc.stdout


def test_from_device_refuses_a_study_that_is_still_running_or_failed(tmp_path):
    running = _tarball(tmp_path / "running" / "study.tar.gz", {"run.log": "18 of 25 steps (72%) done\n"})
    proc = _from_device(tmp_path, running)
    assert proc.returncode == 1
    assert "still running (no run.rc): call the device again" in proc.stdout
    failed = _tarball(tmp_path / "failed" / "study.tar.gz", {"run.log": "error: train failed\n", "run.rc": "1\n"})
    proc = _from_device(tmp_path, failed)
    assert proc.returncode == 1
    assert "the study failed on the device" in proc.stdout and "error: train failed" in proc.stdout
    assert not (tmp_path / "ref").exists()
