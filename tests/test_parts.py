"""A study in parts (pipeline_src/node/parts.py, parts_layout.py, estimate.predict_parts): the layout and
its one-line errors, the GPU study's predicted minutes, the attention sample's rounding, and the
params file of a partial report. The whole path, node to report, is in tests/test_node.py."""
import json
from pathlib import Path

import pytest
import yaml

from pipeline_src.node import parts
from pipeline_src.common import ConfigError
from pipeline_src.study.config import load_study
from pipeline_src.study.estimate import predict_parts
from pipeline_src.node.parts_layout import load_layout

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "workflow" / "studies" / "gpu" / "params.yaml"


def test_the_gpu_study_is_predicted_to_fit_its_slot_from_the_step_benchmark(monkeypatch):
    from pipeline_src.study import estimate

    study = load_study(GPU)
    layout = load_layout(study)
    assert [p.name for p in layout.parts if not p.extension] == ["multi30k", "ptb"] and layout.jobs_per_gpu == 8
    assert sum(len(p.runs) for p in layout.parts) == len(parts.study_runs(study)) == 57
    assert len(study.seeds) >= 3
    assert all(study.cell(t, c).train.lr_grid for t, c, _ in parts.study_runs(study))  # every cell tuned
    monkeypatch.setattr(estimate, "measured_study", lambda study: None)  # as before the study's own run
    predicted = predict_parts(study, layout)
    assert predicted["study_s"] <= layout.study_limit_s == 480
    assert all(sec <= layout.limit_s - 30 for sec in predicted["parts"].values()), predicted["parts"]
    # where the numbers come from, and what is not measured, is said
    assert "bench/results/h100/real_cell_multi30k_cost.json" in predicted["basis"]
    assert "never measured" in predicted["basis"]
    assert "min on one NVIDIA H100 80GB HBM3 in 2 parts" in predicted["text"]
    assert "lr-grid trial jobs" in predicted["text"]


def test_the_study_s_own_runs_predict_at_the_jobs_at_once_they_were_measured_at():
    """reports/reference/h100: the study ran with 2 jobs at once (Snakemake had 2 cores), not 8.
    Its runs' seconds hold at 2 at once; the prediction says so, and the core parts fit the target
    at that pace; the extension parts are predicted beside them, outside the target."""
    study = load_study(GPU)
    layout = load_layout(study)
    timing = json.loads((ROOT / "reports/reference/h100/timing.json").read_text())
    assert [p["job_slots_used"] for p in timing["parts"]] == [2, 2]
    predicted = predict_parts(study, layout)
    assert "with at most 2 (multi30k_en_de), 2 (ptb) jobs at once" in predicted["basis"]
    assert "8 jobs sharing the GPU never measured" in predicted["basis"]
    core = [p.name for p in layout.parts if not p.extension]
    assert predicted["study_s"] == pytest.approx(sum(predicted["parts"][n] for n in core), abs=0.2)
    assert predicted["study_s"] <= layout.study_limit_s - 20, predicted["parts"]  # with margin, at the measured pace
    assert "past the study's target" not in predicted["text"] and "past the part limit" not in predicted["text"]
    assert "then, only if the slot has time left, extension parts: multi30k-seeds" in predicted["text"]
    # the node's own prediction, made before the run, stays beside the measurement
    assert [p["predicted_s"] for p in timing["parts"]] == [186.8, 224.0]


def test_extension_parts_come_last_and_are_outside_the_target(tmp_path):
    layout = load_layout(_study(tmp_path, "study: lay\nstudy_limit_s: 60\nparts:\n  - {name: first, seeds: [0]}\n"
                                          "  - {name: rest, extension: true}\n"))
    assert [(p.name, p.extension) for p in layout.parts] == [("first", False), ("rest", True)]
    with pytest.raises(ConfigError, match=r"parts\[1\] \(b\): a core part after an extension part"):
        load_layout(_study(tmp_path, "study: lay\nparts:\n  - {name: a, seeds: [0], extension: true}\n  - {name: b}\n"))
    with pytest.raises(ConfigError, match=r"parts\[0\]\.extension: true or false"):
        load_layout(_study(tmp_path, "study: lay\nparts:\n  - {name: a, extension: maybe}\n"))


