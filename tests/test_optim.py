"""Our AdamW against torch.optim.AdamW: same arithmetic, so the same weights bit for bit."""
import subprocess
import sys

import pytest
import torch

from pipeline_src.train.optim import AdamW


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 11))


def _loss(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 11, (4, 5), generator=g)
    y = torch.randint(0, 11, (4, 5), generator=g)
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adamw_matches_torch_bit_for_bit(weight_decay):
    ours_model, ref_model = _model(0), _model(0)
    ours = AdamW(ours_model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9,
                            weight_decay=weight_decay, foreach=True)
    for step in range(1, 8):
        lr = 1e-3 * min(step / 3, (3 / step) ** 0.5)  # warm-up then decay, as in training
        ours.lr = lr
        for group in ref.param_groups:
            group["lr"] = lr
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), f"step {step}: weights differ by {(a - b).abs().max().item():.3g}"


def test_parameter_without_gradient_is_left_alone():
    model = _model(1)
    frozen_before = model[4].weight.detach().clone()
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model[0](torch.tensor([[1, 2]])).sum().backward()  # only the embedding gets a gradient
    opt.step()
    assert torch.equal(model[4].weight, frozen_before)
    assert opt.steps[0] == 1 and opt.steps[-1] == 0


def test_state_dict_round_trip_continues_identically():
    a_model, b_model = _model(2), _model(2)
    a = AdamW(a_model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(3):
        a.zero_grad()
        _loss(a_model, step).backward()
        a.step()
    b_model.load_state_dict(a_model.state_dict())
    b = AdamW(b_model.parameters(), lr=0.0)
    b.load_state_dict(a.state_dict())
    b.betas, b.eps, b.weight_decay = a.betas, a.eps, a.weight_decay
    for model, opt in ((a_model, a), (b_model, b)):
        opt.zero_grad()
        _loss(model, 9).backward()
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a_model.parameters(), b_model.parameters()))


def test_training_job_does_not_import_dynamo():
    """The reason this class exists: torch.optim imports torch._dynamo (seconds per job)."""
    code = ("import sys, torch; from pipeline_src.train.optim import AdamW; m = torch.nn.Linear(2, 2); "
            "o = AdamW(m.parameters(), lr=0.1); m(torch.ones(1, 2)).sum().backward(); o.step(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
