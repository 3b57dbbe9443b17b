"""The scripts that carry the GPU work to a lent machine and back (bench/device.sh, from_device.sh).
A lent GPU is rare: a script that fails there wastes it, so what can be checked without one is."""
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["bench/device.sh", "bench/from_device.sh", "bench/gpu_session.sh", "bench/gpu_carry.sh",
           "bench/rehearse_device.sh", "workflow/studies/gpu/run.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_device_refuses_an_unknown_job_before_installing_anything(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device.sh"), "everything"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: bash bench/device.sh a|b|c|d|study")
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
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "RESULTS_DIR": str(tmp_path / "results"), "REFERENCE_DIR": str(tmp_path / "ref")}
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
    # their logs are kept with the results, to say what became of the run
    assert (tmp_path / "results" / "study_run_running.log").read_text().startswith("18 of 25 steps")
    assert (tmp_path / "results" / "study_run_failed.log").read_text() == "error: train failed\n"


def _run_files(task: str, cell: str, seed: int, start: str, end: str, wall: float, tokens: int) -> dict[str, str]:
    run = f"data/gpu/runs/{task}/{cell}/seed{seed}"
    cost = {"start_utc": start, "end_utc": end, "wall_s": wall, "tokens_per_s": tokens / wall, "mfu": 0.5,
            "peak_flops": 1e12, "pad_fraction": 0.05, "batch_shapes": 20, "warmup_s": 3.0, "peak_mem_mb": 900.0,
            "device_name": "NVIDIA H100 80GB HBM3", "precision": "bf16-autocast", "compiled": True,
            "cuda_graphs": False, "resumed_from_step": None}
    metrics = {"steps": 1000, "train_tokens": tokens, "flops_per_token": 1e6}
    return {f"{run}/cost.json": json.dumps(cost), f"{run}/train_metrics.json": json.dumps(metrics)}


def test_from_device_keeps_the_throughput_of_the_runs_a_cut_off_study_finished(tmp_path):
    """A study cut off mid-way (no run.rc) is refused, but the runs it finished still give issue 11's
    figures: each cell's, and the runs' together over their window (here 2 runs overlapping half;
    a third, cut off before it wrote train_metrics.json, is left out)."""
    files = {"run.log": "40 of 90 steps (44%) done\n",
             "logs/gpu/bench/evaluate/multi30k_en_de-baseline-s0.tsv": "s\th:m:s\n12.5\t0:00:12\n",
             "logs/gpu/gpu_util.csv": "2026/11/24 10:00:00.000, 80, 1000\n2026/11/24 10:00:02.000, 60, 1000\n"}
    files.update(_run_files("multi30k_en_de", "baseline", 0, "2026-11-24T10:00:00+00:00",
                            "2026-11-24T10:01:40+00:00", 100.0, 10**6))
    files.update(_run_files("multi30k_en_de", "baseline", 1, "2026-11-24T10:00:50+00:00",
                            "2026-11-24T10:02:30+00:00", 100.0, 10**6))
    # cut off between its cost.json and its train_metrics.json (written last): not finished, not counted
    cut = _run_files("multi30k_en_de", "baseline", 2, "2026-11-24T10:01:00+00:00",
                     "2026-11-24T10:03:00+00:00", 120.0, 10**6)
    files.update({path: text for path, text in cut.items() if path.endswith("cost.json")})
    proc = _from_device(tmp_path, _tarball(tmp_path / "cut" / "study.tar.gz", files))
    assert proc.returncode == 1 and "still running (no run.rc)" in proc.stdout, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "results" / "study_gpu_throughput.json").read_text())
    assert record["state"] == "running" and len(record["runs"]) == 2
    together = record["together"]["multi30k_en_de"]
    assert together["window_s"] == 150.0 and abs(together["runs_at_once"] - 200 / 150) < 1e-9
    assert abs(together["target_tok_s"] - 2e6 / 150) < 1e-6
    assert abs(together["mfu"] - 3 * 1e6 * 2e6 / 150 / 1e12) < 1e-12  # 4 %
    assert record["gpu_utilisation_pct"] == 70.0 and record["runs"][0]["evaluate_s"] == 12.5
    md = (tmp_path / "results" / "study_gpu_throughput.md").read_text()
    assert "STILL RUNNING" in md and "| multi30k_en_de | baseline | 2 |" in md and "4.0 %" in md
    assert not (tmp_path / "ref").exists()


def test_gpu_carry_works_in_a_checkout_whose_git_dir_has_no_info_folder(tmp_path):
    # A checkout's .git may lack info/ (git init with an empty template, some tools' copies): the
    # script once stopped there before carrying anything (set -e on the append to info/exclude).
    repo, mirror = tmp_path / "repo", tmp_path / "datasets"
    (repo / "bench").mkdir(parents=True)
    (repo / "bench" / "gpu_carry.sh").write_text((ROOT / "bench" / "gpu_carry.sh").read_text())
    (mirror / "multi30k").mkdir(parents=True)
    (mirror / "multi30k" / "test.jsonl.gz").write_bytes(b"rows")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", "--template=", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    assert not (repo / ".git" / "info").exists()
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "CARRY_NEEDS": "",
           "PIPELINE_DATA_MIRROR": str(mirror)}
    proc = subprocess.run(["bash", "bench/gpu_carry.sh"], cwd=repo, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert (repo / ".whl" / "COMMIT").read_text().strip() == head
    assert (repo / ".mirror" / "multi30k" / "test.jsonl.gz").read_bytes() == b"rows"
    assert (repo / ".git" / "info" / "exclude").read_text().split() == ["/.whl/", "/.mirror/"]
    status = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    assert status == ""  # both carried folders are ignored, not untracked files to commit by mistake


def test_check_carry_names_each_requirement_the_machine_does_not_meet(tmp_path):
    # datasets 5 imports with an old pyarrow and fails only inside a stage: the device log must say why.
    dist = tmp_path / "site" / "carried_pkg-1.0.dist-info"
    dist.mkdir(parents=True)
    dist.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: carried-pkg\nVersion: 1.0\n"
        "Requires-Dist: packaging>=1\n"                       # met
        "Requires-Dist: packaging>=999\n"                     # too old here
        "Requires-Dist: no-such-package-anywhere>=1\n"        # missing
        "Requires-Dist: pywin32; sys_platform == 'win32'\n"   # another platform's: skipped
        "Requires-Dist: pytest; extra == 'test'\n")           # an extra's: skipped
    site = str(tmp_path / "site")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "check_carry.py"), site],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": site})
    assert proc.returncode == 0, proc.stderr  # a warning: the call goes on
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    # (the version is the one the check's interpreter finds, which may differ from this process's)
    assert re.fullmatch(r"!! carried wheels: carried-pkg 1\.0 needs packaging>=999: this machine has packaging \d\S*",
                        lines[0])
    assert lines[1] == ("!! carried wheels: carried-pkg 1.0 needs no-such-package-anywhere>=1: "
                        "not installed on this machine")
