"""Launched by tests/gpu/test_bf16_trainer.py: three bf16-mixed steps through Lightning's Trainer.

    python tests/gpu/_trainer_run.py OUT_DIR ACCELERATOR

One device, ``strategy=AutoPipeStrategy(...)``, ``precision="bf16-mixed"``; the tiny GPT task of
``tests/reliability`` overfits one batch of 16 (one batch per epoch) with Adam. Writes
``OUT_DIR/run.pt`` with the step losses, the plan, where and in which dtype the logits reached
``pipeline_loss``, the final state; the checkpoint callback writes ``OUT_DIR/ckpt/last.ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._stack import import_the_stack  # noqa: E402

import_the_stack()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_autopipe import AutoPipeStrategy  # noqa: E402
from tests.reliability import _task as T  # noqa: E402

STEPS = 3


class Task(T.Task):
    """Records the dtype and device of the logits the loss sees (autocast's doing)."""

    def pipeline_loss(self, outputs, batch):
        self.logits = (str(outputs.dtype).removeprefix("torch."), outputs.device.type)
        return super().pipeline_loss(outputs, batch)


def main() -> None:
    out, accelerator = Path(sys.argv[1]), sys.argv[2]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    task = Task(optimizer="adam", steps_per_epoch=1)
    strategy = AutoPipeStrategy(
        num_stages=1, num_microbatches=2, startup_slices=2, profile_repeats=1, timeout=60
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=1,
        precision="bf16-mixed",
        max_steps=STEPS,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", filename="last")],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task)
    torch.save(
        {
            "losses": task.step_losses,
            "plan": trainer.strategy.plan.to_json(),
            "logits": task.logits,
            "param_devices": sorted({p.device.type for p in task.parameters()}),
            "state": {k: v.detach().cpu().clone() for k, v in task.state_dict().items()},
        },
        out / "run.pt",
    )


if __name__ == "__main__":
    main()
