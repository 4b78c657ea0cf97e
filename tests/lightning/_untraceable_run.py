"""Launched by tests/lightning/test_trace_error_once.py: fit a model with a Python branch on a
tensor on WORLD ranks, uncaught, as a user's script would (its output is what is checked).

    python tests/lightning/_untraceable_run.py WORLD
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._stack import import_the_stack  # noqa: E402

import_the_stack()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402


class Branchy(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent Python control flow: neither tracer captures it
            h = h * 2
        return self.b(h)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    world = int(sys.argv[1])
    data = TensorDataset(torch.randn(16, 4))
    trainer = pl.Trainer(strategy=lightning_autopipe.AutoPipeStrategy(),
                         accelerator="cpu", devices=world, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Branchy(), DataLoader(data, batch_size=8))
