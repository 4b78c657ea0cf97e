"""Launched by the reliability tests: several ``Trainer.fit`` runs in one Lightning launch.

    python tests/reliability/_run.py OUT_DIR WORLD CASE [CASE ...]

Lightning's popen launcher re-runs this script in every rank, so every rank runs every case in
order and writes ``OUT_DIR/<case>.rank<r>.pt`` (losses, RSS samples, the error it caught). A
case is a name from ``CASES``; checkpoints go under ``OUT_DIR``. Failure cases
(``fail_*``) end the launch on purpose: they are launched alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._stack import import_the_stack  # noqa: E402

import_the_stack()

import lightning.pytorch as pl  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from tests._recording import RecordingLogger  # noqa: E402
from tests.reliability import _task as T  # noqa: E402

WORLD = 4
# d_model 128 and 8-sample startup slices: one leaked activation of the smallest unit would be
# 8 x 8 x 128 x 4 B = 32 KiB per step, well above the ~10 KiB/step of bookkeeping growth that
# torch/gloo show here independently of the model size (see test_soak).
# The strategy timeout of the failure cases: a hang is only noticed when it expires.
# (A hang ends the job only when it expires; shorter than 20 s and a loaded 2-core machine can
# time out the setup before the failure is injected at step 2.)
FAIL_TIMEOUT = {"raise": 20, "kill": 20, "hang": 20}
SOAK = {"optimizer": "sgd", "d_model": 128, "steps_per_epoch": 20, "global_batch": 64}


class RssSampler(Callback):
    """Resident memory of this rank after every training step.

    Freed heap pages are handed back first (glibc ``malloc_trim``; cheap, unlike a full
    ``gc.collect``), so the samples follow live memory rather than the allocator's high-water
    mark.
    """

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._proc = psutil.Process()
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._trim is not None:
            self._trim(0)
        self.samples.append(self._proc.memory_info().rss)


class Inject(Callback):
    """Makes one rank fail at one global step: raise in its stage's forward, die, or hang."""

    def __init__(self, rank: int, step: int, how: str, out: Path) -> None:
        self.rank, self.step, self.how, self.out = rank, step, how, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        (self.out / "injected_at").write_text(str(time.time()))
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "hang":
            time.sleep(10_000)
        stage = trainer.strategy.pipeline.stage

        def broken(*args, **kwargs):
            raise ValueError("injected failure in the stage's forward")

        stage.forward = broken


