"""Training engine: exact resume after SIGKILL, DDP == one process, NaN guard, GPU slots, determinism."""
import datetime
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline_src.train import trainer as train_mod
from pipeline_src.train import state as train_state
from pipeline_src.common import StageError
from pipeline_src.study.config import TrainConfig, load_study
from pipeline_src.study.stages import SCRATCH, output_path
from project_copy import checkout_env

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "params" / "valid_tiny.yaml"


def _env(**extra):
    env = checkout_env(PIPELINE_CPU_THREADS="1")
    env.update(extra)
    return env


def _write_params(directory: Path, name: str = "tiny.yaml", **train_overrides) -> str:
    params = yaml.safe_load(TINY.read_text())
    params["tasks"]["reorder"]["train"].update(train_overrides)
    params["tasks"]["reorder"]["model"]["dropout"] = 0.0  # DDP ranks draw different dropout masks
    (directory / name).write_text(yaml.safe_dump(params))
    return name


def _prepare_data(d: Path, params: str) -> None:
    """The tiny study's download, filter and bpe stages in `d`."""
    for stage, arg in [("download", ["--dataset", "tiny_reorder"]), ("filter", ["--task", "reorder"]),
                       ("bpe", ["--task", "reorder"])]:
        subprocess.run([sys.executable, "-m", "pipeline_src", stage, "--params", params, *arg], cwd=d, env=_env(),
                       check=True, capture_output=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory holding the tiny study's prepared data (download, filter, bpe)."""
    d = tmp_path_factory.mktemp("train")
    _prepare_data(d, _write_params(d, max_steps=60, eval_every=5, log_every=5))
    return d


def _train_cmd(params="tiny.yaml", cell="baseline"):
    return [sys.executable, "-m", "pipeline_src", "train", "--params", params, "--task", "reorder", "--cell", cell,
            "--seed", "0"]


def _outputs(d: Path, cell="baseline"):
    path_fields = dict(study="tiny", task="reorder", cell=cell, seed=0)
    return d / output_path("train", "metrics", **path_fields), d / output_path("train", "ckpt", **path_fields), d / SCRATCH.format(**path_fields)


def _clear(d: Path, cell="baseline"):
    for p in _outputs(d, cell):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _weights(ckpt: Path) -> dict:
    return torch.load(ckpt / "last.pt", map_location="cpu", weights_only=True)["model"]


def test_same_seed_same_metrics_bit_for_bit(workdir):
    metrics, ckpt, _ = _outputs(workdir)
    results = []
    for _ in range(2):
        _clear(workdir)
        subprocess.run(_train_cmd(), cwd=workdir, env=_env(), check=True, capture_output=True)
        results.append((metrics.read_bytes(), _weights(ckpt)))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])


