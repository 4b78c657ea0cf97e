"""Launched by tests/runtime/test_batchnorm_runs.py: BatchNorm models on real ranks.

    python tests/runtime/_batchnorm_run.py OUT_DIR WORLD CASE [CASE ...]

Lightning's popen launcher re-runs this script in every rank; every rank runs every case in
order and writes ``OUT_DIR/<case>.rank<r>.pt``. Cases:

* ``det-a`` / ``det-b``: ``Trainer(deterministic=True)``, ``seed_everything(0)``, a fresh
  folder each, discovery on and no plan: the same BatchNorm CNN on 2 stages (counts auto).
* ``replicas``: 1 stage x WORLD replicas, 2 micro-batches, the first in 2 startup slices.
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
from tests._recording import RecordingLogger  # noqa: E402
from tests.runtime import _cases as C  # noqa: E402


class BatchNormTask(pl.LightningModule):
    def __init__(self, replicas: int) -> None:
        super().__init__()
        self.net = C.build_net("cnn_bn")
        self.replicas = replicas
        self.step_losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = C.loss_fn(self(batch[0]), batch)
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.step_losses.append(float(loss))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=C.LR)

    def train_dataloader(self):
        data = C.dataset("cnn_bn", C.REPLICA_BATCH * C.STEPS * self.replicas, seed=1)
        return DataLoader(TensorDataset(*data), batch_size=C.REPLICA_BATCH)


def run_case(case: str, world: int, out: Path) -> None:
    deterministic = case.startswith("det")
    if deterministic:
        pl.seed_everything(0, verbose=False)
        strategy = lightning_autopipe.AutoPipeStrategy(num_stages=2, profile_repeats=1)
        replicas = world // 2
    else:
        # even replica batches, as the reference deals them (noisy profiles of alike ranks
        # on a busy machine could plan uneven ones: those have their own tests)
        strategy = lightning_autopipe.AutoPipeStrategy(
            num_stages=1, num_microbatches=2, startup_slices=2, drain_slices=1,
            profile_repeats=1, balance_replicas=False)
        replicas = world
    task = BatchNormTask(replicas)
    logger = RecordingLogger()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1,
                         deterministic=deterministic, logger=logger, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, default_root_dir=out / case)
    trainer.fit(task)
    torch.use_deterministic_algorithms(False)
    record = {
        "case": case, "rank": trainer.global_rank, "losses": task.step_losses,
        "logged": logger.rows, "plan": trainer.strategy.plan.to_json(),
        "state": {k: v.detach().clone() for k, v in task.state_dict().items()},
    }
    torch.save(record, out / f"{case}.rank{trainer.global_rank}.pt")


def main() -> None:
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[3:]:
        run_case(case, world, out)


if __name__ == "__main__":
    main()
