"""A small regression task on the engine, for testing the trainer without a real model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from atelier_studio.pipeline.task import Task


class ToyLoader:
    """Deterministic micro-batches of varying size (so token weighting matters), with a cursor."""

    def __init__(self, seed: int, sizes=(1, 5, 2, 7, 3)):
        self.seed = seed
        self.sizes = sizes
        self.cursor = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.cursor)
        n = self.sizes[self.cursor % len(self.sizes)]
        self.cursor += 1
        x = torch.randn(n, 8, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
        return {"x": x, "y": y}


class ToyTask(Task):
    unit = "tokens"
    def __init__(self, seed: int = 0, dropout: float = 0.1, hidden: int = 0):
        """`hidden` > 0 adds a hidden linear of that width (Muon's; 64 x 64 is large enough for torchao's low-bit
        states, which keep tensors under 4096 values in fp32)."""
        if hidden:
            self.model = nn.Sequential(nn.Linear(8, hidden), nn.Dropout(dropout), nn.Tanh(), nn.Linear(hidden, hidden),
                                       nn.Tanh(), nn.Linear(hidden, 1))
            self.outer_layers = ("0.", "5.")  # the input and output linears: AdamW's under Muon
        else:
            self.model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(dropout), nn.Tanh(), nn.Linear(16, 1))
            self.outer_layers = ("0.", "3.")
        self.loader = ToyLoader(seed)
        self.exported = False

    def train_batches(self):
        return self.loader

    def batch_weight(self, batch) -> int:
        return batch["x"].shape[0]

    def batch_units(self, batch) -> int:
        return batch["x"].shape[0]

    def batch_flops(self, batch) -> int:
        return 6 * batch["x"].shape[0] * (8 * 16 + 16)

    def loss_sum(self, batch) -> torch.Tensor:
        return ((self.model(batch["x"]) - batch["y"]) ** 2).sum()

    def evaluate(self) -> dict[str, float]:
        g = torch.Generator().manual_seed(999)
        x = torch.randn(32, 8, generator=g)
        return {"loss": float(((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean())}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict[str, Any]:
        return {"cursor": self.loader.cursor}

    def load_state(self, tensors, meta) -> None:
        self.loader.cursor = meta["cursor"]

    def export(self, out_dir: Path) -> dict[str, Path]:
        self.exported = True
        path = Path(out_dir) / "toy.txt"
        path.write_text("ok")
        return {"toy": path}
