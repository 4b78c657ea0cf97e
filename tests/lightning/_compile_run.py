"""Launched by tests/lightning/test_compile.py: the same 2-stage run eager and compiled.

    run by tests/_world.py in the shared 2-rank world: run_case(CASE, 2, OUT_DIR)

Two ranks, a fixed 1F1B plan (blocks 0-3 | 4-6 of the tiny GPT whose LM head is tied to its
embedding, so the tie spans the stages), two micro-batches of 4, the first in two startup
slices; an epoch of 19 samples in batches of 8 (the last batch of 3 runs as units of 1 and 2),
then a validation of 9 samples (8, then 1). Cases ``eager`` and ``compiled``
(``compile=True``: inductor), and ``compiled-zb``: compiled under ZB-H1 (the same plan with a
split backward); ``eager-zbv`` and ``compiled-zbv``: ZB-V with four chunks, two per rank
(:func:`plan`), each chunk compiled on its own. Every rank writes
``OUT_DIR/<case>.rank<r>.pt`` (the step losses, the validation loss, its stage's weights and,
compiled, how many graphs its stage compiled after training and after validation); rank 0's
checkpoint is ``OUT_DIR/<case>.ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from tests.reliability import _task as T  # noqa: E402

CUT, BLOCKS, BATCH = 4, 7, 8
TRAIN_SAMPLES, VAL_SAMPLES = 19, 9


class Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = T.build_net()
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        return T.lm_loss(outputs, batch)

    def training_step(self, batch, batch_idx):  # Lightning's check; the strategy runs the above
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):  # likewise: the strategy logs val_loss
        return self.pipeline_loss(self(batch[0]), batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def plan(schedule: str = "1f1b") -> Plan:
    """Two stages; under ``"zbv"`` four chunks in V placement (rank 0: blocks 0-1 and 6, with
    the tied embedding and head; rank 1: blocks 2-5)."""
    if schedule == "zbv":
        cuts, rows = [0, 2, 4, 6, BLOCKS], ["local:0", "local:1", "local:1", "local:0"]
        stages = [StagePlan((cuts[c], cuts[c + 1]), [rows[c]]) for c in range(4)]
        return Plan("fixed", BATCH, 2, 2, stages, schedule="zbv", chunks_per_rank=2,
                    placement="v")
    stages = [StagePlan((0, CUT), ["local:0"]), StagePlan((CUT, BLOCKS), ["local:1"])]
    return Plan("fixed", BATCH, 2, 2, stages, schedule=schedule)


def _per_chunk(executor, what: str):
    """``what`` of the executor's module, or of each chunk's (several chunks per rank)."""
    if len(executor.chunks) == 1:
        return getattr(executor.stage, what, None)
    return {c: getattr(m, what, None) for c, m in executor.chunks.items()}


def run_case(case: str, world: int, out: Path) -> None:
    assert world == 2, "the compile cases run on the 2-rank world"
    schedule = {"zb": "zb-h1", "zbv": "zbv"}.get(case.rpartition("-")[2], "1f1b")
    strategy = lightning_autopipe.AutoPipeStrategy(plan=plan(schedule), timeout=300,
                                                   compile=case.startswith("compiled"))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(out / "root"))
    task = Task()
    train = DataLoader(T.dataset(TRAIN_SAMPLES, seed=1), batch_size=BATCH)
    val = DataLoader(T.dataset(VAL_SAMPLES, seed=2), batch_size=BATCH)
    trainer.fit(task, train)
    executor = trainer.strategy.pipeline.executor
    stage = next(iter(executor.chunks.values()))
    after_fit = _per_chunk(executor, "compilations")
    actions = sorted({a.kind.name for a in executor.trace})
    validated = trainer.validate(task, val, verbose=False)
    trainer.save_checkpoint(out / f"{case}.ckpt")
    deferral = _per_chunk(executor, "deferral")
    torch.save({
        "losses": task.losses,
        "val_loss": validated[0]["val_loss"],
        "state": {k: v.detach().clone() for k, v in task.state_dict().items()},
        "compiled_class": type(stage).__name__,
        "compilations_after_fit": after_fit,
        "compilations_after_validate": _per_chunk(executor, "compilations"),
        "compiled_shapes": _per_chunk(executor, "compiled_shapes"),
        "deferral": {c: None if d is None else (d.split, d.unsplit) for c, d in deferral.items()}
        if isinstance(deferral, dict) else None if deferral is None else (
            deferral.split, deferral.unsplit),
        "actions": actions,  # of the last training step
    }, out / f"{case}.rank{trainer.global_rank}.pt")
