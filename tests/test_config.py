"""params validation: a bad params file gives ONE line naming the key, exits non-zero, writes nothing."""
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_src.config import ConfigError, load_study

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


def test_validate_prints_the_study_compute_estimate(tmp_path, monkeypatch):
    """Training tokens x 3 x FLOPs per token, summed over cells and seeds; hours from the
    achieved FLOP/s of the last real-cell benchmark record."""
    from pipeline_src import estimate
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
    assert f"{total:.3g} FLOPs" in text and f"{total / 1e12 / 60:.1f} device-minutes at 1.0 TFLOP/s" in text
    monkeypatch.setattr(estimate, "BENCH_FILES", ())
    assert "no real-cell benchmark yet" in estimate.summary(study)
    proc = subprocess.run([sys.executable, "-m", "pipeline_src", "validate", "--params", str(FIXTURES / "valid_tiny.yaml")],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0 and "estimated training compute" in proc.stdout
