"""params validation: a bad params file gives ONE line naming the key, exits non-zero, writes nothing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_src.study.config import ConfigError, load_study

FIXTURES = Path(__file__).parent / "fixtures" / "params"
BAD = sorted(FIXTURES.glob("bad_*.yaml"))
ROOT = Path(__file__).resolve().parent.parent


def expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} needs an '# expect: <key>' header"
    return first.removeprefix("# expect: ").strip()


def test_corpus_is_large_enough():
    assert len(BAD) >= 15


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_params_give_one_line_naming_the_key(path):
    with pytest.raises(ConfigError) as err:
        load_study(path)
    message = str(err.value)
    assert "\n" not in message
    assert expected(path) in message, message
    assert str(path) in message  # names the file too


def test_valid_fixture_and_shipped_studies_load():
    for p in [FIXTURES / "valid_tiny.yaml", ROOT / "params.yaml", ROOT / "workflow/studies/demo/params.yaml",
              ROOT / "workflow/studies/mirror/params.yaml"]:
        study = load_study(p)
        assert study.tasks


def test_cli_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((FIXTURES / "bad_heads_not_divisor.yaml").read_text())
    for stage, extra in [("validate", []), ("download", ["--dataset", "tiny_reorder"]),
                         ("train", ["--task", "reorder", "--cell", "baseline", "--seed", "0"])]:
        proc = subprocess.run([sys.executable, "-m", "pipeline_src", stage, "--params", str(bad), *extra],
                              cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "d_model" in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_cell_overrides_are_sparse_and_merge_over_the_task_base():
    study = load_study(FIXTURES / "valid_tiny.yaml")
    base, cell = study.cell("reorder", "baseline"), study.cell("reorder", "pe_none")
    assert base.model["pos_encoding"] == "sinusoidal" and cell.model["pos_encoding"] == "none"
    assert {k for k in base.model if base.model[k] != cell.model[k]} == {"pos_encoding"}
    assert base.train == cell.train and base.model["d_model"] == 16


def test_leaking_cell_is_marked():
    study = load_study(ROOT / "workflow/studies/demo/params.yaml")
    assert study.cell("grammar", "encoder_only").leaks_future
    assert not study.cell("grammar", "baseline").leaks_future


# --------------------------------------------------------------------------- cross-field: positions

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from pipeline_src.study.config import positions_needed  # noqa: E402

CAPS = {"max_src_len": 40, "max_tgt_len": 30, "lm_seq_len": 48}
NEED = {("translation", "encoder_decoder"): 40, ("translation", "decoder_only"): 70,
        ("lm", "decoder_only"): 48, ("lm", "encoder_only"): 48}


def _positions_study(tmp_path, kind: str, arch: str, pos: str, max_len: int) -> Path:
    raw = yaml.safe_load((FIXTURES / "valid_tiny.yaml").read_text())
    if kind == "lm":
        raw["datasets"] = {"g": {"kind": "lm", "generator": "grammar"}}
        raw["tasks"]["reorder"].update(kind="lm", dataset="g")
    raw["tasks"]["reorder"]["model"].update(arch=arch, max_len=max_len)
    raw["tasks"]["reorder"]["train"].update(CAPS)
    raw["cells"]["cell"] = {"family": "x", "model": {"pos_encoding": pos}}
    raw["tasks"]["reorder"]["cells"] = ["cell"]
    path = tmp_path / f"{kind}_{arch}_{pos}_{max_len}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("pos", ["sinusoidal", "learned", "none", "rope"])
@pytest.mark.parametrize("kind,arch", list(NEED))
def test_max_len_is_checked_for_every_encoding_and_architecture(kind, arch, pos, tmp_path):
    need = NEED[(kind, arch)]
    assert load_study(_positions_study(tmp_path, kind, arch, pos, need)).cell("reorder", "cell").model["max_len"] == need
    with pytest.raises(ConfigError) as err:
        load_study(_positions_study(tmp_path, kind, arch, pos, need - 1))
    msg = str(err.value)
    assert "\n" not in msg and "cells.cell (task reorder): model.max_len" in msg and f"{need} positions" in msg, msg
    assert f"pos_encoding {pos}" in msg and ("lm_seq_len" if kind == "lm" else "max_src_len") in msg, msg


def _write_split(bpe_dir: Path, split: str, side: str, seqs: list[list[int]]) -> None:
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    np.save(bpe_dir / f"{split}.{side}.ids.npy", ids)
    np.save(bpe_dir / f"{split}.{side}.offsets.npy", offsets)


@pytest.mark.parametrize("kind,arch", list(NEED))
def test_positions_needed_is_what_batching_feeds_the_model(kind, arch, tmp_path):
    """The bound the config check uses is exact: over-long rows, cut by the real batching code,
    fill exactly that many positions; a learned/sinusoidal table one row shorter fails."""
    import torch

    from pipeline_src.train import batching
    from pipeline_src.study.config import TrainConfig
    from pipeline_src.model import ModelConfig, Transformer

    train = TrainConfig(**CAPS)
    need = positions_needed(kind, arch, train)[0]
    assert need == NEED[(kind, arch)]
    long = [list(range(4, 4 + 90)), list(range(4, 14))]  # longer than every cap, and a short row
    if kind == "lm":
        _write_split(tmp_path, "test", "text", long)
        stream, _ = batching.load_lm_stream(tmp_path, "test")
        starts = batching.lm_windows(stream, train.lm_seq_len)
        batch = batching.collate_lm(stream, starts, list(range(len(starts))), train.lm_seq_len)
        src, width = None, batch["tgt_in"].shape[1]
    else:
        _write_split(tmp_path, "test", "src", long)
        _write_split(tmp_path, "test", "tgt", long)
        data = batching.load_seq2seq(tmp_path, "test", train.max_src_len, train.max_tgt_len)
        batch = batching.collate_seq2seq(data, [0, 1], arch)
        src = batch["src"]
        width = max(batch["tgt_in"].shape[1], 0 if src is None else src.shape[1])
    assert width == need
    for pos in ("learned", "sinusoidal"):
        def model(max_len):
            torch.manual_seed(0)
            return Transformer(ModelConfig(vocab_size=100, arch=arch, d_model=8, n_heads=2, enc_layers=1, dec_layers=1,
                                           d_ff=16, pos_encoding=pos, max_len=max_len)).eval()
        with torch.no_grad():
            assert model(need)(src, batch["tgt_in"]).shape[1] == batch["tgt_in"].shape[1]
            with pytest.raises(IndexError):
                model(need - 1)(src, batch["tgt_in"])


def test_an_unforeseen_stage_failure_is_one_line(tmp_path):
    """A failure no check foresaw (here: a raw data directory that is a file) still ends in one
    line naming the stage, the error and where it happened; PIPELINE_TRACEBACK=1 shows the traceback."""
    params = tmp_path / "p.yaml"
    params.write_text((FIXTURES / "valid_tiny.yaml").read_text())
    (tmp_path / "data" / "tiny" / "raw").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "raw" / "tiny_reorder").write_text("not a directory")
    (tmp_path / "data" / "tiny" / "raw" / "tiny_reorder.tmp").write_text("not a directory either")
    cmd = [sys.executable, "-m", "pipeline_src", "download", "--params", str(params), "--dataset", "tiny_reorder"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "", "PIPELINE_QUIET": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: download: "), proc.stderr
    assert "PIPELINE_TRACEBACK=1" in lines[0]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**env, "PIPELINE_TRACEBACK": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_validate_prints_the_study_compute_estimate(tmp_path, monkeypatch):
    """Training tokens x 3 x FLOPs per token, summed over cells and seeds; hours from the
    achieved FLOP/s of the last real-cell benchmark record."""
    from pipeline_src.study import estimate
    from pipeline_src.model import ModelConfig, flops_per_token

    study = load_study(FIXTURES / "valid_tiny.yaml")
    t = study.cell("reorder", "baseline").train
    mcfg = ModelConfig(vocab_size=60, pad_id=0, bos_id=2, eos_id=3, **study.cell("reorder", "baseline").model)
    tokens = t.max_steps * t.batch_tokens
    assert estimate.job_compute(study, "reorder", "baseline") == (tokens, 3 * flops_per_token(mcfg, 256, 256) * tokens)
    record = tmp_path / "real_cell.json"
    record.write_text('{"results": {"cost": {"mfu": 0.5, "peak_flops": 2e12, "device_name": "X"}}}')
    monkeypatch.setattr(estimate, "BENCH_FILES", (tmp_path / "missing.json", record))
    monkeypatch.setattr(estimate, "ROOT", tmp_path)
    total = sum(estimate.job_compute(study, "reorder", c)[1] for c in ("baseline", "pe_none"))
    text = estimate.summary(study)
    assert f"{total:.3g} FLOPs" in text and f"{total / 1e12 / 60:.1f} GPU-minutes at 1.0 TFLOP/s" in text
    # bench_real_cell.py's own report keeps the cost at the top level
    record.write_text('{"benchmark": "real_cell", "cost": {"mfu": 0.25, "peak_flops": 4e12, "device_name": "Y"}}')
    assert estimate.measured_throughput() == (1e12, "Y, real_cell.json")
    # a CPU's record (bench_real_cell.py run on a CPU) is never a GPU's estimate
    record.write_text('{"cost": {"device": "cpu", "achieved_flops": 5e9, "device_name": "AMD EPYC"}}')
    assert estimate.measured_throughput() is None
    assert estimate.measured_throughput([record], device="cpu") == (5e9, "AMD EPYC, real_cell.json")
    monkeypatch.setattr(estimate, "BENCH_FILES", ())
    assert "no real-cell benchmark yet" in estimate.summary(study)
    proc = subprocess.run([sys.executable, "-m", "pipeline_src", "validate", "--params", str(FIXTURES / "valid_tiny.yaml")],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0 and "estimated training compute" in proc.stdout


def test_max_len_check_counts_the_bucket_grid(tmp_path):
    """With static-shape buckets a batch is as wide as its bucket's grid length, and a padded
    column still takes a position: 70 positions round up to 72 on a grid of 8 per doubling."""
    from pipeline_src.study.config import bucket_length

    assert bucket_length(70, 8) == 72
    path = _positions_study(tmp_path, "translation", "decoder_only", "learned", 70)
    raw = yaml.safe_load(path.read_text())
    raw["tasks"]["reorder"]["train"]["length_buckets"] = 8
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="72 positions.*bucket grid of train.length_buckets 8"):
        load_study(path)
    raw["tasks"]["reorder"]["model"]["max_len"] = 72
    path.write_text(yaml.safe_dump(raw))
    assert load_study(path).cell("reorder", "cell").model["max_len"] == 72


def test_cuda_graphs_needs_compile_and_static_shapes(tmp_path):
    raw = yaml.safe_load((FIXTURES / "valid_tiny.yaml").read_text())
    path = tmp_path / "p.yaml"
    train = raw["tasks"]["reorder"]["train"]
    for settings in ({"cuda_graphs": True}, {"cuda_graphs": True, "compile": True}):
        train.update(settings)
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match=r"cells.baseline \(task reorder\): train.cuda_graphs: needs "
                                              r"train.compile: true and train.length_buckets > 0"):
            load_study(path)
    train["length_buckets"] = 8
    path.write_text(yaml.safe_dump(raw))
    assert load_study(path).cell("reorder", "baseline").train.cuda_graphs is True


def _with_sweeps(tmp_path, sweeps: dict, cells: list) -> Path:
    import yaml

    params = yaml.safe_load((FIXTURES / "valid_tiny.yaml").read_text())
    params["sweeps"] = sweeps
    params["tasks"]["reorder"]["cells"] = cells
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def test_a_sweep_is_a_family_of_named_cells_like_hand_written_ones(tmp_path):
    path = _with_sweeps(tmp_path, {
        "heads": {"model": {"n_heads": [1, 4]}},                              # one axis, default names/labels
        "shape": {"model": {"d_model": [16, 32], "dropout": [0.0, 0.1]},       # a product of two axes
                  "family": "size", "label": "d{d_model}, dropout {dropout}"},
        "warm": {"train": {"warmup_steps": [0, 4], "lr": 2.0e-3}}},            # one value: shared by the cells
        ["baseline", "heads", "shape_32_0p1", "warm", "pe_none"])
    study = load_study(path)
    # A sweep's name in a task's cells list stands for all its cells, in order; single cells by name.
    assert study.tasks["reorder"].cells == ("baseline", "heads_1", "heads_4", "shape_32_0p1", "warm_0", "warm_4",
                                            "pe_none")
    assert study.cells["heads_4"] == {"family": "heads", "label": "n_heads 4", "model": {"n_heads": 4}}
    assert study.cells["warm_4"] == {"family": "warm", "label": "warmup_steps 4",
                                     "train": {"warmup_steps": 4, "lr": 2.0e-3}}
    assert {c for c in study.cells if c.startswith("shape_")} == {"shape_16_0", "shape_16_0p1", "shape_32_0", "shape_32_0p1"}
    assert study.cells["shape_32_0p1"] == {"family": "size", "label": "d32, dropout 0.1",
                                           "model": {"d_model": 32, "dropout": 0.1}}
    resolved = study.cell("reorder", "shape_32_0p1")  # resolved over the task's base like any cell
    assert (resolved.model["d_model"], resolved.model["dropout"], resolved.model["n_heads"]) == (32, 0.1, 2)
    assert resolved.family == "size" and resolved.label == "d32, dropout 0.1"
    # DVC tracks (and Snakemake hashes) the sweep's entry for its cells: a key that is in the file.
    assert study.cell_key("heads_1") == "sweeps.heads" and study.cell_key("pe_none") == "cells.pe_none"
    from pipeline_src.runtime.dvc_yaml import render
    from pipeline_src.study.stages import jobs_by_stage

    train = jobs_by_stage(study)["train"]
    assert "sweeps.heads" in train["reorder-heads_1-s0"].params
    assert "cells.pe_none" in train["reorder-pe_none-s0"].params
    import yaml

    stages = yaml.safe_load(render(study))["stages"]
    assert "reorder-heads_4-s0" in stages["train-sweep-heads"]["foreach"]
    assert "sweeps.heads" in stages["train-sweep-heads"]["do"]["params"][0][str(path)]
    # The report's cells table lists swept cells with their family and label.
    from pipeline_src.report.tables import cells_table

    table = cells_table(study)
    assert "d32, dropout 0.1" in table and "n\\_heads 4" in table.replace(r"\allowbreak{}", "")


def test_the_shipped_studies_write_their_families_as_sweeps():
    gpu = load_study(ROOT / "workflow/studies/gpu/params.yaml")
    assert gpu.tasks["multi30k_en_de"].cells[3:5] == ("heads_1", "heads_16")
    assert gpu.cell_key("dropout_0p1") == "sweeps.dropout" and gpu.cells["layers_4"]["family"] == "layers"
    demo = load_study(ROOT / "workflow/studies/demo/params.yaml")
    assert demo.tasks["reorder"].cells[-2:] == ("data_size_0p1", "data_size_0p3")
    assert demo.cells["data_size_0p3"]["label"] == "30% of train"


def test_a_stage_exits_fast_yet_flushes_output_and_runs_exit_handlers(tmp_path):
    """The command line leaves out the interpreter's teardown (~0.3 s a job with torch loaded),
    but what a normal exit does that matters still happens: its exit code, buffered output on a
    pipe, atexit handlers. Under a profiler it exits the normal way, so the profile is written."""
    marker, finalized = tmp_path / "atexit_ran", tmp_path / "finalizer_ran"
    # torch's operator-library finalizers are dropped (they only undo this process's registrations);
    # any other weakref.finalize still runs at exit, as temporary directories need.
    code = ("import atexit, pathlib, sys, weakref, torch; from pipeline_src.__main__ import exit_now; "
            f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes'); "
            f"kept = type('Kept', (), {{}})(); weakref.finalize(kept, pathlib.Path({str(finalized)!r}).write_text, 'yes'); "
            "print('buffered line'); sys.stderr.write('no newline'); exit_now(3)")
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output waits in a buffer
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=buffered)
    assert proc.returncode == 3
    assert proc.stdout == "buffered line\n" and proc.stderr == "no newline"
    assert marker.read_text() == "yes" and finalized.read_text() == "yes"
    profile = tmp_path / "validate.prof"
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "pipeline_src", "validate",
                           "--params", str(FIXTURES / "valid_tiny.yaml")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "is valid" in proc.stdout
    assert profile.stat().st_size > 0


def test_params_match_is_checked_and_shipped_matched_cells_are_within_one_percent(tmp_path):
    """A cell that declares `params_match` must have the named cell's parameter count within 1 %:
    validate prints both counts, and refuses (one line naming both cells) where they drift apart."""
    import yaml

    from pipeline_src.study.estimate import matched_parameters
    for name in ("demo", "cpu", "gpu"):
        lines = matched_parameters(load_study(ROOT / f"workflow/studies/{name}/params.yaml"))
        assert lines and all("decoder_only" in line for line in lines), name
    params = yaml.safe_load((ROOT / "workflow/studies/demo/params.yaml").read_text())
    params["cells"]["decoder_only"]["model"] = {"arch": "decoder_only"}  # 2 layers: 19 % fewer parameters
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(ConfigError, match=r"cells\.decoder_only\.params_match: decoder_only has [\d,]+ parameters in "
                                          r"task 'reorder', baseline [\d,]+ \(\d+\.\d % apart; at most 1 %\)"):
        matched_parameters(load_study(bad))
    proc = subprocess.run([sys.executable, "-m", "pipeline_src", "validate", "--params", str(bad)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "params_match" in proc.stderr