def test_parts_predict_prints_the_parts_and_plan_is_its_former_name(capsys):
    from pipeline_src.__main__ import _parser

    study = load_study(GPU)
    args = [None, None, [], None, None, None, None, None]  # part, out, archives, reference, started, status, log, gpu_util
    assert parts.run(study, "predict", *args) == 0
    predicted = capsys.readouterr()
    assert predicted.out.startswith("study gpu: 57 runs in 7 parts") and "predicted" in predicted.out
    assert predicted.err == ""
    assert _parser().parse_args(["parts", "plan"]).action == "plan"  # still accepted, with a note
    assert parts.run(study, "plan", *args) == 0
    again = capsys.readouterr()
    assert again.out == predicted.out and again.err == "note: `parts plan` is now `parts predict`\n"


def test_slots_per_task_come_from_each_part_and_the_fewest_holds(tmp_path):
    from pipeline_src.study.estimate import _slots_per_task

    study = _study(tmp_path, "study: lay\nparts:\n  - {name: first, seeds: [0]}\n  - {name: rest}\n")
    timing = tmp_path / "timing.json"
    assert _slots_per_task(study, timing) == {}
    timing.write_text(json.dumps({"parts": [{"part": "first", "job_slots_used": 4},
                                            {"part": "rest", "job_slots_used": 2}]}))
    assert _slots_per_task(study, timing) == {"reorder": 2}
    timing.write_text(json.dumps({"parts": [{"part": "first", "job_slots_used": None}]}))
    assert _slots_per_task(study, timing) == {}


def _study(tmp_path, layout: str | None, name="lay"):
    params = yaml.safe_load((ROOT / "tests/fixtures/params/valid_tiny.yaml").read_text())
    params["study"] = name
    params["seeds"] = [0, 1]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    if layout is not None:
        (tmp_path / "parts.yaml").write_text(layout)
    return load_study(tmp_path / "params.yaml")


def test_without_a_parts_file_each_task_is_a_part(tmp_path):
    layout = load_layout(_study(tmp_path, None))
    assert [(p.name, len(p.runs)) for p in layout.parts] == [("reorder", 4)] and layout.path is None
    # a parts file for another study is not this study's
    layout = load_layout(_study(tmp_path, "study: other\nparts: [{name: x, tasks: [reorder], seeds: [0]}]\n"))
    assert [p.name for p in layout.parts] == ["reorder"]


def test_parts_split_by_seed_and_cell(tmp_path):
    layout = load_layout(_study(tmp_path, "study: lay\nparts:\n  - {name: first, seeds: [0]}\n"
                                          "  - {name: pe, cells: [pe_none]}\n  - {name: rest}\n"))
    assert [[r[1:] for r in p.runs] for p in layout.parts] == [
        [("baseline", 0), ("pe_none", 0)], [("pe_none", 1)], [("baseline", 1)]]
    assert parts.archive_name(load_study(tmp_path / "params.yaml"), layout, "pe") == "lay-2-pe.tar.gz"