def _wait_for_first_state(proc, scratch: Path) -> float:
    deadline = time.time() + 60
    while not (scratch / "state.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before saving any state"
        time.sleep(0.005)
    return time.perf_counter()


@pytest.mark.serial  # SIGKILL at a random moment (Makefile `test` runs the serial tests alone)
def test_sigkill_at_a_random_moment_then_restart_gives_identical_results(workdir):
    metrics, ckpt, scratch = _outputs(workdir)
    others = [Path(output_path("train", name, study="tiny", task="reorder", cell="baseline", seed=0))
              for name in ("info", "log", "cost")]
    _clear(workdir)
    proc = subprocess.Popen(_train_cmd(), cwd=workdir, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_state = _wait_for_first_state(proc, scratch)
    assert proc.wait() == 0
    rest_s = time.perf_counter() - first_state  # the rest of the run: steps, final writes and exit
    reference_metrics, reference_weights = metrics.read_bytes(), _weights(ckpt)

    _clear(workdir)
    proc = subprocess.Popen(_train_cmd(), cwd=workdir, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_first_state(proc, scratch)
    time.sleep(random.uniform(0.0, rest_s))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = metrics.exists()
    if finished:  # the metrics are written last, so everything else must be complete
        assert all((workdir / p).exists() for p in others) and (ckpt / "last.pt").exists()
    restarted = subprocess.run(_train_cmd(), cwd=workdir, env=_env(), check=True, capture_output=True, text=True)
    if not finished:  # the kill landed before the outputs were complete: the scratch state is resumed
        assert "resuming" in restarted.stdout
    assert metrics.read_bytes() == reference_metrics
    weights = _weights(ckpt)
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
    assert not scratch.exists()  # scratch state is removed once the outputs are written


@pytest.mark.serial  # two DDP processes, one per core
def test_ddp_two_gloo_processes_match_one_process(workdir):
    metrics, ckpt, _ = _outputs(workdir)
    _clear(workdir)
    subprocess.run(_train_cmd(), cwd=workdir, env=_env(), check=True, capture_output=True)
    single = _weights(ckpt)
    single_loss = json.loads(metrics.read_text())["best_val_loss"]
    _clear(workdir)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           "-m", "pipeline_src", *_train_cmd()[3:]], cwd=workdir, env=_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    double = _weights(ckpt)
    d = yaml.safe_load((workdir / "tiny.yaml").read_text())["tasks"]["reorder"]["model"]["d_model"]
    for k in single:
        a, b = single[k].clone(), double[k].clone()
        # The key projection's bias has an exactly-zero true gradient (softmax ignores a constant
        # shift of a query's scores), so Adam's m/sqrt(v) blows its rounding noise up to lr-sized
        # steps that differ with the reduction order.
        if k.endswith("qkv_proj.bias"):
            a[d:2 * d] = b[d:2 * d] = 0
        if k.endswith("kv_proj.bias") and not k.endswith("qkv_proj.bias"):
            a[:d] = b[:d] = 0
        # Everything else agrees to rounding, grown by 60 steps of Adam: on an AMD EPYC the
        # reduction order moves weights by up to 8e-4 (of ~0.4), on an Intel Xeon by < 1e-4. A
        # wrong shard or a wrong gradient sum moves them by ~1e-2.
        assert torch.allclose(a, b, atol=2e-3, rtol=0), (k, float((a - b).abs().max()))
    assert json.loads(metrics.read_text())["best_val_loss"] == pytest.approx(single_loss, rel=1e-4)


def test_non_finite_loss_stops_with_a_clear_message_and_keeps_the_last_good_state(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    study = load_study("tiny.yaml")
    metrics, ckpt, scratch = _outputs(workdir)
    _clear(workdir)
    real_loss = train_mod.sequence_loss
    calls = {"n": 0}

    def poisoned(model, batch, label_smoothing=0.0, reduction="sum", **kwargs):
        loss = real_loss(model, batch, label_smoothing, reduction, **kwargs)
        if model.training:
            calls["n"] += 1
            if calls["n"] == 8:  # after the state saved at step 5
                loss = loss * float("nan")
        return loss

    monkeypatch.setattr(train_mod, "sequence_loss", poisoned)
    with pytest.raises(StageError) as err:
        train_mod.run(study, "reorder", "baseline", 0)
    assert "non-finite training loss at step 8" in str(err.value) and "\n" not in str(err.value)
    saved = torch.load(scratch / "state.pt", map_location="cpu", weights_only=False)
    assert saved["state"]["step"] == 5
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())
    assert not metrics.exists() and not ckpt.exists()


def test_gpu_slots_give_each_job_its_own_gpu(tmp_path):
    code = ("import sys, time; from pipeline_src.runtime.gpu_slots import claim_gpu; "
            "print(claim_gpu(n_gpus=2, wait_s=float(sys.argv[1]), poll_s=0.05), flush=True); time.sleep(float(sys.argv[2]))")
    env = _env(PIPELINE_GPU_LOCK_DIR=str(tmp_path))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    holders = [subprocess.Popen([sys.executable, "-c", code, "5", "30"], env=env, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    claimed = sorted(int(h.stdout.readline()) for h in holders)
    assert claimed == [0, 1]
    third = subprocess.run([sys.executable, "-c", code, "0.3", "0"], env=env, capture_output=True, text=True)
    assert third.returncode != 0 and "no free GPU" in third.stderr
    holders[0].kill()  # a killed job releases its GPU
    holders[0].wait()
    fourth = subprocess.run([sys.executable, "-c", code, "5", "0"], env=env, capture_output=True, text=True)
    assert fourth.returncode == 0 and int(fourth.stdout) in (0, 1)
    holders[1].kill()


def test_schedules():
    cfg = TrainConfig(lr=1.0, warmup_steps=100, schedule="inverse_sqrt", max_steps=1000)
    assert train_mod.learning_rate(50, cfg) == pytest.approx(0.5)
    assert train_mod.learning_rate(100, cfg) == pytest.approx(1.0)
    assert train_mod.learning_rate(400, cfg) == pytest.approx(0.5)  # ∝ step^-0.5 after warm-up
    cos = TrainConfig(lr=1.0, warmup_steps=0, schedule="cosine", max_steps=1000)
    assert train_mod.learning_rate(500, cos) == pytest.approx(0.5, abs=2e-3)
    assert train_mod.learning_rate(1000, cos) == pytest.approx(0.0, abs=1e-6)
    assert math.isclose(train_mod.learning_rate(10, TrainConfig(lr=2.0, warmup_steps=0, schedule="constant")), 2.0)


def _tiny_study(workdir, **train):
    text = yaml.safe_load((workdir / "tiny.yaml").read_text())
    text["tasks"]["reorder"]["train"].update(train)
    (workdir / "variant.yaml").write_text(yaml.safe_dump(text))
    return load_study("variant.yaml")  # same study name: reuses the prepared data


def test_a_run_converged_when_its_last_evaluations_did_not_improve():
    from pipeline_src.study.convergence import converged

    def log(*vals):
        return [{"step": 5 * i, "val_loss": v} for i, v in enumerate(vals)] + [{"step": 99, "val_loss": ""}]

    assert converged(log(3.0, 2.0, 1.5, 1.6, 1.55))  # best, then two evaluations above it
    assert not converged(log(3.0, 2.0, 1.6, 1.5))  # still improving at the end
    assert not converged(log(3.0, 2.0, 1.5, 1.6, 1.4))  # improved at the last evaluation
    assert not converged(log(3.0, 2.0))  # too few evaluations to say
    assert converged(log(3.0, 2.0, 2.0, 2.0))  # a plateau: equal is not lower


def test_early_stopping_stops_when_patience_runs_out(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    study = _tiny_study(workdir, patience=2, eval_every=5, max_steps=60)
    _clear(workdir)
    curve = iter([1.0, 0.5, 0.7, 0.6, 0.4])  # best at the 2nd evaluation, then two without improvement
    monkeypatch.setattr(train_mod, "validation_loss", lambda *a, **k: next(curve))
    train_mod.run(study, "reorder", "baseline", 0)
    metrics = json.loads(_outputs(workdir)[0].read_text())
    info = json.loads(_outputs(workdir)[0].with_name("train_info.json").read_text())
    assert info["stop_reason"] == "early_stopping"
    assert info["converged"] is True and info["lr"] == study.cell("reorder", "baseline").train.lr
    assert (metrics["steps"], metrics["best_step"], metrics["best_val_loss"]) == (20, 10, 0.5)
    best = torch.load(_outputs(workdir)[1] / "best.pt", weights_only=True)
    assert best["meta"]["step"] == 10


def test_checkpoint_averaging_writes_the_mean_of_the_last_evaluations(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    study = _tiny_study(workdir, average_last=2, eval_every=10, max_steps=30)
    _clear(workdir)
    saved = {}
    real_save = train_state.save

    def spy(path, obj):
        if Path(path).name.startswith("eval"):
            saved[Path(path).name] = {k: v.clone() for k, v in obj.items()}
        real_save(path, obj)

    monkeypatch.setattr(train_state, "save", spy)
    train_mod.run(study, "reorder", "baseline", 0)
    ckpt = _outputs(workdir)[1]
    averaged = torch.load(ckpt / "averaged.pt", weights_only=True)
    assert averaged["meta"]["averaged"] == ["eval20.pt", "eval30.pt"]
    for k, v in averaged["model"].items():
        if v.is_floating_point():
            assert torch.allclose(v, (saved["eval20.pt"][k] + saved["eval30.pt"][k]) / 2), k
    assert json.loads(_outputs(workdir)[0].with_name("train_info.json").read_text())["eval_checkpoint"] == "averaged.pt"
    _, meta = train_mod.load_trained_model(ckpt)  # evaluation picks the averaged weights
    assert meta.get("averaged") == ["eval20.pt", "eval30.pt"]


def test_prefetch_and_static_shapes_keep_metrics_byte_identical(workdir):
    """The prefetch thread hands the loop the very batches it would have collated itself: the
    metrics (config aside) and weights are identical with and without it, with dynamic and with static shapes. Static
    shapes report their padding and the few shapes an epoch has in cost.json."""
    metrics, ckpt, _ = _outputs(workdir)
    cost = metrics.parent / "cost.json"
    params = yaml.safe_load((workdir / "tiny.yaml").read_text())
    results = {}
    for buckets in (0, 4):
        for prefetch in (False, True):
            params["tasks"]["reorder"]["train"].update(prefetch=prefetch, length_buckets=buckets, max_steps=30)
            (workdir / "variant.yaml").write_text(yaml.safe_dump(params))
            _clear(workdir)
            subprocess.run(_train_cmd("variant.yaml"), cwd=workdir, env=_env(), check=True, capture_output=True)
            # the file also records the config (which names the prefetch setting): compare the rest
            record = {k: v for k, v in json.loads(metrics.read_text()).items() if k not in ("config", "provenance")}
            results[buckets, prefetch] = (json.dumps(record), json.loads(cost.read_text()), _weights(ckpt))
    for buckets in (0, 4):
        off, on = results[buckets, False], results[buckets, True]
        assert off[0] == on[0] and all(torch.equal(off[2][k], on[2][k]) for k in off[2])
    assert results[0, False][0] != results[4, False][0]  # buckets do change the batches
    dynamic, static = results[0, True][1], results[4, True][1]
    assert 0 < static["pad_fraction"] < 0.5 and 0 <= dynamic["pad_fraction"] < 0.5
    # 300 short examples: a handful of buckets, against a new shape for most dynamic batches
    assert static["batch_shapes"] <= 12 < dynamic["batch_shapes"]
    assert static["warmup_s"] >= 0
    # when the loop ran, for runs sharing a GPU (bench/study_throughput.py): an interval as long as wall_s
    start, end = (datetime.datetime.fromisoformat(static[k]) for k in ("start_utc", "end_utc"))
    assert start.tzinfo is not None and abs((end - start).total_seconds() - static["wall_s"]) < 1.0
    assert static["compiled"] is False and static["cuda_graphs"] is False
    # compile and CUDA graphs are CUDA-only: on a CPU the run is the eager one, and says so
    params["tasks"]["reorder"]["train"].update(compile=True, cuda_graphs=True)
    (workdir / "variant.yaml").write_text(yaml.safe_dump(params))
    _clear(workdir)
    subprocess.run(_train_cmd("variant.yaml"), cwd=workdir, env=_env(), check=True, capture_output=True)
    record = {k: v for k, v in json.loads(metrics.read_text()).items() if k not in ("config", "provenance")}
    assert json.dumps(record) == results[4, True][0]
    assert json.loads(cost.read_text())["cuda_graphs"] is False


def test_gpu_slots_several_jobs_per_gpu_spread_first(tmp_path):
    """PIPELINE_JOBS_PER_GPU=2 on two GPUs: four jobs run, two per GPU, the first two on
    different GPUs; a fifth finds no slot."""
    code = ("import sys, time; from pipeline_src.runtime.gpu_slots import claim_gpu; "
            "print(claim_gpu(n_gpus=2, wait_s=float(sys.argv[1]), poll_s=0.05), flush=True); time.sleep(float(sys.argv[2]))")
    env = _env(PIPELINE_GPU_LOCK_DIR=str(tmp_path), PIPELINE_JOBS_PER_GPU="2")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    holders, claimed = [], []
    for _ in range(4):  # one after the other, so the order of claims is known
        holders.append(subprocess.Popen([sys.executable, "-c", code, "5", "30"], env=env, stdout=subprocess.PIPE,
                                        text=True))
        claimed.append(int(holders[-1].stdout.readline()))
    assert claimed[:2] == [0, 1] and sorted(claimed) == [0, 0, 1, 1]
    fifth = subprocess.run([sys.executable, "-c", code, "0.3", "0"], env=env, capture_output=True, text=True)
    assert fifth.returncode != 0 and "no free GPU among 2 (x 2 jobs each)" in fifth.stderr
    bad = subprocess.run([sys.executable, "-c", code, "0.3", "0"], env=dict(env, PIPELINE_JOBS_PER_GPU="0"),
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "PIPELINE_JOBS_PER_GPU='0'" in bad.stderr
    for h in holders:
        h.kill()
        h.wait()
