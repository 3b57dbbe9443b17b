"""AdamW (Loshchilov & Hutter 2019): Adam with weight decay applied to the weights directly.

The arithmetic is torch.optim.AdamW's multi-tensor ("foreach") path, operation for operation, so
the two give the same weights bit for bit (tests/test_optim.py). Why not use torch's class:
constructing any torch.optim optimiser imports torch._dynamo, 1.3-1.6 s of every training job on
a CPU, which is a fifth of a demo job and several minutes of a demo study. The learning rate is a
plain attribute the training loop sets before each step (the schedule is a function of the step
number: train.learning_rate), and the step count is a Python int, so a step never reads a value
back from the GPU.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class AdamW:
    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        # Per parameter: steps taken (a parameter without a gradient in a step is skipped, as in
        # torch), first and second moment estimates.
        self.steps = [0] * len(self.params)
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    def zero_grad(self) -> None:
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
