"""AdamW (Loshchilov & Hutter 2019): Adam with weight decay applied to the weights directly.

On CUDA, training uses torch's fused AdamW kernel (one kernel for all tensors, a fraction of the
memory traffic of separate element-wise ops). On a CPU it uses the class below: torch.optim.AdamW's
multi-tensor ("foreach") arithmetic, operation for operation, so the two give the same weights bit
for bit (tests/test_optim.py). Why not torch's class there too: constructing any torch.optim
optimiser imports torch._dynamo, 1.3-1.6 s of every training job on a CPU, a fifth of a demo job
and over a minute of the demo study. The learning rate is `param_groups[0]["lr"]`, as in torch, set
by the training loop before each step (the schedule is a function of the step number).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def adamw(params: Iterable[Tensor], device: torch.device, lr: float, betas: tuple[float, float], eps: float,
          weight_decay: float):
    """The training optimiser for `device` (see the module doc)."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    return AdamW(params, lr, betas, eps, weight_decay)


class AdamW:
    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.param_groups = [{"lr": lr}]  # the one group; "lr" is what the schedule sets
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        # Per parameter: steps taken (a parameter without a gradient in a step is skipped, as in
        # torch), first and second moment estimates.
        self.steps = [0] * len(self.params)
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.param_groups[0]["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        grads = [self.params[i].grad for i in live]
        exp_avg = [self.exp_avg[i] for i in live]
        exp_avg_sq = [self.exp_avg_sq[i] for i in live]
        for i in live:
            self.steps[i] += 1
        beta1, beta2 = self.betas
        if self.weight_decay:
            torch._foreach_mul_(params, 1 - self.lr * self.weight_decay)
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)                     # m = b1 m + (1 - b1) g
        torch._foreach_mul_(exp_avg_sq, beta2)                              # v = b2 v + (1 - b2) g^2
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
        # Bias correction: p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
        step_size = [(self.lr / (1 - beta1 ** self.steps[i])) * -1 for i in live]
        bc2_sqrt = [(1 - beta2 ** self.steps[i]) ** 0.5 for i in live]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, step_size)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "steps": list(self.steps), "exp_avg": [t.clone() for t in self.exp_avg],
                "exp_avg_sq": [t.clone() for t in self.exp_avg_sq]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["steps"]) != len(self.params):
            raise ValueError(f"optimizer state for {len(state['steps'])} parameters, model has {len(self.params)}")
        self.lr, self.steps = state["lr"], list(state["steps"])
        for mine, saved in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            mine.copy_(saved)
