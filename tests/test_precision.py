"""CPU precision and allocator: bf16 autocast where the CPU has bf16 units (detected from the
kernel's flags), deterministic either way; large freed buffers kept by the process."""
import json
import subprocess
import sys

import pytest
import torch

from pipeline_src.train import precision
from pipeline_src.study.stages import output_path
from project_copy import checkout_env

AMD_ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
INTEL_NO_BF16 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics dotprod\n"


@pytest.mark.parametrize("cpuinfo, machine, expected", [
    (AMD_ZEN4, "x86_64", True), (INTEL_NO_BF16, "x86_64", False), (SAPPHIRE_RAPIDS, "x86_64", True),
    (GRAVITON3, "aarch64", True), (GRAVITON2, "aarch64", False), ("", "x86_64", False)])
def test_bf16_is_read_from_the_cpu_flags(cpuinfo, machine, expected):
    assert precision.cpuinfo_says_bf16(cpuinfo, machine) is expected


@pytest.mark.parametrize("forced, cpu_precision", [("1", "bf16-autocast"), ("0", "fp32")])
def test_auto_follows_the_cpu_and_fp32_bf16_are_what_they_say(monkeypatch, forced, cpu_precision):
    monkeypatch.setenv("PIPELINE_CPU_BF16", forced)
    precision.cpu_has_native_bf16.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert precision.name(cpu, "auto") == cpu_precision
        assert precision.name(cpu, "fp32") == "fp32"
        assert precision.name(cpu, "bf16") == "bf16-autocast"  # asked for: emulated if need be
        assert precision.name(torch.device("cuda"), "auto") == "bf16-autocast"
        with precision.autocast(cpu, "auto"):
            out = torch.nn.Linear(8, 8)(torch.randn(2, 8))
        assert out.dtype == (torch.bfloat16 if forced == "1" else torch.float32)
    finally:
        precision.cpu_has_native_bf16.cache_clear()


def _stage(d, env, *args):
    return subprocess.run([sys.executable, "-m", "pipeline_src", *args, "--params", "tiny.yaml"], cwd=d, env=env,
                          check=True, capture_output=True, text=True)


def test_cpu_bf16_training_and_evaluation_are_bit_for_bit_deterministic(tmp_path):
    """Same seed, bf16 autocast on the CPU (forced, so it runs on any CPU): same metric bytes twice;
    and the run really computed in bf16 (its numbers differ from the fp32 run's)."""
    from test_train import _write_params
    _write_params(tmp_path, max_steps=30, eval_every=10, log_every=10)
    env = checkout_env(PIPELINE_CPU_THREADS="1")
    for stage, arg in [("download", ["--dataset", "tiny_reorder"]), ("filter", ["--task", "reorder"]),
                       ("bpe", ["--task", "reorder"])]:
        _stage(tmp_path, env, stage, *arg)
    path_fields = dict(study="tiny", task="reorder", cell="baseline", seed=0)
    job = ["--task", "reorder", "--cell", "baseline", "--seed", "0"]
    runs = []
    for forced in ("1", "1", "0"):
        env["PIPELINE_CPU_BF16"] = forced
        _stage(tmp_path, env, "train", *job)
        _stage(tmp_path, env, "evaluate", *job)
        cost = json.loads((tmp_path / output_path("train", "cost", **path_fields)).read_text())
        runs.append(((tmp_path / output_path("train", "metrics", **path_fields)).read_bytes(),
                     (tmp_path / output_path("evaluate", "metrics", **path_fields)).read_bytes(), cost["precision"],
                     cost["allocator"]))
    assert [r[2] for r in runs] == ["bf16-autocast", "bf16-autocast", "fp32"]
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][0] != runs[2][0]
    assert {r[3] for r in runs} == {"glibc-keep"}


FAULTS_SCRIPT = """
import resource
from pipeline_src.runtime.allocator import keep_freed_memory
applied = keep_freed_memory()
import torch
torch.set_num_threads(1)
faults = []
for step in range(12):  # a training step's large buffers (activations, logits, gradients), made and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.ones(mb * 2**18) for mb in (64, 16, 48, 32, 8)]
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[-6:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_freed_buffers_are_reused_not_faulted_back_in():
    """Steps that allocate and free the same 168 MB of large buffers: once the heap has grown, the
    process reuses it (no page faults in the last six steps); with the system's defaults every
    step maps its buffers afresh and faults their ~43k pages in again."""
    out = {}
    for mode in ("keep", "system"):
        env = checkout_env(PIPELINE_MALLOC=mode)
        proc = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], env=env, capture_output=True, text=True, check=True)
        applied, faults = proc.stdout.split()
        out[mode] = (applied, int(faults))
    pages_per_step = (168 << 20) // 4096
    assert out["keep"][0] == "True" and out["keep"][1] < pages_per_step, out
    assert out["system"][0] == "False" and out["system"][1] > 6 * pages_per_step // 2, out
