"""Launched by tests/lightning/test_fp16.py: fp16 with loss scaling on real gloo ranks.

    run by tests/_world.py in the shared worlds (tests._worlds): run_case(CASE, WORLD, OUT_DIR)

Two stages x WORLD/2 replicas (a fixed plan: micro-batches of 4 in two slices each at both
ends), ``MixedPrecision("16-mixed", "cpu")`` with a plain ``torch.amp.GradScaler`` that the
strategy takes over, norm clipping on. Cases:

* ``fp16``: :data:`~tests.lightning._fp16.STEPS` steps from the start; the checkpoint is
  written to ``OUT_DIR/fp16.ckpt``.
* ``fp16-zbv``: the same under ZB-V, two chunks per rank (:func:`fixed_plan`).
* ``resume``: ``fit(ckpt_path=...)`` from the 2-rank world's ``fp16`` checkpoint for
  :data:`~tests.lightning._fp16.RESUME_STEPS` more steps.

Every rank writes ``OUT_DIR/<case>.rank<r>.pt``: per step its batch, the loss handed to
``on_train_batch_end``, the global gradient norm seen before clipping (gradients unscaled by
then), its own and the shared inf flag, the scale after the update and its stage's weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from tests.lightning import _fp16 as F16  # noqa: E402


def fixed_plan(world: int, zbv: bool = False) -> Plan:
    """Two stages, or (``zbv``) the four blocks as four chunks in V placement under ZB-V: rank 0
    holds blocks 0 and 3, rank 1 blocks 1 and 2."""
    replicas = world // 2
    rows = [[f"local:{r}" for r in range(replicas)],
            [f"local:{replicas + r}" for r in range(replicas)]]
    if zbv:
        stages = [StagePlan((c, c + 1), rows[0 if c in (0, 3) else 1]) for c in range(4)]
        return Plan("fixed", F16.REPLICA_BATCH * replicas, F16.MICROBATCHES,
                    F16.STARTUP_SLICES, stages, drain_slices=F16.DRAIN_SLICES, schedule="zbv",
                    chunks_per_rank=2, placement="v")
    stages = [StagePlan((0, F16.CUT), rows[0]), StagePlan((F16.CUT, 4), rows[1])]
    return Plan("fixed", F16.REPLICA_BATCH * replicas, F16.MICROBATCHES, F16.STARTUP_SLICES,
                stages, drain_slices=F16.DRAIN_SLICES)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.start_scale: float | None = None
        self.scaler_class = ""
        self._step: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        scaler = trainer.precision_plugin.scaler
        self.start_scale, self.scaler_class = scaler.get_scale(), type(scaler).__name__

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        scaler = trainer.precision_plugin.scaler
        norm = trainer.strategy.pipeline.executor.global_grad_norm()  # collective
        self._step = {"norm": float(norm), "local_inf": scaler.local_found_inf,
                      "found_inf": scaler.found_inf}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append({**self._step, "loss": float(loss),
                          "scale": trainer.precision_plugin.scaler.get_scale(),
                          "batch": [t.cpu().clone() for t in batch],
                          "state": {k: v.detach().cpu().clone()
                                    for k, v in pl_module.state_dict().items()}})


def run_case(case: str, world: int, out: Path) -> dict:
    """One case on this rank (run by tests/_world.py); ``resume`` reads the checkpoint the
    ``fp16`` case of the 2-rank world wrote."""
    record = Record()
    steps = F16.STEPS + (F16.RESUME_STEPS if case == "resume" else 0)
    trainer = pl.Trainer(
        strategy=lightning_autopipe.AutoPipeStrategy(plan=fixed_plan(world, case == "fp16-zbv"),
                                                     timeout=120),
        accelerator="cpu", devices=world, plugins=[F16.plugin()], max_steps=steps,
        gradient_clip_val=F16.CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(out / f"root-{case}"), callbacks=[record],
    )
    task = F16.Task()
    data = F16.loader(F16.REPLICA_BATCH * (world // 2) * F16.STEPS, seed=1)
    trainer.fit(task, data, ckpt_path=resume_checkpoint(out) if case == "resume" else None)
    if case == "fp16":
        trainer.save_checkpoint(out / "fp16.ckpt")
    pipe = trainer.strategy.pipeline
    return {"rows": record.rows, "start_scale": record.start_scale,
            "scaler_class": record.scaler_class, "stage": pipe.layout.stage,
            "replica": pipe.layout.replica}


def resume_checkpoint(out: Path) -> Path:
    """The 2-rank world's ``fp16`` checkpoint, beside this world's folder (tests._worlds)."""
    return out.parent.parent / "w2" / out.name / "fp16.ckpt"
