"""What decides a run's floats on this machine: the facts a reproducibility check compares.

Two CPUs with the same model name can compute different bytes: torch picks its kernels by the
instruction sets the CPU has (ATen's CPU capability: DEFAULT, AVX2 or AVX512; oneDNN and MKL
choose their own code paths from the instruction sets and the vendor), and the versions of torch
and numpy and the number of threads change the order of additions. A run records these facts
(cost.json, "machine"); `check-reference` expects identical bytes only where all of them match.

The environment can force lower kernels on a machine that has higher ones (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2): they are recorded too, so that a run made
that way is another machine kind than the same CPU with its own kernels.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

# CPU flags (/proc/cpuinfo) that torch, oneDNN or MKL use to choose a kernel.
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# Environment variables that lower the kernels a library chooses.
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
              "MKL_DEBUG_CPU_TYPE")
# The facts that must all match for identical bytes to be expected (the CPU's model name is
# recorded but not compared: one name covers CPUs with and without AVX-512).
COMPARED = ("device", "vendor", "kernel_flags", "aten_capability", "kernel_env", "threads", "torch", "numpy", "precision")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def facts(precision: str, device: str = "cpu") -> dict:
    """This process's machine facts, as a run records them (`device`: "cpu" or the GPU's name)."""
    import numpy
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "device": device,
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "vendor": info.get("vendor_id") or platform.machine(),
        "kernel_flags": [f for f in KERNEL_FLAGS if f in flags],
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "precision": precision,
    }


def legacy_facts(cost: dict, info: dict) -> dict:
    """What a run made before runs recorded their machine facts says of its machine."""
    return {"cpu": cost.get("device_name"), "precision": cost.get("precision"),
            "torch": info.get("provenance", {}).get("versions", {}).get("torch")}


def differences(reference: dict, run: dict) -> list[str]:
    """The compared facts in which two machines differ ("fact: reference -> run"); a fact the
    reference does not record counts as a difference (nothing says it matches)."""
    out = []
    for key in COMPARED:
        a, b = reference.get(key, "not recorded"), run.get(key, "not recorded")
        if a != b or a == "not recorded":
            out.append(f"{key}: {a} -> {b}")
    return out


def describe(f: dict) -> str:
    flags = f.get("kernel_flags")
    isa = ("/".join(flags) if flags else "none") if flags is not None else "not recorded"
    env = f.get("kernel_env") or {}
    forced = (", forced " + " ".join(f"{k}={v}" for k, v in env.items())) if env else ""
    return (f"{f.get('cpu')} ({f.get('vendor', 'vendor not recorded')}; kernel flags {isa}; ATen "
            f"{f.get('aten_capability', 'not recorded')}{forced}; {f.get('threads', '?')} threads; torch "
            f"{f.get('torch')}, numpy {f.get('numpy', 'not recorded')}; {f.get('precision')})")
