"""The cases of tests/lightning/test_ordinary_module.py: ordinary LightningModules on real ranks.

    run by tests/_world.py: run_case(CASE, WORLD, OUT_DIR)

Every rank runs every case in order and writes ``OUT_DIR/<case>.rank<r>.pt``. Cases:

* ``ordinary``: :func:`tests.lightning._module.run_sequence` on 2 stages (x WORLD/2 replicas,
  :func:`fixed_plan`);
  ``sharded``: the same with ``checkpoint_format="sharded"`` (``ckpt_path="best"`` / ``"last"``
  then read this rank's stage from a DCP directory).
* ``twice`` / ``never`` / ``metric``: ``fit`` of a module making that contract mistake;
  ``twice-replica1``: the mistake on replica 1's last stage only. Each records its error.
* ``crafted``: ``fit(ckpt_path=OUT_DIR/crafted.ckpt)`` (a file whose unpickling would run code).
* ``readme``: the README's contract example, run as written (``net`` and ``loader`` given).
* ``rankdata``: ``fit`` on a dataset each rank builds from its own rank (mismatched stages).
* ``accumulate``: :func:`tests.lightning._module.run_accumulate`; ``uneven``: the same with
  replica batches of :data:`UNEVEN` samples (the plan's ``replica_batches``).
* ``telemetry``: a planned 2-stage ``fit`` with a ``CSVLogger``, rank 1's forwards each made
  ``SLOW_FORWARD_S`` slower on purpose; records rank 0's ``metrics.csv`` and every rank's
  step-telemetry summary (:mod:`lightning_autopipe.lightning.telemetry`).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from tests.lightning import _module as M  # noqa: E402

SLOW_FORWARD_S = 0.02  # the telemetry case's known slowdown of each forward on rank 1
TELEMETRY_STEPS, TELEMETRY_EVERY = 8, 4
UNEVEN = (13, 7)  # the "uneven" case's samples per replica (of 2 x REPLICA_BATCH)
TIMEOUT = 120  # the strategy's: a rank left waiting for a peer stops only after this long
NO_HANG_S = 30  # an error raised on every rank comes within this of the training start


def fixed_plan(world: int) -> Plan:
    """Two stages cut in the middle, ``world // 2`` replicas, startup slicing on.

    Fixed rather than planned, so no rank waits for another's profile on a shared machine (the
    planner has its own tests); the cut and the counts are what a pinned plan would give.
    """
    n, cut = len(split_model(M.Classifier(), (torch.zeros(2, 3, 8, 8),))), M.FIRST_STAGE_BLOCKS
    replicas = world // 2
    stages = [StagePlan((0, cut), [f"local:{r}" for r in range(replicas)]),
              StagePlan((cut, n), [f"local:{replicas + r}" for r in range(replicas)])]
    return Plan("fixed", M.REPLICA_BATCH * replicas, M.MICROBATCHES, M.STARTUP_SLICES, stages)


class _SlowRank1(pl.Callback):
    """Makes every forward of rank 1's stage ``SLOW_FORWARD_S`` slower (a known slowdown)."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 1:
            trainer.strategy.pipeline.executor.stage.register_forward_hook(
                lambda *_: time.sleep(SLOW_FORWARD_S))


def telemetry_run(world: int, root: Path) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    from lightning_autopipe.cluster import Cluster
    from lightning_autopipe.lightning.telemetry import monitor_of

    strategy = lightning_autopipe.AutoPipeStrategy(
        num_stages=2, schedule="1f1b", cluster=Cluster.local(world), timeout=TIMEOUT)
    logger = CSVLogger(str(root), name="csv")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world,
                         max_steps=TELEMETRY_STEPS, log_every_n_steps=TELEMETRY_EVERY,
                         limit_val_batches=0, enable_progress_bar=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, logger=logger, callbacks=[_SlowRank1()],
                         default_root_dir=str(root))
    dl = M.loaders(world // 2, explicit_sampler=False)
    train = torch.utils.data.DataLoader(M.dataset(M.REPLICA_BATCH * TELEMETRY_STEPS, seed=1),
                                        batch_size=M.REPLICA_BATCH)
    trainer.fit(M.Classifier(), train, dl["val"])
    out = {"summary": dict(vars(monitor_of(strategy).summary())),
           "plan": strategy.plan.to_json()}
    csv = Path(logger.log_dir) / "metrics.csv"
    if trainer.global_rank == 0:
        out["csv"] = csv.read_text()
    return out


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.started: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = time.monotonic()


class _Samples(pl.Callback):
    """The samples this rank's pipeline trained each step (its replica's share)."""

    def __init__(self) -> None:
        self.samples: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples.append(trainer.strategy.pipeline.executor.samples)


def _trainer(world: int, root: Path, checkpoint_format: str = "consolidated", callbacks=(),
             replica_batches: tuple[int, ...] = (), **kwargs) -> pl.Trainer:
    plan = fixed_plan(world)
    plan.replica_batches = list(replica_batches)
    strategy = lightning_autopipe.AutoPipeStrategy(
        plan=Plan.from_json(plan.to_json()), timeout=TIMEOUT, checkpoint_format=checkpoint_format,
    )
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, log_every_n_steps=1,
                      enable_progress_bar=False, num_sanity_val_steps=0,
                      default_root_dir=str(root), callbacks=list(callbacks), **kwargs)