class PoisonParameter(Callback):
    """Rank 0 (stage 0) fills its first parameter with NaN at one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


def _fixed_plan(stages: int, replicas: int = 1) -> Plan:
    """Even contiguous block ranges on ``local:0..``: the same cuts in every run.

    An automatic plan depends on profiled timings, and the cuts decide which rank draws which
    dropout mask, so bit-identical reruns with dropout need a fixed plan (as the README says).
    """
    net = T.build_net()
    n = len(split_model(net, (torch.zeros(2, T.SEQ, dtype=torch.long),)))
    bounds = [round(i * n / stages) for i in range(stages + 1)]
    return Plan("fixed", T.GLOBAL_BATCH, 2, 2, [
        StagePlan((bounds[i], bounds[i + 1]), [f"local:{i * replicas + r}"
                                               for r in range(replicas)])
        for i in range(stages)
    ])


def _strategy(stages: int, **kw) -> lightning_autopipe.AutoPipeStrategy:
    if "plan" not in kw:  # planned for a given local cluster: these cases test no discovery
        kw.update(num_stages=stages, num_microbatches=2, startup_slices=2,
                  cluster=Cluster.local(WORLD))
    return lightning_autopipe.AutoPipeStrategy(
        profile_repeats=1, timeout=kw.pop("timeout", 60), **kw
    )


def _fit(out: Path, case: str, *, stages: int, epochs: int, ckpt_path=None, callbacks=(),
         task_kw=None, strategy_kw=None, after=None, log: bool = True,
         catch: bool = True) -> dict:
    world = WORLD
    replicas = world // stages
    task = T.Task(replicas, **(task_kw or {}))
    logger = RecordingLogger() if log else None
    rss = RssSampler()
    trainer = pl.Trainer(
        strategy=_strategy(stages, **(strategy_kw or {})),
        accelerator="cpu",
        devices=world,
        max_epochs=epochs,
        logger=logger if log else False,
        log_every_n_steps=1,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=[rss, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    record: dict = {"case": case}
    try:
        trainer.fit(task, ckpt_path=ckpt_path)
        if after is not None:
            after(trainer)
    except lightning_autopipe.AutoPipeError as exc:
        if not catch:
            raise
        record["error"] = (type(exc).__name__, str(exc))
    record.update(
        rank=trainer.global_rank,
        losses=task.step_losses,
        logged=logger.rows if logger is not None else [],
        rss=rss.samples,
        plan=trainer.strategy.plan.to_json() if trainer.strategy.plan is not None else None,
        replan_checks=trainer.strategy._replanner.checks,
        switch_steps=[s.step for s in trainer.strategy.switches],
    )
    return record


def run_case(case: str, world: int, out: Path) -> dict:
    global WORLD
    WORLD = world
    ck = out / "ckpt"
    every_epoch = dict(filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    if case == "ckpt_2x2":  # uninterrupted 2 stages x 2 replicas; a file every epoch + one after
        return _fit(out, case, stages=2, epochs=4,
                    callbacks=[ModelCheckpoint(dirpath=ck / "2x2", **every_epoch)],
                    after=lambda tr: tr.save_checkpoint(ck / "2x2" / "final.ckpt"))
    if case == "resume_4x1":  # the 2x2 checkpoint of epoch 1 continued on 4 stages x 1
        return _fit(out, case, stages=4, epochs=4, ckpt_path=ck / "2x2" / "epoch=1.ckpt")
    if case == "resume_auto_2x2":  # the strategy="auto" checkpoint continued on 2 x 2
        return _fit(out, case, stages=2, epochs=4, ckpt_path=ck / "auto" / "epoch=1.ckpt")
    if case == "sharded_2x2":  # DCP directories; save_top_k=1 removes the older directory
        return _fit(out, case, stages=2, epochs=2,
                    strategy_kw={"checkpoint_format": "sharded"},
                    callbacks=[ModelCheckpoint(dirpath=ck / "sharded", filename="{epoch}",
                                               save_top_k=1)])
    if case == "resume_sharded_4x1":
        return _fit(out, case, stages=4, epochs=4, ckpt_path=ck / "sharded" / "epoch=1.ckpt",
                    strategy_kw={"checkpoint_format": "sharded"})
    if case == "nan_raise":  # stage 0's weights turn NaN at step 1: every rank must raise
        # a given plan keeps rank 0 on stage 0 (a planned mapping may place it elsewhere)
        return _fit(out, case, stages=4, epochs=1, callbacks=[PoisonParameter(1)],
                    strategy_kw={"plan": _fixed_plan(4)})
    if case == "nan_skip":  # the loss of step 1 is NaN: that step is skipped on every rank
        return _fit(out, case, stages=4, epochs=2, task_kw={"poison_loss_at": 1},
                    strategy_kw={"nonfinite_loss": "skip"})
    if case == "soak":  # 200 steps, 2 stages x 2 replicas, sliced micro-batch 0
        # re-planning as by default: a check every replan_window steps from step 50 on (an
        # all-gather, rank 0 plans, a broadcast), a switch when one pays
        return _fit(out, case, stages=2, epochs=int(os.environ.get("SOAK_EPOCHS", 10)),
                    task_kw=SOAK, log=False)
    if case in ("det_a", "det_b"):  # same seed and plan, dropout on: identical losses
        pl.seed_everything(1234, verbose=False)
        return _fit(out, case, stages=4, epochs=1,
                    task_kw={"dropout": 0.1, "optimizer": "sgd", "steps_per_epoch": 3,
                             "init_seed": None},
                    strategy_kw={"plan": _fixed_plan(4)})
    if case.startswith("fail_"):  # fail_<how>_rank<r>[_dp]: fails at global step 2
        # A given plan keeps rank r on stage r (a planned mapping may swap the two ranks when
        # the machine is busy), so the messages the tests expect name a known stage; _dp: one
        # stage on two replicas instead of two stages.
        how, rank = case.split("_")[1], int(case.split("rank")[1][0])
        stages, replicas = (1, WORLD) if case.endswith("_dp") else (2, 1)
        return _fit(out, case, stages=stages, epochs=1, task_kw={"steps_per_epoch": 4},
                    strategy_kw={"timeout": FAIL_TIMEOUT[how],
                                 "plan": _fixed_plan(stages, replicas)},
                    callbacks=[Inject(rank, 2, how, out)], catch=False)
    raise ValueError(f"unknown case {case!r}")


def auto_fit(out: Path, ckpt_path: Path | None = None) -> list[float]:
    """strategy="auto" on one CPU device, the single-process reference: its step losses; from
    the start it writes a checkpoint every epoch under ``out/ckpt/auto``."""
    task = T.Task(1, explicit_sampler=True)
    callbacks = []
    if ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt" / "auto", filename="{epoch}",
                                         save_top_k=-1))
    trainer = pl.Trainer(
        strategy="auto", accelerator="cpu", devices=1, max_epochs=4, logger=False,
        callbacks=callbacks, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(task, ckpt_path=ckpt_path)
    return task.step_losses


def prepare(world: int, out: Path) -> None:
    """Before the 4-rank launch (tests._worlds): the "auto" run whose checkpoint
    ``resume_auto_2x2`` continues; its losses are kept for the tests."""
    if world == 4:
        torch.set_num_threads(1)
        torch.save(auto_fit(out), out / "auto_losses.pt")


def main() -> None:
    global WORLD
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    WORLD = int(sys.argv[2])
    (out / f"pid.rank{os.environ.get('LOCAL_RANK', '0')}").write_text(str(os.getpid()))
    for case in sys.argv[3:]:
        record = run_case(case, WORLD, out)
        torch.save(record, out / f"{case}.rank{record['rank']}.pt")


if __name__ == "__main__":
    main()
