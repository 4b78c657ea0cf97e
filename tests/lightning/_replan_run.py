"""The cases of tests/lightning/test_replan.py, run on the shared 2-rank world (tests._worlds).

    run by tests/_world.py: run_case(CASE, WORLD, OUT_DIR)

A tied-embedding GPT trained with Adam on 2 planned stages while rank 1's every forward is made
``SLOW_FORWARD_S`` slower on purpose (from the first training step, after profiling, so the
first plan is balanced and rank 1 then measures slow):

* ``auto``: ``replan="auto"`` (window 2, at least 2 steps between switches: the first check
  after step 3, a plan's first step being kept out of the window); records the losses, the
  switches, the final state and writes ``auto.ckpt`` after training;
* ``off``: the same with ``replan="off"``;
* ``fp16``: the fp16 loss-scaling net of :mod:`tests.lightning._fp16` with a window of 1 step
  (so the first check, after the warm-up step and one more, switches after step 2, and the
  overflow the settings put at the third step, ``OVERFLOW_STEP = 2`` counted from 0, comes
  right after the switch, which only the carried-over scale gives), ``16-mixed``, norm
  clipping, per-step records of :class:`tests.lightning._fp16_run.Record`;
* ``compiled``: ``auto`` with ``compile="aot_eager"`` (Dynamo over each stage, no code
  generation): the new stage after a switch must be compiled afresh; records the running
  stage's class and the graphs it compiled;
* ``chunked``: ``auto`` with the schedule pinned to ZB-V (two chunks per rank), a cluster that
  declares rank 1 twice as fast as rank 0 (so the first plan gives it most blocks,
  whatever the one-pass profile's noise) and each of rank 1's chunk forwards slowed by a fixed delay
  (:class:`SlowRank1`): the switch moves a chunked layout to another chunked layout;
* ``uniform``: ``auto`` with both ranks slowed alike and a threshold of 50%: the plan is kept
  and re-calibrated to the measured speeds;
* ``refit``: ``auto`` fitted for 2 steps, then again up to step 7 (:func:`refit_case`);
* ``fail``: ``auto`` with rank 1 failing as it loads its new stage (the rebind module's
  ``load_stage_tensors`` replaced in this process only); records each rank's error and when.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402
import lightning_autopipe.runtime.replan as replan_mod  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.lightning import telemetry  # noqa: E402
from lightning_autopipe.runtime.speeds import measured_cluster  # noqa: E402
from tests.runtime import _cases as C  # noqa: E402

SLOW_FORWARD_S = 0.02
DECLARED_FAST = 2.0  # the chunked case's declared speed of rank 1 (rank 0: 1)
STEPS = 8
LR = 1e-2
# Adam's eps: with the default 1e-8 a gradient that is rounding noise gets a full lr-sized step,
# so micro-batched and whole-batch training part by 1e-4 within 8 steps even in one process
EPS = 1e-4
TIMEOUT = 60  # the strategy's; a failed switch must end far sooner
INJECTED = "injected failure while loading the new stage"


class Task(pl.LightningModule):
    """``C.build_net("gpt")`` (tied embedding and head) trained with Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.net = C.build_net("gpt")
        self.step_losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        return C.loss_fn(outputs, batch)

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.step_losses.append(float(loss))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR, eps=EPS)

    def train_dataloader(self):
        data = C.dataset("gpt", C.REPLICA_BATCH * STEPS, seed=1)
        return DataLoader(TensorDataset(*data), batch_size=C.REPLICA_BATCH)


class SlowRank1(pl.Callback):
    """Rank 1's every forward ``SLOW_FORWARD_S`` slower, on whatever it holds: each module
    its executor's actions run (one stage, or each of several chunks). A delay far above the
    tiny stages' own milliseconds, so the slowed rank measures slow even where the per-action
    overhead of tiny chunks makes an unslowed rank measure below its profiled speed too.
    ``ranks``: the ranks slowed (the ``uniform`` case: every rank)."""

    def __init__(self, ranks: tuple[int, ...] = (1,)) -> None:
        self.hooked = None
        self.ranks = ranks

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        executor = trainer.strategy.pipeline.executor
        if trainer.global_rank not in self.ranks or executor is self.hooked:
            return
        for module in executor.chunks.values():  # the modules its actions run
            module.register_forward_hook(lambda *_: time.sleep(SLOW_FORWARD_S))
        self.hooked = executor


