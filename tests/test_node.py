"""A GPU node without internet (bench/node/): `make bundle` packs wheels, datasets and the repository,
`node.sh` installs offline and runs a study there, `unpack.sh` puts the results back. All of it on
this CPU, end to end, plus the refusals that must come before any time is spent."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["bench/node/bundle.sh", "bench/node/node.sh", "bench/node/unpack.sh", "bench/gpu_benchmarks.sh",
           "workflow/studies/gpu/run.sh", "workflow/studies/cpu/run.sh"]
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_node_refuses_an_unknown_job_before_installing_anything(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "node.sh").write_text((ROOT / "bench" / "node" / "node.sh").read_text())
    for args in (["everything"], ["bench", "z"], ["study"]):
        proc = subprocess.run(["bash", str(bundle / "node.sh"), *args], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 2 and proc.stderr.startswith("usage: bash node.sh"), proc.stderr
    assert sorted(p.name for p in bundle.iterdir()) == ["node.sh"]


def _bin_path() -> str:
    return f"{Path(sys.executable).parent}:/usr/bin:/bin"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """`make bundle` for a node whose Python is this one and which has everything but rouge-score's
    closure: those wheels come from PyPI (rouge-score itself has none there: built here)."""
    tmp = tmp_path_factory.mktemp("node")
    mirror = tmp / "datasets"
    (mirror / "tiny").mkdir(parents=True)
    (mirror / "tiny" / "test.jsonl.gz").write_bytes(b"rows")
    env = dict(os.environ, PATH=_bin_path(), PYTHON=sys.executable, BUNDLE=str(tmp / "bundle"),
               PIPELINE_DATA_MIRROR=str(mirror), NODE_PYTHON=PY_VERSION, NEEDS="rouge-score", NODE_HAS="numpy")
    proc = subprocess.run(["bash", "bench/node/bundle.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp


def test_bundle_holds_wheels_datasets_and_the_repository(bundle):
    b = bundle / "bundle"
    manifest = json.loads((b / "bundle.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert manifest["git_commit"] == head and manifest["node_python"] == PY_VERSION
    names = {w.name.split("-")[0].lower() for w in (b / "wheels").glob("*.whl")}
    assert {"rouge_score", "nltk", "absl_py", "six"} <= names and "numpy" not in names and "torch" not in names
    assert manifest["built_here"] == ["rouge-score"]
    assert (b / "datasets" / "tiny" / "test.jsonl.gz").read_bytes() == b"rows"
    with tarfile.open(b / "repo.tar.gz") as tar:
        members = set(tar.getnames())
    assert {"pipeline_src/train.py", "bench/node/unpack.sh", "tests/fixtures/params/valid_tiny.yaml"} <= members
    assert (bundle / "bundle.tar.gz").stat().st_size > 0


def test_node_runs_a_study_offline_and_unpack_puts_it_back(bundle, tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    with tarfile.open(bundle / "bundle.tar.gz") as tar:
        tar.extractall(node, filter="data")
    env = {"PATH": _bin_path(), "HOME": str(tmp_path), "PYTHON": sys.executable, "CORES": "2",
           "PIPELINE_CPU_THREADS": "1", "PIP_NO_INDEX": "1"}  # offline: pip may not look anywhere
    proc = subprocess.run(["bash", str(node / "bundle" / "node.sh"), "study", "tests/fixtures/params/valid_tiny.yaml"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rouge_score" in proc.stdout  # the import check found the carried package
    results = node / "bundle" / "results-study-tiny.tar.gz"
    with tarfile.open(results) as tar:
        names = tar.getnames()
    assert "study-tiny/reports/tiny/results.csv" in names
    assert "study-tiny/data/tiny/runs/reorder/baseline/seed0/train_metrics.json" in names
    assert not [n for n in names if "/ckpt" in n]  # no checkpoints travel back

    checkout = tmp_path / "checkout"  # the repository the bundle was made from, as a fresh copy
    checkout.mkdir()
    with tarfile.open(node / "bundle" / "repo.tar.gz") as tar:
        tar.extractall(checkout, filter="data")
    proc = subprocess.run(["bash", "bench/node/unpack.sh", str(results)], cwd=checkout, capture_output=True,
                          text=True, env={"PATH": _bin_path(), "HOME": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (checkout / "reports" / "tiny" / "report.pdf").stat().st_size > 0
    assert (checkout / "data" / "tiny" / "runs" / "reorder" / "pe_none" / "seed0" / "cost.json").exists()
    assert (checkout / "data" / "tiny" / "eval" / "reorder" / "baseline" / "seed0" / "eval_metrics.json").exists()
    assert (checkout / "bench" / "results" / "node" / "study_tiny_throughput.md").exists()


def _results_tarball(path: Path, name: str, files: dict[str, str]) -> Path:
    src = path.parent / "src"
    for rel, text in files.items():
        (src / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / name / rel).write_text(text)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src / name, arcname=name)
    return path


def _unpack(tmp_path, *tarballs):
    env = {"PATH": _bin_path(), "RESULTS_DIR": str(tmp_path / "results")}
    return subprocess.run(["bash", str(ROOT / "bench" / "node" / "unpack.sh"), *map(str, tarballs)],
                          capture_output=True, text=True, env=env)


def test_unpack_keeps_benchmark_results_and_shows_their_failures(tmp_path):
    part = _results_tarball(tmp_path / "a" / "results-bench-a.tar.gz", "bench-a", {
        "real_cell_eager_static.md": "| figure | value |\n", "real_cell_eager_static.json": "{}\n",
        "exit_status": "0\n", "node.log": "+ bench a\n",
        "session_a.log": "+ python bench/bench_decode.py\n!! FAILED rc=124 (out of time): python bench/bench_decode.py\n"})
    proc = _unpack(tmp_path, part)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "bench-a_node.log", "real_cell_eager_static.json", "real_cell_eager_static.md", "session_a.log"]
    assert "!! FAILED rc=124 (out of time)" in proc.stdout


def test_unpack_refuses_a_study_that_failed_on_the_node(tmp_path):
    failed = _results_tarball(tmp_path / "f" / "results-study-gpu.tar.gz", "study-gpu", {
        "exit_status": "1\n", "node.log": "error: train failed\n", "params.txt": "workflow/studies/gpu/params.yaml\n"})
    proc = _unpack(tmp_path, failed)
    assert proc.returncode == 1
    assert "the study gpu failed on the node (exit status 1)" in proc.stdout and "error: train failed" in proc.stdout
