"""torch.compile for the training step, sized so that its warm-up stays short.

Compiling the whole model costs one long compilation per batch shape: 44 s for the first shape
of the Multi30k base model on an H100 host, and a real cell meets 25 shapes at length_buckets 8
(bench/results/h100/README.md). Two settings cut that:

  scope "layers"  (torch's "regional compilation" recipe) compiles one encoder layer and one
                  decoder layer instead of the whole graph. The N identical layers of a stack
                  reuse one compiled graph (their weights are graph inputs), so a compilation
                  covers one layer's forward and backward, not the whole model's. Embeddings
                  and masks stay eager; the loss (fp32 cast, log-softmax, label smoothing) is
                  compiled on its own, so its full-vocabulary intermediates are fused.
  dynamic None    torch's automatic dynamic shapes: the first shape compiles static, the first
                  new shape recompiles with symbolic sizes, and later shapes reuse that graph.
                  Two compilations per region, however many buckets. False = one static
                  compilation per shape (faster kernels, longer warm-up).

`python bench/bench_compile.py` measures the warm-up of each combination (compilations,
seconds) on the machine it runs on. Validation runs eager (`eager()`): its no-grad graphs would
be further compilations for a small share of the time.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..data.tokens import PAD


def token_loss(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
               reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of logits (B, T, V) against target ids (B, T), PAD ignored, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=PAD,
                           label_smoothing=label_smoothing, reduction=reduction)


def compile_mode(compile: bool, compile_on_cpu: bool, cuda_graphs: bool, device_type: str) -> tuple[bool, bool]:
    """(compile the step?, replay it as CUDA graphs?) for train.compile / compile_on_cpu / cuda_graphs
    on this device: a CPU compiles only when asked twice, since its compiled kernels round
    differently and a CPU study's numbers would change with train.compile alone."""
    compiled = compile and (device_type == "cuda" or compile_on_cpu)
    return compiled, compiled and cuda_graphs and device_type == "cuda"


def compile_for_training(model: torch.nn.Module, scope: str = "layers", dynamic: bool | None = None,
                         graphs: bool = False, backend: str = "inductor"):
    """(the callable a training step runs the model through, the loss function to use).

    scope "layers" compiles the model's layers in place (state_dict keys are unchanged, so
    checkpoints are the same); scope "model" wraps the whole model. graphs: torch's
    "reduce-overhead" mode, which replays each compiled region as a CUDA graph per shape."""
    if scope not in ("layers", "model"):
        raise ValueError(f"train.compile_scope: {scope!r} is not one of layers, model")
    mode = "reduce-overhead" if graphs else None
    if dynamic is False:  # one compilation per shape: let every bucket have one
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    if scope == "model":
        return torch.compile(model, dynamic=dynamic, mode=mode, backend=backend), token_loss
    for stack in (s for s in (model.encoder, model.decoder) if s is not None):
        for layer in stack.layers:
            layer.compile(dynamic=dynamic, mode=mode, backend=backend)
    return model, torch.compile(token_loss, dynamic=dynamic, mode=mode, backend=backend)


def eager():
    """A context in which every compiled region runs eagerly (validation inside the train stage)."""
    return torch.compiler.set_stance("force_eager")


def compiled_graphs() -> int:
    """Graphs compiled so far in this process (each compilation adds one)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled (and importing it costs ~1.5 s)
        return 0
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
