"""A trained model back from a train stage's ckpt/ directory (evaluation, figures, benchmarks)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..common import reading
from .config import ModelConfig
from .transformer import Transformer


def load_trained_model(ckpt_dir, device="cpu", which: str | None = None):
    """(model in eval mode, meta) from a train stage's ckpt/ directory."""
    ckpt_dir = Path(ckpt_dir)
    if which is None:
        which = "averaged.pt" if (ckpt_dir / "averaged.pt").exists() else "best.pt"
    with reading(ckpt_dir / which):
        blob = torch.load(ckpt_dir / which, map_location="cpu", weights_only=True)
    meta = blob["meta"]
    cfg = ModelConfig(**meta["model_config"])
    model = Transformer(cfg)
    model.load_state_dict(blob["model"])
    return model.to(device).eval(), meta