@pytest.mark.parametrize("layout, message", [
    ("study: lay\nparts:\n  - {name: a, seeds: [0]}\n", "parts: 2 runs are in no part (reorder/baseline/seed1"),
    ("study: lay\nparts:\n  - {name: a, tasks: [nope]}\n", "parts[0].tasks: 'nope' is not an enabled task"),
    ("study: lay\nparts:\n  - {name: a}\n  - {name: b}\n", "parts[1] (b): no run left for it"),
    ("study: lay\nparts:\n" + "".join(f"  - {{name: p{i}}}\n" for i in range(9)), "9 parts; at most 8"),
    ("study: lay\nlimits: 3\nparts:\n  - {name: a}\n", "unknown key 'limits'"),
    ("study: lay\nlimit_s: -1\nparts:\n  - {name: a}\n", "limit_s: a positive number is needed"),
    ("study: lay\nparts:\n  - {name: A b}\n", "parts[0].name: a name of a-z"),
])
def test_a_wrong_parts_file_is_one_line_naming_the_key(tmp_path, layout, message):
    with pytest.raises(ConfigError) as err:
        load_layout(_study(tmp_path, layout))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_attention_samples_weights_round_trip_within_their_precision():
    import torch

    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "b": torch.randn(64), "steps": torch.tensor(3)}
    for precision, tolerance in (("fp32", 0.0), ("fp16", 1e-3), ("int8", 1 / 127)):
        back = parts._decode_weights(parts._encode_weights(state, precision))
        assert back["w"].dtype == torch.float32 and back["steps"].item() == 3
        scale = state["w"].abs().amax(dim=1, keepdim=True)
        assert ((back["w"] - state["w"]).abs() <= tolerance * scale + 1e-7).all(), precision


def test_a_partial_reports_params_keep_what_came_back(tmp_path, monkeypatch):
    """PTB did not come back, and one seed of a Multi30k cell: the derived study keeps Multi30k
    without that cell, and only the claims and references that need nothing missing."""
    monkeypatch.chdir(tmp_path)
    study = load_study(GPU)
    missing = [r for r in parts.study_runs(study) if r[0] == "ptb"] + [("multi30k_en_de", "heads_16", 2)]
    rows = [{"task": t, "cell": c, "seed": s, "reason": "x"} for t, c, s in missing]
    path, kept, dropped = parts._partial_params(study, missing, rows)
    derived = load_study(path)
    assert list(derived.tasks) == ["multi30k_en_de"] and "heads_16" not in derived.tasks["multi30k_en_de"].cells
    assert len(derived.tasks["multi30k_en_de"].cells) == 7 and derived.seeds == study.seeds
    claims = set(derived.raw["claims"])
    assert "heads_vaswani" not in claims and "heads_seed003" not in claims and "pe_none_hurts" not in claims
    assert {"pe_learned_same", "label_smoothing", "smaller_d_model", "decoder_only_small_data"} <= claims
    assert all(r["task"] == "multi30k_en_de" and r.get("cell") != "heads_16" for r in derived.raw["references"])
    assert "(PARTIAL: 23 of 57 runs)" in derived.report["title"]
    assert derived.raw["description"].startswith("PARTIAL REPORT: 34 of the study's 57 runs did not come back")
    assert "multi30k_en_de/heads_16 seed 2" in derived.raw["description"]
    assert kept == "multi30k_en_de (7 of 8 cells)" and dropped.startswith("task ptb, claims ")


def test_archives_of_a_params_file_whose_comments_changed_since_are_accepted(tmp_path, monkeypatch):
    """parts build checks each archive's params file by its hash; a file whose settings are the same
    at the archive's commit (only comments changed since) is the same study, another is not."""
    import hashlib
    import subprocess

    from pipeline_src.node.parts import _same_settings

    monkeypatch.chdir(tmp_path)
    study = _study(tmp_path, None)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(git + ["add", "params.yaml"], check=True)
    subprocess.run(git + ["commit", "-qm", "p"], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    then = (tmp_path / "params.yaml").read_bytes()
    rec = {"git_commit": commit, "params_file": "params.yaml", "params_sha256": hashlib.sha256(then).hexdigest()}
    (tmp_path / "params.yaml").write_bytes(b"# ran once since\n" + then)
    assert _same_settings(study, rec)
    (tmp_path / "params.yaml").write_text(then.decode().replace("seeds:\n- 0\n- 1", "seeds:\n- 0\n- 2"))
    assert "- 2" in (tmp_path / "params.yaml").read_text()
    assert not _same_settings(study, rec)
    assert not _same_settings(study, dict(rec, git_commit="0" * 40))
