"""Launched by tests/lightning/test_exported_modes.py: a BatchNorm CNN captured with torch.export.

    run by tests/_world.py in the shared 2-rank world: run_case(CASE, 2, OUT_DIR)

The module's forward peeks at its output (``out.logits if hasattr(out, "logits") else out``,
code written for Hugging Face outputs and tensors alike): ``hasattr`` is true of every torch.fx
proxy, so fx's graph fails where the model runs and the strategy captures the model with
torch.export, whose graph holds BatchNorm's mode as constants. Two ranks, a fixed plan (2
stages, one micro-batch, no slices: BatchNorm normalises the whole batch, as one process
does), ``STEPS`` training steps, then two validations. Every rank writes
``OUT_DIR/<case>.rank<r>.pt``: the training losses and batches, both validation losses, its
stage's state
and whether its stage reads its own ``self.training``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402

BATCH, STEPS, VAL_BATCHES, LR = 8, 3, 2, 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        out = self.fc(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))
        return out.logits if hasattr(out, "logits") else out


class Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def data(batches: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = batches * BATCH
    return DataLoader(TensorDataset(torch.randn(n, 3, 6, 6, generator=g) * 2 + 1,
                                    torch.randint(0, 10, (n,), generator=g)), batch_size=BATCH)


def plan() -> Plan:
    n = len(split_model(Task(), (torch.zeros(2, 3, 6, 6),)))
    return Plan("fixed", BATCH, 1, 1, [StagePlan((0, n // 2), ["local:0"]),
                                       StagePlan((n // 2, n), ["local:1"])])


class Losses(pl.Callback):
    """Each step's loss and batch (the sampler's order, which the reference trains on)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.batches.append([t.clone() for t in batch])


def run_case(case: str, world: int, out: Path) -> dict:
    assert (case, world) == ("batchnorm", 2), "one case, on the 2-rank world"
    losses = Losses()
    trainer = pl.Trainer(strategy=lightning_autopipe.AutoPipeStrategy(plan=plan(), timeout=120),
                         accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(out / "root"), callbacks=[losses])
    task = Task()
    trainer.fit(task, data(STEPS, seed=1))
    validated = [trainer.validate(task, data(VAL_BATCHES, seed=2), verbose=False)[0]["val_loss"]
                 for _ in range(2)]
    stage = next(iter(trainer.strategy.pipeline.executor.chunks.values()))
    return {"losses": losses.losses, "batches": losses.batches, "validated": validated,
            "state": {k: v.detach().clone() for k, v in task.state_dict().items()},
            "reads_its_mode": "self.training" in getattr(stage, "code", ""),
            "stage": trainer.strategy.pipeline.layout.stage}
