"""Launched by tests/lightning/test_dict_batch.py: a dict batch whose labels ride beside the inputs.

    run by tests/_world.py in the shared 2-rank world: run_case(CASE, 2, OUT_DIR)

Hugging Face style: every batch is ``{"input_ids", "attention_mask", "labels"}`` and forward
takes ``(input_ids, attention_mask)``; the strategy gives forward the entries that name its
parameters and the steps read ``labels`` from the batch. Two ranks, a fixed plan (2 stages,
two micro-batches, the first in two startup slices: the dict is sliced per unit), ``STEPS``
SGD steps. Every rank writes ``OUT_DIR/<case>.rank<r>.pt``: the losses, the batches and its
stage's weights.
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
from torch.utils.data import DataLoader  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402

BATCH, STEPS, SEQ, VOCAB, LR = 8, 3, 6, 32, 0.5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(
            16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mix(self.emb(input_ids))) * attention_mask[..., None]
        return self.head(h)


class Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, input_ids, attention_mask):
        return self.net(input_ids, attention_mask)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        return loss_of(logits, batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = (torch.rand(n, SEQ, generator=g) > 0.2).long()
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i].roll(-1)}
            for i in range(n)]


def plan() -> Plan:
    example = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long),
               "attention_mask": torch.ones(2, SEQ, dtype=torch.long)}
    n = len(split_model(Task(), example))
    return Plan("fixed", BATCH, 2, 2, [StagePlan((0, n // 2), ["local:0"]),
                                       StagePlan((n // 2, n), ["local:1"])])


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.batches.append({k: v.clone() for k, v in batch.items()})


def run_case(case: str, world: int, out: Path) -> dict:
    assert (case, world) == ("labels", 2), "one case, on the 2-rank world"
    record = Record()
    trainer = pl.Trainer(strategy=lightning_autopipe.AutoPipeStrategy(plan=plan(), timeout=120),
                         accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(out / "root"), callbacks=[record])
    task = Task()
    trainer.fit(task, DataLoader(samples(STEPS * BATCH), batch_size=BATCH))
    return {"losses": record.losses, "batches": record.batches,
            "state": {k: v.detach().clone() for k, v in task.state_dict().items()},
            "stage": trainer.strategy.pipeline.layout.stage}
