"""How fast this machine is right now, on a fixed piece of work: for `slow_cores.py --probe`.

    .venv/bin/python .ci/speed_probe.py        -> prints the probe's seconds

A cloud VM's speed drifts from hour to hour (on the 2-core Xeon of the CI rehearsals the same CI
took 10-15 % less time one hour than the hour before). An emulated slower runner defined as
"this machine at a fraction S of its speed" drifts with it. This probe times a fixed mix of the
work CI does, on both cores at once (one process per core): small one-thread torch steps
(matmuls, softmax, backward: the training jobs) and pure-Python work (parsing and writing
nested data, the drivers' and the tests' share). It depends on nothing of this repository, so
its figure stays comparable across versions. About 6.5 s at full speed on that Xeon.
"""
import json
import multiprocessing
import time

TORCH_STEPS = 3000
PYTHON_ROUNDS = 150


def _torch_part() -> None:
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    w1 = torch.randn(256, 256, generator=g, requires_grad=True)
    w2 = torch.randn(256, 256, generator=g, requires_grad=True)
    for _ in range(TORCH_STEPS):
        h = torch.relu(x @ w1)
        att = torch.softmax(h @ h.T / 16.0, dim=-1) @ h
        loss = (att @ w2).square().mean()
        loss.backward()
        with torch.no_grad():
            w1 -= 1e-6 * w1.grad
            w2 -= 1e-6 * w2.grad
            w1.grad = None
            w2.grad = None


def _python_part() -> None:
    doc = {f"stage{i}": {"cmd": f"python -m pipeline_src train --cell c{i}",
                         "deps": [{"path": f"pipeline_src/m{j}.py", "md5": f"{i * j:032x}", "size": i + j}
                                  for j in range(12)],
                         "params": {"lr": 0.001 * i, "layers": [1, 2, 3], "name": "x" * (i % 7)}}
           for i in range(300)}
    for _ in range(PYTHON_ROUNDS):
        text = json.dumps(doc, indent=2, sort_keys=True)
        back = json.loads(text)
        assert len(back) == len(doc)
        lines = sorted(line.strip() for line in text.splitlines())
        assert lines
        doc = {k: dict(v, n=len(lines)) for k, v in back.items()}


def _work(_: int) -> None:
    _torch_part()
    _python_part()


def probe(cores: int = 2) -> float:
    """Wall seconds for one copy of the work on each of `cores` cores at once."""
    import torch  # noqa: F401  (imported before the clock starts, in the children too by fork)

    ctx = multiprocessing.get_context("fork")
    t0 = time.perf_counter()
    with ctx.Pool(cores) as pool:
        pool.map(_work, range(cores))
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"{probe():.2f}")
