"""Cases of tests/lightning/test_chunks.py: several chunks per rank through the Trainer.

    run by tests/_world.py in the shared worlds (tests._worlds): run_case(CASE, WORLD, OUT_DIR)

CASE is ``<schedule>-<p>x<replicas>`` with schedule ``zbv`` (V placement, two chunks per rank,
split backward), ``interleaved`` (interleaved 1F1B, looped placement, two chunks per rank),
``zbvside`` (ZB-V on :class:`SideGPT`, whose side branch starts in a middle chunk):
a fixed plan over the tiny GPT whose LM head is tied to its embedding (the first and the last
chunk), four micro-batches of two samples, micro-batch 0 in two startup slices and (ZB-V) the
last in two drain slices, Adam. ``auto-2x1`` plans instead (``schedule="auto"``, two pipeline
stages) on a given local cluster whose links and per-action cost are nearly free, and block
times given alike (:func:`_even_times`), where the planner predicts chunks faster and must
choose them. ``resume-4x1`` continues the 2-rank
world's ``zbv-2x1`` run from its checkpoint under interleaved 1F1B on 4 ranks (another layout,
optimizer state included). Every rank writes ``OUT_DIR/<case>.rank<r>.pt``: per step its
batch, loss and the weights it holds (original names); ``zbv-2x1`` also saves
``OUT_DIR/zbv-2x1.ckpt``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402
import lightning_autopipe.runtime.measure as measure  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner.placement import chunk_ranks  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from lightning_autopipe.zoo.models import TinyGPT  # noqa: E402
from tests._with_loss import TaskWithLoss  # noqa: E402

VOCAB, SEQ, LAYERS = 32, 8, 4
REPLICA_BATCH, MICROBATCHES, STEPS, RESUME_STEPS = 8, 4, 3, 2
AUTO_MICROBATCHES = 2  # pinned in the auto-2x1 case (the planner must keep it)
LR, EPS = 1e-2, 1e-6  # the key bias's gradient is zero up to rounding: Adam's default eps
# (1e-8) would turn that rounding noise into steps of the full learning rate
SCHEDULES = {"zbv": ("zbv", "v", 2, 2), "interleaved": ("interleaved-1f1b", "looped", 2, 1),
             "zbvside": ("zbv", "v", 2, 2)}


def build_net(side: bool = False) -> torch.nn.Module:
    """In float64: Adam's step divides by the root of each gradient's square, so an element
    whose gradient cancels to near zero turns the rounding of a sum taken in another order
    (units, chunks) into a different step; in float64 that noise stays far below the
    tolerance, and a wrong gradient still fails by orders of magnitude. ``side``:
    :class:`SideGPT`."""
    torch.manual_seed(0)
    gpt = TinyGPT(vocab=VOCAB, seq_len=SEQ, d_model=16, n_layers=LAYERS, n_heads=2)
    return (SideGPT(gpt) if side else gpt).double()


class SideGPT(torch.nn.Module):
    """The tiny GPT with a second embedding of the token ids, computed half-way through the
    layers and added before the head, as an encoder-decoder's decoder embedding beside its
    encoder: the chunk that starts it carries the hidden state (which takes a gradient) and
    starts the side branch from the ids (which take none), so the side's weights meet no
    input path there (their gradients come in ``B``)."""

    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.gpt = gpt
        self.side = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.LayerNorm(16))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        g, half = self.gpt, LAYERS // 2
        x = g.drop(g.wte(input_ids) + g.wpe(torch.narrow(g.pos, 0, 0, input_ids.size(1))))
        for block in g.h[:half]:
            x = block(x)
        side = self.side(input_ids)
        for block in g.h[half:]:
            x = block(x)
        return g.lm_head(g.ln_f(x + side))


def num_blocks(side: bool = False) -> int:
    return len(split_model(build_net(side), (torch.zeros(2, SEQ, dtype=torch.long),)))


def loss_fn(logits: torch.Tensor, batch) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))


def dataset(num: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def chunk_plan(schedule: str, p: int, replicas: int) -> Plan:
    """``p`` ranks x ``replicas``, two chunks per rank cut evenly over the blocks."""
    name, placement, v, j = SCHEDULES[schedule]
    n, S = num_blocks(side=schedule == "zbvside"), p * v
    cuts = [round(n * c / S) for c in range(S + 1)]
    rows = [[f"local:{s * replicas + r}" for r in range(replicas)] for s in range(p)]
    owner = chunk_ranks(p, v, placement)
    stages = [StagePlan((cuts[c], cuts[c + 1]), rows[owner[c]]) for c in range(S)]
    return Plan("fixed", REPLICA_BATCH * replicas, MICROBATCHES, 2, stages, schedule=name,
                drain_slices=j, chunks_per_rank=v, placement=placement)


class Task(TaskWithLoss):
    def __init__(self, side: bool = False) -> None:
        super().__init__(build_net(side), loss_fn, partial(torch.optim.Adam, lr=LR, eps=EPS))


class Record(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append({"loss": float(loss), "batch": [t.clone() for t in batch],
                          "state": {k: v.detach().clone()
                                    for k, v in pl_module.state_dict().items()}})


_MEASURED = measure._profile


def _even_times(profile_blocks):
    """``auto-2x1``'s profile: the measured blocks (names, bytes, memory), each timed alike,
    with a fixed cost per call (so slicing micro-batches costs, as on real devices) and no
    split backward: the planner predicts interleaved chunks about 8% faster than any one-chunk
    plan, on every run. Timed live on the loaded suite machine the choice swung either way
    (1 run in about 6 chose one chunk, even as the median of 7 timings)."""
    def profiled(*args, **kwargs):
        got = profile_blocks(*args, **kwargs)
        got.blocks = [replace(b, forward_ms=1.0, backward_ms=2.0, forward_fixed_ms=0.4,
                              backward_fixed_ms=0.8, backward_input_ms=None,
                              backward_weight_ms=None) for b in got.blocks]
        return got
    return profiled


def run_case(case: str, world: int, out: Path) -> dict:
    schedule, shape = case.split("-")
    p, replicas = (int(v) for v in shape.split("x"))
    assert p * replicas == world, (case, world)
    resume = schedule == "resume"
    if schedule == "auto":  # planned at the start: nearly free links, no cost per action
        cluster = Cluster.local(world, gbps=100.0, latency_us=1.0, overhead_ms=0.0)
        # two micro-batches, replan="off" (with live re-planning auto keeps to one chunk per
        # rank), and block times given (_even_times): the planner's choice is the test
        strategy = lightning_autopipe.AutoPipeStrategy(
            schedule="auto", cluster=cluster, num_stages=p, num_microbatches=AUTO_MICROBATCHES,
            replan="off", timeout=120, profile_repeats=1)
        measure._profile = _even_times(measure._profile)
    else:
        plan = chunk_plan("interleaved" if resume else schedule, p, replicas)
        strategy = lightning_autopipe.AutoPipeStrategy(plan=plan, timeout=120)
    record = Record()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu", devices=world, max_steps=STEPS + (RESUME_STEPS if resume else 0),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=str(out / f"root-{case}"), callbacks=[record],
    )
    data = DataLoader(dataset(REPLICA_BATCH * replicas * STEPS, seed=1),
                      batch_size=REPLICA_BATCH)
    ckpt = out.parent.parent / "w2" / out.name / "zbv-2x1.ckpt" if resume else None
    try:
        trainer.fit(Task(side=schedule == "zbvside"), data, ckpt_path=ckpt)
    finally:
        measure._profile = _MEASURED
    if case == "zbv-2x1":
        trainer.save_checkpoint(out / "zbv-2x1.ckpt")
    pipe = trainer.strategy.pipeline
    return {"rows": record.rows, "plan": pipe.plan.to_json(), "stage": pipe.layout.stage,
            "replica": pipe.layout.replica, "chunks": pipe.layout.chunks,
            "trace": [str(a) for a in pipe.executor.trace]}
