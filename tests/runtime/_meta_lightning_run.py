"""Launched by tests/runtime/test_meta_lightning.py: a GPT built in ``configure_model``, then
the same GPT built eagerly, through ``Trainer(strategy=AutoPipeStrategy(...))``.

    run by tests/_world.py in the shared worlds: run_case(CASE, WORLD, OUT_DIR), CASE one of
    resume (2 ranks), meta, eager

For each build every rank
resets its peak resident set (``/proc/self/clear_refs``, then ``VmHWM`` is the peak since)
right before the LightningModule is built and reads the peak when training starts (after the
strategy's setup: trace, profile or given plan, local stage). ``WORLD`` 2 plans from the ranks'
profiles (2 stages) in the meta build and the eager build runs the plan the meta build chose
(profiling a model that is already whole says nothing about holding a stage); 4 runs a given
4-stage plan. Writes ``OUT_DIR/<build>.rank<r>.pt``.
With 2 ranks a tiny GPT is first trained, saved and resumed into a ``configure_model`` build
(``OUT_DIR/resume.rank<r>.pt``, and the checkpoint ``OUT_DIR/tiny.ckpt``).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from lightning_autopipe.runtime.materialize import _give_back_host_memory  # noqa: E402
from lightning_autopipe.runtime.memory import reset_resident_peak, resident_peak_bytes  # noqa: E402
from lightning_autopipe.zoo.models import TinyGPT  # noqa: E402
from tests.runtime import _cases as C  # noqa: E402

SIZES = {"vocab": 512, "seq_len": 4, "d_model": 1024, "n_layers": 8, "n_heads": 8}
TINY = {"vocab": C.VOCAB, "seq_len": C.SEQ, "d_model": 16, "n_layers": 2, "n_heads": 2}
BATCH = 4


class Task(pl.LightningModule):
    def __init__(self, deferred: bool, sizes: dict | None = None) -> None:
        super().__init__()
        self.sizes = sizes or SIZES
        self.net = None if deferred else TinyGPT(**self.sizes)
        self.peak: int | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:  # under the strategy's tensor_init_context: on the meta device
            self.net = TinyGPT(**self.sizes)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return C.loss_fn(self(batch[0]), batch)

    def on_fit_start(self) -> None:
        self.peak = resident_peak_bytes()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def configure_optimizers(self):
        if self.sizes is TINY:  # resumed from a checkpoint: its Adam state must carry over
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*batch(self.sizes)), batch_size=BATCH)


def batch(sizes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset: one batch (every epoch's batch holds the same samples)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, sizes["vocab"], (BATCH, sizes["seq_len"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _strategy(world: int, out: Path, build: str) -> lightning_autopipe.AutoPipeStrategy:
    cluster = Cluster.local(world)
    common = {"cluster": cluster, "timeout": 300}
    if world == 2 and build == "eager":  # the meta build's plan (that case runs first)
        plan = Plan.load(_chosen(out, int(os.environ.get("LOCAL_RANK", 0))))
        return lightning_autopipe.AutoPipeStrategy(plan=plan, **common)
    if world == 2:
        # the median of 3 timings per block (the default): with one, a single stalled block
        # (a busy core) weighed enough to put 83% of the model on one stage
        return lightning_autopipe.AutoPipeStrategy(
            num_stages=2, num_microbatches=2, startup_slices=1, drain_slices=1,
            schedule="1f1b", profile_repeats=3, **common)
    # blocks: embeddings, (attn, mlp) per layer, lm_head: two layers per stage
    cuts = [0, 5, 9, 13, 18]
    names = [d.name for d in cluster.devices]
    plan = Plan("given", BATCH, 2, 1, [StagePlan((cuts[s], cuts[s + 1]), [names[s]])
                                       for s in range(4)])
    return lightning_autopipe.AutoPipeStrategy(plan=plan, **common)


def _chosen(out: Path, rank: int) -> Path:
    """Where a rank keeps the plan its meta build ran (each rank its own copy, so a rank never
    reads a file another rank is still writing)."""
    return out / f"meta.plan.rank{rank}.json"


def run(build: str, world: int, out: Path) -> None:
    trainer = pl.Trainer(
        strategy=_strategy(world, out, build), accelerator="cpu", devices=world, max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out / "root",
    )
    base = reset_resident_peak()
    task = Task(deferred=build == "meta")
    trainer.fit(task)
    stage = trainer.strategy.pipeline.stage
    record = {
        "growth": task.peak - base,
        "largest_block": max((b.param_bytes for b in trainer.strategy.profile.blocks), default=0)
        if trainer.strategy.profile is not None else 0,
        "stage_bytes": sum(p.numel() * p.element_size() for p in stage.parameters()),
        "losses": task.losses,
        "stage": trainer.strategy.pipeline.layout.stage,
    }
    torch.save(record, out / f"{build}.rank{trainer.global_rank}.pt")
    if build == "meta":
        trainer.strategy.plan.save(_chosen(out, trainer.global_rank))


def resume(world: int, out: Path) -> None:
    """A tiny GPT trains 2 Adam steps eagerly and is saved; the same GPT built in
    ``configure_model`` resumes from the file (``ckpt_path``) for 2 more steps."""
    def trainer(steps: int) -> pl.Trainer:
        strategy = lightning_autopipe.AutoPipeStrategy(
            plan=_tiny_plan(world), cluster=Cluster.local(world), timeout=120)
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=out / "root")

    torch.manual_seed(0)
    first = Task(deferred=False, sizes=TINY)
    t = trainer(2)
    t.fit(first)
    t.save_checkpoint(out / "tiny.ckpt")
    resumed = Task(deferred=True, sizes=TINY)
    t = trainer(4)
    t.fit(resumed, ckpt_path=out / "tiny.ckpt")
    torch.save({"first": first.losses, "resumed": resumed.losses, "step": t.global_step},
               out / f"resume.rank{t.global_rank}.pt")


def _tiny_plan(world: int) -> Plan:
    names = [d.name for d in Cluster.local(world).devices]
    cuts = [0, 4, 7]  # wte, wpe, h.0.attn, h.0.mlp | h.1.attn, h.1.mlp, lm_head
    return Plan("given", BATCH, 2, 1, [StagePlan((cuts[s], cuts[s + 1]), [names[s]])
                                       for s in range(world)])


def run_case(case: str, world: int, out: Path) -> None:
    """``resume`` (2 ranks), or the ``meta`` / ``eager`` build (run by tests/_world.py)."""
    if case == "resume":
        resume(world, out)
        return
    gc.collect()  # hand earlier cases' heap back, so this build starts from none
    _give_back_host_memory()
    run(case, world, out)
    gc.collect()
    _give_back_host_memory()
