"""Which arithmetic a run computes in: bf16 autocast or fp32.

`train.precision` (and the evaluation, which follows the cell's train section):
  auto  bf16 autocast on a GPU, and on a CPU whose cores multiply bf16 natively (x86 AVX512-BF16
        or AMX-BF16, Arm BF16); fp32 on every other CPU, where bf16 would be emulated and slower;
  bf16  bf16 autocast wherever the run is (emulated on CPUs without the instructions);
  fp32  no autocast.
Under autocast, matrix products run in bf16 with fp32 accumulation; LayerNorm, softmax and the
loss stay in fp32, and the weights and optimiser state are fp32 throughout.

The CPU check reads the instruction-set flags the kernel reports (/proc/cpuinfo); it is never a
timing, so the same machine always makes the same choice. PIPELINE_CPU_BF16=1 or 0 overrides
it (to test the bf16 path on any CPU, or to keep a bf16 machine on fp32). The choice is written
to cost.json ("precision"), and CPU runs stay bit-for-bit deterministic under either.
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FEATURE = "bf16"


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    forced = os.environ.get("PIPELINE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flag to read, so no bf16 by default
        return False
    return cpuinfo_says_bf16(cpuinfo, platform.machine())


def cpuinfo_says_bf16(cpuinfo: str, machine: str) -> bool:
    """Whether /proc/cpuinfo's text lists native bf16 instructions (x86 "flags", Arm "Features")."""
    words = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    if machine.lower() in ("aarch64", "arm64"):
        return ARM_BF16_FEATURE in words
    return any(flag in words for flag in X86_BF16_FLAGS)


def uses_bf16(device: torch.device, precision: str) -> bool:
    if precision == "fp32":
        return False
    if precision == "bf16":
        return True
    if precision != "auto":
        raise ValueError(f"train.precision: {precision!r} is not one of auto, bf16, fp32")
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def autocast(device: torch.device, precision: str):
    """The autocast context a forward pass runs in (a disabled one for fp32)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=uses_bf16(device, precision))


def name(device: torch.device, precision: str) -> str:
    """How cost.json and the report name the arithmetic of a run."""
    return "bf16-autocast" if uses_bf16(device, precision) else "fp32"
