"""Faults a real machine throws, each one line naming the file or the cell and the fix; nothing
marked complete, and the same command afterwards gives the run it would have given.

The disk is made full for real (a temporary file that is a link to /dev/full: every write fails
with ENOSPC), files are really truncated, and memory really runs out (an address-space limit)."""
import os
import resource
import subprocess
import sys

import pytest
import yaml

from pipeline_src.train import state as train_state
from pipeline_src.common import StageError, human_size
from pipeline_src.study.stages import output_path
from test_train import _env, _outputs, _prepare_data, _train_cmd, _write_params

JOB = ["--task", "reorder", "--cell", "baseline", "--seed", "0"]


@pytest.fixture(scope="module")
def faults_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    _prepare_data(d, _write_params(d, max_steps=20, eval_every=10, log_every=10))
    subprocess.run(_train_cmd(), cwd=d, env=_env(), check=True, capture_output=True)
    metrics, _, _ = _outputs(d)
    return d, metrics.read_bytes()


def _stage(d, *args):
    return subprocess.run([sys.executable, "-m", "pipeline_src", *args, "--params", "tiny.yaml"], cwd=d,
                          env=_env(), capture_output=True, text=True)


def _one_error_line(proc) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_disk_full_while_saving_the_training_state(faults_dir):
    d, reference = faults_dir
    metrics, ckpt, scratch = _outputs(d)
    metrics.unlink()
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / ".state.pt.tmp").symlink_to("/dev/full")  # the state's temporary file: writes fail with ENOSPC
    line = _one_error_line(_stage(d, "train", *JOB))
    assert "no space left on the device writing data/tiny/scratch/reorder/baseline/seed0/state.pt" in line
    assert " free on the file system at /" in line and ", about " in line and " needed; " in line
    assert line.endswith("run the same command (nothing was marked complete)")
    assert not metrics.exists() and not (scratch / "state.pt").exists()
    assert not (scratch / ".state.pt.tmp").exists()  # the abandoned temporary file is gone, not left half-written
    assert _stage(d, "train", *JOB).returncode == 0
    assert metrics.read_bytes() == reference


def test_no_space_names_the_file_the_free_space_and_the_size(tmp_path):
    target = tmp_path / "best.pt"
    (tmp_path / ".best.pt.tmp").symlink_to("/dev/full")
    import torch
    obj = {"w": torch.zeros(1000, 250)}
    with pytest.raises(StageError) as err:
        train_state.save(target, obj)
    assert "no space left on the device writing" in str(err.value) and "best.pt" in str(err.value)
    assert f"about {human_size(train_state.serialized_size(obj))} needed" in str(err.value) and not target.exists()


def test_a_truncated_checkpoint_names_the_file_and_how_to_restore_it(faults_dir):
    d, _ = faults_dir
    _, ckpt, _ = _outputs(d)
    best = ckpt / "best.pt"
    whole = best.read_bytes()
    try:
        best.write_bytes(whole[: len(whole) // 2])
        line = _one_error_line(_stage(d, "evaluate", *JOB))
        shown = os.path.relpath(ckpt, d)
        assert f"{shown}/best.pt: unreadable, truncated or corrupted" in line
        assert f"dvc checkout {shown}" in line and f"delete {shown} and run the same command" in line
        assert not (d / output_path("evaluate", "metrics", study="tiny", task="reorder", cell="baseline",
                                    seed=0)).exists()
    finally:
        best.write_bytes(whole)
    assert _stage(d, "evaluate", *JOB).returncode == 0


def test_a_corrupted_training_state_names_the_file_and_says_the_run_restarts(faults_dir):
    d, reference = faults_dir
    metrics, _, scratch = _outputs(d)
    metrics.unlink()
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "state.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    line = _one_error_line(_stage(d, "train", *JOB))
    assert "data/tiny/scratch/reorder/baseline/seed0/state.pt: unreadable" in line
    assert "delete data/tiny/scratch/reorder/baseline/seed0 and run the same command" in line
    subprocess.run(["rm", "-r", str(scratch)], check=True)
    assert _stage(d, "train", *JOB).returncode == 0 and metrics.read_bytes() == reference


def test_a_truncated_data_file_names_it(faults_dir):
    d, _ = faults_dir
    bpe = next((d / "data" / "tiny" / "bpe" / "reorder").rglob("train.src.ids.npy"))
    whole = bpe.read_bytes()
    metrics, _, _ = _outputs(d)
    saved_metrics = metrics.read_bytes()
    metrics.unlink()
    try:
        bpe.write_bytes(whole[: len(whole) - 40])
        line = _one_error_line(_stage(d, "train", *JOB))
        shown = os.path.relpath(bpe, d)
        assert f"{shown}: unreadable, truncated or corrupted" in line
        assert f"dvc checkout {os.path.dirname(shown)}" in line
    finally:
        bpe.write_bytes(whole)
        metrics.write_bytes(saved_metrics)


def test_out_of_memory_names_the_cell_the_batch_and_the_setting_to_lower(faults_dir):
    """An address-space limit the model fits in but its first training step does not."""
    d, _ = faults_dir
    params = yaml.safe_load((d / "tiny.yaml").read_text())
    params["tasks"]["reorder"]["model"]["d_ff"] = 1_000_000  # 16 x 1M feed-forward: 256 MB of weights
    (d / "oom.yaml").write_text(yaml.safe_dump(params))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1800 << 20, 1800 << 20))

    proc = subprocess.run([sys.executable, "-m", "pipeline_src", "train", "--params", "oom.yaml", *JOB], cwd=d,
                          env=_env(), capture_output=True, text=True, preexec_fn=limit)
    line = _one_error_line(proc)
    assert line.startswith("error: train reorder/baseline/0: out of memory on the CPU while allocating")
    batch = params["tasks"]["reorder"]["train"]["batch_tokens"]
    assert f"lower train.batch_tokens ({batch} now; raise train.grad_accum" in line and "in tasks.reorder" in line
