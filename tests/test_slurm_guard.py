"""The SLURM run's failure lines (pipeline_src/runtime/slurm_guard.py). The full cluster run is
tests/cluster/check_slurm.sh (CI); the last test here uses a live cluster when one is up."""
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipeline_src.runtime import slurm_guard
from pipeline_src.runtime.slurm_guard import sbatch_args

ROOT = Path(__file__).resolve().parent.parent


def _job(name, is_local=False, **resources):
    return SimpleNamespace(name=name, resources=resources, is_local=is_local)


def test_sbatch_args_mirror_the_profile_resources():
    assert sbatch_args({"slurm_partition": "gpu", "runtime": 1440, "mem_mb": 32000, "gpu": 1}) == (
        "-p", "gpu", "-t", "1440", "--mem", "32000", "--gpus=1")
    assert sbatch_args({"gpu": 2, "gpu_model": "a100", "slurm_account": "proj"}) == (
        "-A", "proj", "--gpus=a100:2")
    assert sbatch_args({"slurm_partition": "cpu", "gpu": 0}) == ("-p", "cpu")


def test_profile_asks_for_gpus_the_way_the_plugin_accepts():
    # The plugin refuses --gres/--gpus inside slurm_extra; GPUs come from the rules' gpu resource.
    profile = yaml.safe_load(open(ROOT / "workflow/profiles/slurm/config.yaml"))
    for rule, res in profile["set-resources"].items():
        assert "--gres" not in str(res.get("slurm_extra", "")) and "--gpus" not in str(res.get("slurm_extra", ""))
    assert profile["slurm-status-command"] == "squeue"
    assert {profile["groups"][r] for r in ("train", "evaluate")} == {"cell"}


def test_no_sbatch_is_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SystemExit) as exc:
        slurm_guard.check([_job("train", gpu=1)])
    assert str(exc.value).startswith("error: the SLURM profile needs `sbatch`") and "\n" not in str(exc.value)


def _live_cluster():
    return shutil.which("sbatch") is not None and shutil.which("scontrol") is not None and slurm_guard.controller_up(10)


@pytest.mark.skipif(not _live_cluster(), reason="no live SLURM controller (tests/cluster/slurm_up.sh starts one)")
def test_refused_gpu_request_is_one_line_on_a_live_cluster():
    with pytest.raises(SystemExit) as exc:
        slurm_guard.check([_job("train", gpu=64)])
    assert str(exc.value).startswith("error: SLURM would not run the jobs of rule train (sbatch --gpus=64)")
    assert "\n" not in str(exc.value)
    slurm_guard.check([_job("code", is_local=True, gpu=64)])  # a local rule is never queued, so never refused