def readme_example() -> str:
    """The first Python block of the README's "Use it from your own code" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from your own code", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_inputs() -> dict:
    """``net`` and ``loader`` for the README example: a tiny GPT on a learnable sequence."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_autopipe.zoo.models import TinyGPT

    torch.manual_seed(0)
    net = TinyGPT(vocab=32, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    g = torch.Generator().manual_seed(5)
    start = torch.randint(0, 32, (128, 1), generator=g)
    tokens = (start + torch.arange(17)) % 32  # the next token is the current one plus one
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return {"net": net, "loader": DataLoader(data, batch_size=8)}


def run_case(case: str, world: int, out: Path) -> dict:
    root = out / case
    record: dict = {"case": case}
    start, clock = time.monotonic(), _Clock()
    try:
        if case in ("ordinary", "sharded"):
            fmt = "sharded" if case == "sharded" else "consolidated"
            record.update(M.run_sequence(lambda **kw: _trainer(world, root, checkpoint_format=fmt,
                                                               **kw),
                                         replicas=world // 2, explicit_sampler=False,
                                         ckpt_dir=out / f"ckpt-{case}"))
        elif case in ("accumulate", "uneven"):
            shares, seen = (UNEVEN, [_Samples()]) if case == "uneven" else ((), [])
            record.update(M.run_accumulate(
                lambda **kw: _trainer(world, root, replica_batches=shares, callbacks=seen, **kw),
                replicas=world // 2, explicit_sampler=False))
            record["samples"] = seen[0].samples if seen else []
        elif case == "telemetry":
            record.update(telemetry_run(world, root))
        elif case == "rankdata":  # each rank's own samples: a dataset built from its rank
            from torch.utils.data import DataLoader

            data = M.dataset(M.REPLICA_BATCH * M.TRAIN_STEPS,
                             seed=1 + torch.distributed.get_rank())
            trainer = _trainer(world, root, max_epochs=1, logger=False,
                               enable_checkpointing=False, callbacks=[clock])
            trainer.fit(M.Classifier(), DataLoader(data, batch_size=M.REPLICA_BATCH))
        elif case == "readme":
            ns = readme_inputs()
            exec(compile(readme_example(), "README.md", "exec"), ns)
            trainer = ns["trainer"]
            record.update(steps=trainer.global_step,
                          metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
                          plan=trainer.strategy.plan.to_json())
        else:
            mistake, _, where = case.partition("-replica")
            task = M.Classifier(mistake if mistake != "crafted" else None,
                                only_replica=int(where) if where else None)
            dl = M.loaders(world // 2, explicit_sampler=False)
            trainer = _trainer(world, root, max_epochs=1, logger=False,
                               enable_checkpointing=False, callbacks=[clock])
            ckpt = out / "crafted.ckpt" if mistake == "crafted" else None
            trainer.fit(task, dl["train"], ckpt_path=ckpt)
    except Exception as exc:  # the "optimizer" case's own error on rank 1 is recorded too
        if not isinstance(exc, lightning_autopipe.AutoPipeError) and case != "optimizer":
            raise
        record["error"] = (type(exc).__name__, str(exc))
    record["elapsed"] = time.monotonic() - (clock.started or start)  # from training's start
    initialized = torch.distributed.is_initialized()
    record["rank"] = torch.distributed.get_rank() if initialized else int(
        os.environ.get("LOCAL_RANK", 0))
    return record


class _RunsCode:
    """Unpickles as ``open(marker, "w")``: loading it unsafely creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def crafted_checkpoint(path: Path, marker: Path) -> None:
    """A Lightning-shaped checkpoint whose payload would run code on unpickling."""
    torch.save({"epoch": 0, "global_step": 0, "pytorch-lightning_version": "2.6.6",
                "state_dict": {}, "payload": _RunsCode(marker)}, path)


def prepare(world: int, out: Path) -> None:
    """Before the launch (tests._worlds): the crafted checkpoint the ``crafted`` case fits from."""
    if world == 2:
        crafted_checkpoint(out / "crafted.ckpt", out / "code_ran")

