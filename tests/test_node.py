"""A GPU node without internet (workflow/node/): `make bundle` packs wheels, datasets and the repository,
`node.sh` installs offline and runs a study there, `unpack.sh` puts the results back. All of it on
this CPU, end to end, plus the refusals that must come before any time is spent."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["workflow/node/bundle.sh", "workflow/node/node.sh", "workflow/node/unpack.sh", "bench/gpu_benchmarks.sh",
           "workflow/studies/gpu/run.sh", "workflow/studies/cpu/run.sh"]
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_node_refuses_an_unknown_job_before_installing_anything(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "node.sh").write_text((ROOT / "workflow" / "node" / "node.sh").read_text())
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
    for folder in ("tiny", "unread"):
        (mirror / folder).mkdir(parents=True)
        (mirror / folder / "test.jsonl.gz").write_bytes(b"rows")
    (mirror / "README.md").write_text("the mirror\n")
    # BUNDLE_PARAMS: only the mirror folders this study reads travel (here `tiny`, not `unread`)
    params = yaml.safe_load((ROOT / "tests/fixtures/params/valid_tiny.yaml").read_text())
    params["datasets"]["tiny"] = {"kind": "translation", "hf_id": "example/tiny", "fields": {"src": "en", "tgt": "de"}}
    params["tasks"]["reorder"]["dataset"] = "tiny"
    (tmp / "reads_tiny.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, PATH=_bin_path(), PYTHON=sys.executable, BUNDLE=str(tmp / "bundle"),
               PIPELINE_DATA_MIRROR=str(mirror), NODE_PYTHON=PY_VERSION, NEEDS="rouge-score", NODE_HAS="numpy",
               BUNDLE_PARAMS=str(tmp / "reads_tiny.yaml"))
    proc = subprocess.run(["bash", "workflow/node/bundle.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
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
    assert sorted(p.name for p in (b / "datasets").iterdir()) == ["README.md", "tiny"]
    with tarfile.open(b / "repo.tar.gz") as tar:
        members = set(tar.getnames())
    assert {"pipeline_src/train/trainer.py", "workflow/node/unpack.sh", "tests/fixtures/params/valid_tiny.yaml"} <= members
    assert (bundle / "bundle.tar.gz").stat().st_size > 0


def test_node_runs_a_study_offline_and_unpack_puts_it_back(bundle, tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    with tarfile.open(bundle / "bundle.tar.gz") as tar:
        tar.extractall(node, filter="data")
    env = {"PATH": _bin_path(), "HOME": str(tmp_path), "PYTHON": sys.executable, "NODE_CORES": "2",
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
    proc = subprocess.run(["bash", "workflow/node/unpack.sh", str(results)], cwd=checkout, capture_output=True,
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
    return subprocess.run(["bash", str(ROOT / "workflow" / "node" / "unpack.sh"), *map(str, tarballs)],
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


# --- a study in parts (pipeline_src/node/parts.py; node.sh parts): the short-slot path, rehearsed ---------

PARTS_STUDY = """\
study: tinyparts
device: cpu
seeds: [0]
datasets:
  tp_reorder: {kind: translation, generator: reorder, generator_seed: 1, generator_rows: {train: 300, validation: 30, test: 30}}
  tp_grammar: {kind: lm, generator: grammar, generator_seed: 3, generator_rows: {train: 400, validation: 40, test: 40}}
tasks:
  reorder:
    kind: translation
    dataset: tp_reorder
    bpe: {vocab_size: 60}
    model: {d_model: 16, n_heads: 2, enc_layers: 1, dec_layers: 1, d_ff: 32, max_len: 256}
    train: {max_steps: 6, batch_tokens: 400, lr: 1.0e-3, warmup_steps: 2, eval_every: 3, log_every: 1}
    eval: {beam_size: 2, max_examples: 10, batch_size: 10, n_samples: 1, bootstrap: 20}
    cells: [baseline, pe_none]
  grammar:
    kind: lm
    dataset: tp_grammar
    filter: {unit: words, min_src_len: 1, dedup: false}
    bpe: {vocab_size: 60}
    model: {arch: decoder_only, d_model: 16, n_heads: 2, dec_layers: 1, enc_layers: 1, d_ff: 32, max_len: 256}
    train: {max_steps: 400, batch_tokens: 256, lr: 1.0e-3, warmup_steps: 2, eval_every: 200, log_every: 10, lm_seq_len: 32}
    eval: {batch_size: 16, n_samples: 1, bootstrap: 20}
    cells: [baseline, pe_none]
cells:
  baseline: {family: baseline}
  pe_none: {family: positional_encoding, model: {pos_encoding: none}}
claims:
  pe_none_reorder:
    statement: "Removing positions hurts reordering"
    source: "test"
    origin: test
    compare:
      - {task: reorder, cell: pe_none, metric: bleu, expect: lower}
  pe_none_grammar:
    statement: "Removing positions hurts the grammar LM"
    source: "test"
    origin: test
    compare:
      - {task: grammar, cell: pe_none, metric: test_ppl_word, expect: higher}
"""
PARTS_LAYOUT = """\
study: tinyparts
jobs_per_gpu: 2
limit_s: 600
archive_mib: 1
parts:
  - {name: reorder, tasks: [reorder]}
  - {name: grammar, tasks: [grammar]}