class Verdicts(pl.Callback):
    """Rank 0's re-plan verdict at every check (the reason a plan was kept, too)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.seen = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        verdict = trainer.strategy._replanner.last_verdict
        if verdict is not None and verdict is not self.seen:
            self.seen = verdict
            speeds = {k: round(v, 3) for k, v in dict(verdict.speeds or {}).items()}
            self.reasons.append(f"after step {verdict.step}: {verdict.reason}; measured / "
                                f"planned speeds {speeds}")


def _inject_failure(record: dict) -> None:
    def failing(*args, **kwargs):
        record["injected_at"] = time.time()
        raise RuntimeError(INJECTED)

    replan_mod.load_stage_tensors = failing


def _strategy(case: str, world: int, window: int = 2, **pins
              ) -> lightning_autopipe.AutoPipeStrategy:
    schedule, cluster = "1f1b", Cluster.local(world)
    if case == "chunked":
        schedule = "zbv"
        cluster = measured_cluster(cluster, {cluster.devices[1].name: DECLARED_FAST})
    return lightning_autopipe.AutoPipeStrategy(
        num_stages=2, schedule=schedule, profile_repeats=1, timeout=TIMEOUT,
        cluster=cluster, replan="off" if case == "off" else "auto",
        replan_window=window, replan_min_steps=2,
        # the chunked case: any gain switches (its 8 steps leave little to pay a switch with,
        # and what it asserts is the migration of chunks, not the threshold's rule); the
        # uniform case: no switch (the fixed delay slows a stage with less planned compute
        # relatively more, so a re-balanced plan can gain a few percent; what it asserts is
        # the re-calibration of a kept plan)
        replan_threshold={"chunked": 0.0, "uniform": 0.5}.get(case, 0.05), **pins,
    )


def fp16_case(world: int, out: Path) -> dict:
    from tests.lightning import _fp16 as F16
    from tests.lightning._fp16_run import Record

    record = Record()
    strategy = _strategy("fp16", world, window=1, num_microbatches=F16.MICROBATCHES,
                         startup_slices=F16.STARTUP_SLICES, drain_slices=F16.DRAIN_SLICES)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, plugins=[F16.plugin()],
        max_steps=F16.STEPS, gradient_clip_val=F16.CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[record, SlowRank1()],
        default_root_dir=str(out / "root-fp16"),
    )
    trainer.fit(F16.Task(), F16.loader(F16.REPLICA_BATCH * F16.STEPS, seed=1))
    pipe = strategy.pipeline
    return {"rows": record.rows, "switches": [dict(vars(s)) for s in strategy.switches],
            "stage": pipe.layout.stage, "replica": pipe.layout.replica,
            "rank": trainer.global_rank}


REFIT_STEPS = (2, 7)  # the refit case: the first fit's max_steps, then the second's


def refit_case(world: int, out: Path) -> dict:
    """``auto`` fitted for 2 steps, then fitted again up to step 7 by the same Trainer (the
    pipeline kept between the calls); records every check's step on this rank."""
    strategy = _strategy("refit", world, num_microbatches=4)
    checks: list[int] = []

    class Checks(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            verdict = trainer.strategy._replanner.last_verdict
            if verdict is not None and (not checks or checks[-1] != verdict.step):
                checks.append(verdict.step)

    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=REFIT_STEPS[0],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[SlowRank1(), Checks()], default_root_dir=str(out / "root-refit"),
    )
    task = Task()
    trainer.fit(task)
    first = list(checks)
    trainer.fit_loop.epoch_loop.max_steps = REFIT_STEPS[1]
    trainer.fit(task)
    return {"rank": trainer.global_rank, "first_fit_checks": first, "checks": checks,
            "steps": strategy._replanner.steps, "global_step": trainer.global_step,
            "switches": [s.step for s in strategy.switches]}


def run_case(case: str, world: int, out: Path) -> dict:
    if case == "fp16":
        return fp16_case(world, out)
    if case == "refit":
        return refit_case(world, out)
    pins = {"compile": "aot_eager"} if case == "compiled" else {}
    strategy = _strategy(case, world, num_microbatches=4, **pins)
    task = Task()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[SlowRank1((0, 1) if case == "uniform" else (1,)), verdicts := Verdicts()],
        default_root_dir=str(out / f"root-{case}"),
    )
    record: dict = {"case": case}
    original = replan_mod.load_stage_tensors
    if case == "fail" and os.environ.get("LOCAL_RANK") == "1":
        _inject_failure(record)
    try:
        trainer.fit(task)
    except Exception as exc:  # noqa: BLE001 - the fail case's record
        record["error"] = (type(exc).__name__, str(exc))
        record["error_at"] = time.time()
    finally:
        replan_mod.load_stage_tensors = original
    record.update(
        rank=trainer.global_rank,
        losses=task.step_losses,
        switches=[dict(vars(s)) for s in strategy.switches],
        recalibrations=[dict(vars(r)) for r in strategy._replanner.recalibrations],
        checks=strategy._replanner.checks,
        verdicts=verdicts.reasons,
        plan=strategy.plan.to_json() if strategy.plan is not None else None,
    )
    monitor = telemetry.monitor_of(strategy)
    if monitor is not None:  # what the telemetry predicts for the running plan at the end
        record["predicted_step_ms"] = monitor.prediction.step_ms
    if case == "compiled":
        stage = strategy.pipeline.executor.stage
        record["compiled_class"] = type(stage).__name__
        record["compilations"] = getattr(stage, "compilations", 0)
        record["compiled_params"] = sorted(n for n, _ in getattr(stage, "stage", stage)
                                           .named_parameters())
        record["stage_params"] = sorted(n for n, _ in strategy.pipeline.stage.named_parameters())
    if "error" not in record:
        record["state"] = {k: v.detach().clone() for k, v in task.state_dict().items()}
        trainer.save_checkpoint(out / f"{case}.ckpt")
        plans = out / f"root-{case}" / "autopipe"
        record["plan_files"] = sorted(str(p.relative_to(plans)) for p in plans.rglob("*.json")
                                      if "profile" not in p.name)
    return record