"""


def test_parts_on_a_node_killed_mid_part_then_the_report_from_the_archives(bundle, tmp_path):
    """bundle -> `node.sh parts` -> the slot is killed outright during part 2: part 1's archive is
    whole, part 2 left none -> on a fresh checkout `parts build` names the missing runs and builds
    the report of what came back (exit 3) -> part 2 run again -> the full report, whose inputs are
    the node's own files."""
    import signal
    import time

    study_dir = tmp_path / "study"
    study_dir.mkdir()
    (study_dir / "params.yaml").write_text(PARTS_STUDY)
    (study_dir / "parts.yaml").write_text(PARTS_LAYOUT)
    params = str(study_dir / "params.yaml")
    node = tmp_path / "node"
    node.mkdir()
    with tarfile.open(bundle / "bundle.tar.gz") as tar:
        tar.extractall(node, filter="data")
    out = tmp_path / "archives"
    # CORES, which some nodes set for other tools, is not Snakemake's --cores: NODE_CORES is
    env = {"PATH": _bin_path(), "HOME": str(tmp_path), "PYTHON": sys.executable, "NODE_CORES": "2", "CORES": "1",
           "PIPELINE_CPU_THREADS": "1", "PIP_NO_INDEX": "1"}
    first = out / "tinyparts-1-reorder.tar.gz"
    proc = subprocess.Popen(["bash", str(node / "bundle" / "node.sh"), "parts", params, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert first.exists(), proc.stdout.read()[-3000:]
    repo = node / "bundle" / "repo"
    while not list((repo / "data" / "tinyparts" / "runs").glob("grammar/*/seed0/train_log.tsv")) and time.time() < deadline:
        time.sleep(0.2)  # part 2 is training
    os.killpg(proc.pid, signal.SIGKILL)  # the slot's end, without warning
    proc.wait()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [first.name]
    with tarfile.open(first) as tar:
        names = tar.getnames()
        record = json.load(tar.extractfile("tinyparts-1-reorder/part.json"))
    assert first.stat().st_size < 2**20 and not [n for n in names if "/ckpt" in n]
    assert [(r["cell"], r["seed"]) for r in record["runs"]] == [("baseline", 0), ("pe_none", 0)]
    assert record["missing"] == [] and record["snakemake_status"] == 0 and record["snakemake_cores"] == 2
    assert [(s["task"], s["precision"]) for s in record["samples"]] == [("reorder", "fp32")]
    assert "tinyparts-1-reorder/files/data/tinyparts/eval/reorder/pe_none/seed0/eval_metrics.json" in names

    checkout = tmp_path / "checkout"  # another machine: a fresh copy of the repository
    checkout.mkdir()
    with tarfile.open(node / "bundle" / "repo.tar.gz") as tar:
        tar.extractall(checkout, filter="data")
    build_env = {"PATH": _bin_path(), "HOME": str(tmp_path), "PIPELINE_QUIET": "1"}
    build = [sys.executable, "-m", "pipeline_src", "parts", "build", str(out), "--params", params]
    done = subprocess.run(build, cwd=checkout, capture_output=True, text=True, env=build_env, timeout=300)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("MISSING RUNS: 2 of the 4 runs of study tinyparts did not come back (no archive of part grammar)"
            in done.stderr), done.stderr
    assert "part grammar did not come back: grammar/baseline seed 0; grammar/pe_none seed 0" in done.stderr
    report = checkout / "reports" / "tinyparts"
    assert (report / "report.pdf").stat().st_size > 0
    tex = (report / "report.tex").read_text()
    assert "PARTIAL" in tex and "grammar/baseline seed 0" in tex.replace("\\_", "_")
    assert "grammar" in (report / "missing_runs.txt").read_text()

    # the lost part, run again on the node (its stopped runs continue), comes back
    again = subprocess.run(["bash", str(node / "bundle" / "node.sh"), "parts", params, str(out), "grammar"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    done = subprocess.run(build + ["--reference", str(tmp_path / "reference")], cwd=checkout, capture_output=True,
                          text=True, env=build_env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "MISSING" not in done.stderr and not (report / "missing_runs.txt").exists()
    assert "PARTIAL" not in (report / "report.tex").read_text() and (report / "report.pdf").stat().st_size > 0
    results = (report / "results.csv").read_text()
    assert results.count("\nreorder,") == 2 and results.count("\ngrammar,") == 2
    # the report stages read here exactly what the node made: records, outputs, data, the sample's weights
    for rel in ["data/tinyparts/runs/grammar/pe_none/seed0/cost.json",
                "data/tinyparts/eval/reorder/baseline/seed0/eval_metrics.json",
                "data/tinyparts/bpe/reorder/default/bpe60/spm.model",
                "data/tinyparts/filtered/grammar/default/stats.json"]:
        assert (checkout / rel).read_bytes() == (repo / rel).read_bytes(), rel
    import torch
    here = torch.load(checkout / "data/tinyparts/runs/reorder/baseline/seed0/ckpt/best.pt", weights_only=True)
    there = torch.load(repo / "data/tinyparts/runs/reorder/baseline/seed0/ckpt/best.pt", weights_only=True)
    assert all(torch.equal(here["model"][k], there["model"][k]) for k in there["model"])
    timing = json.loads((tmp_path / "reference" / "timing.json").read_text())
    assert [p["part"] for p in timing["parts"]] == ["reorder", "grammar"]
    assert all(p["measured_s"] > 0 and p["finished_runs"] == 2 for p in timing["parts"])
    assert (tmp_path / "reference" / "report.pdf").exists() and (tmp_path / "reference" / "cost.csv").exists()
