"""Cases of in-memory layout migration, run by every rank of one gloo world in turn.

Each case trains a tiny model from ``split_model`` stages under a list of layouts (a few steps
each) and migrates between them with :func:`~lightning_autopipe.runtime.migrate.migrate`;
:func:`reference` trains the same model in one process on the same global batches. A rank
releases every tensor its stage does not hold (as ``bind_local_stage`` does), so whatever the
new stage needs must arrive through the migration.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lightning_autopipe.graph import split_model
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.schedule import forward_only, lower_communication, one_f_one_b
from lightning_autopipe.runtime import migrate as migrate_mod
from lightning_autopipe.runtime import migrate_wire
from lightning_autopipe.runtime.executor import PipelineExecutor, TiedParameter
from lightning_autopipe.runtime.groups import build_groups, destroy_groups, layout_for_rank
from lightning_autopipe.runtime.migrate import StateLayout, migrate
from lightning_autopipe.runtime.optim_state import named_optimizer_state
from lightning_autopipe.runtime.rebind import (
    load_stage_tensors,
    rebind_optimizer,
    stage_tensors,
    tie_aliases,
)
from lightning_autopipe.runtime.scaler import PipelineGradScaler
from lightning_autopipe.runtime.units import unit_bounds
from lightning_autopipe.zoo.models import SmallCNN, TinyGPT
from tests._gloo import TIMEOUT_S

BATCH, M = 8, 2  # global batch, micro-batches per replica (units of BATCH / replicas / 2)
SCALER = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5,
          "growth_interval": 2}
#: Every collective's timeout, the gloo worlds' (a failure case ends on the failing rank's
#: error or a closed connection, not on this).
TIMEOUT = timedelta(seconds=TIMEOUT_S)


@dataclass(frozen=True)
class Layout:
    """Stage cuts x replicas; ``reverse`` puts the stages on the ranks in reverse order."""

    cuts: tuple[int, ...]
    replicas: int = 1
    reverse: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "gpt" | "cnn_bn"
    optimizer: str  # "adam" | "sgd"
    layouts: tuple[Layout, ...]
    steps: int = 2  # per layout
    scheduler: bool = False
    scaler: bool = False
    overflow_step: int | None = None  # a gradient of wpe.weight is set to inf at this step
    failure: str | None = None  # "raise" | "bad-input" | "die": rank 1 fails in the migration
    extra: dict[str, Any] = field(default_factory=dict)


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "gpt":
        return TinyGPT(vocab=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)
    return SmallCNN(widths=(4, 8), blocks_per_stage=1, batch_norm=True)


def batch(model: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if model == "gpt":
        return (torch.randint(0, 32, (BATCH, 8), generator=g),
                torch.randint(0, 32, (BATCH, 8), generator=g))
    return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def loss_fn(out: torch.Tensor, part: Any) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), part[1].reshape(-1))


def optimizer(case: Case, params: Any) -> tuple[torch.optim.Optimizer, Any]:
    if case.optimizer == "adam":
        # eps bounds Adam's division in coordinates whose gradient is rounding noise only
        # (an attention key bias: softmax ignores it), which would turn the noise into steps
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=0.01, eps=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if case.scheduler \
        else None
    return opt, sched


def _optimizer_step(opt: torch.optim.Optimizer, sched: Any, scaler: Any, scales: list) -> None:
    """Either run's step: through ``scaler`` (its new scale appended to ``scales``) or plain,
    then the learning-rate schedule."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    else:
        opt.step()
    if sched is not None:
        sched.step()


def plan_of(layout: Layout) -> Plan:
    n = len(layout.cuts) - 1
    order = list(range(n))[::-1] if layout.reverse else list(range(n))
    devs = {s: [f"cpu0:{order[s] * layout.replicas + r}" for r in range(layout.replicas)]
            for s in range(n)}
    stages = [StagePlan(blocks=(a, b), devices=devs[s])
              for s, (a, b) in enumerate(zip(layout.cuts, layout.cuts[1:]))]
    return Plan(planner="pinned", global_batch_size=BATCH, num_microbatches=M,
                startup_slices=1, stages=stages)


def _tied(blocks: Any, plan: Plan, stage: nn.Module, s: int) -> tuple[list, list]:
    ties = blocks.tie_groups(plan.cuts)
    sets = [sorted(t.stages) for t in ties]
    local = dict(stage.named_parameters(remove_duplicate=False))
    tied = [TiedParameter(i, local[t.stages[s][0]], counted=s == min(t.stages))
            for i, t in enumerate(ties) if s in t.stages and len(t.stages) > 1]
    return sets, tied


class _Pipeline:
    """One layout's stage, groups and executor on this rank."""

    def __init__(self, blocks: Any, layout: Layout, rank: int, world: int,
                 migrated: dict[str, torch.Tensor] | None = None) -> None:
        self.plan = plan_of(layout)
        self.names = [f"cpu0:{i}" for i in range(world)]
        self.lay = layout_for_rank(self.plan, self.names, rank)
        self.aliases = tie_aliases(blocks, self.plan.cuts)
        s = self.lay.stage
        self.stage = blocks.stage(*self.plan.stages[s].blocks)
        if migrated is not None:  # before the executor sizes its gradient buckets
            load_stage_tensors(self.stage, migrated, self.aliases)
        sets, tied = _tied(blocks, self.plan, self.stage, s)
        self.groups = build_groups(self.lay, sets, timeout=TIMEOUT)
        n = self.plan.num_stages
        self.executor = PipelineExecutor(
            self.stage, self.lay, self.groups, num_microbatches=M, startup_slices=1,
            train_schedule=lambda m, k, j: lower_communication(one_f_one_b(n, m, k, j))[s],
            eval_schedule=lambda m: lower_communication(forward_only(n, m))[s],
            inputs_fn=lambda b: (b[0],), flatten_inputs=blocks.flatten_inputs,
            unflatten_outputs=blocks.unflatten_outputs, loss_fn=loss_fn,
            device=torch.device("cpu"), tied=tied, timeout_s=TIMEOUT.total_seconds(),
        )

    def shard(self, full: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        per = BATCH // self.lay.num_replicas
        r = self.lay.replica
        return tuple(t[r * per : (r + 1) * per] for t in full)

    def tensors(self) -> dict[str, torch.Tensor]:
        return stage_tensors(self.stage, self.aliases)

    def close(self) -> None:
        self.executor.close()
        destroy_groups(self.groups)


def _release(tensors: dict[str, torch.Tensor], keep: set[int]) -> None:
    for t in tensors.values():
        if id(t) not in keep:
            if isinstance(t, nn.Parameter):
                t.grad = None
            t.data = torch.empty(0, dtype=t.dtype)


class _Dying:
    """``torch.distributed`` as the migration sees it, on a rank that dies in the transfer."""

    def __getattr__(self, name: str) -> Any:
        if name == "batch_isend_irecv":
            os._exit(17)
        return getattr(dist, name)


def _inject(case: Case, rank: int) -> dict[tuple[Any, str], Any]:
    """Rank 1's failure for the case; returns what it replaced, to put back after it."""
    if rank != 1 or case.failure in (None, "bad-input"):
        return {}
    saved = {(migrate_wire, "unpack_entry"): migrate_wire.unpack_entry,
             (migrate_mod, "dist"): migrate_mod.dist}
    if case.failure == "raise":
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected failure while unpacking")
        migrate_wire.unpack_entry = broken
    elif case.failure == "die":
        migrate_mod.dist = _Dying()
    return saved


def run_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    net = build(case.model)
    blocks = split_model(net, (batch(case.model, 0)[0][:2],))
    pipe = _Pipeline(blocks, case.layouts[0], rank, world)
    everything = stage_tensors(net)
    _release(everything, {id(t) for t in pipe.tensors().values()})
    opt, sched = optimizer(case, pipe.executor.parameters)
    scaler = PipelineGradScaler("cpu", **SCALER) if case.scaler else None
    rows: dict[str, Any] = {"losses": [], "scales": [], "stats": [], "rank": rank}
    step = 0
    for phase, layout in enumerate(case.layouts):
        if phase:
            old, new = pipe, None
            old_layout = StateLayout.from_plan(old.plan, blocks, old.names)
            new_plan = plan_of(layout)
            new_layout = StateLayout.from_plan(new_plan, blocks, old.names)
            tensors = old.tensors()
            names = {id(p): n for n, p in tensors.items()}
            named = named_optimizer_state(opt, names)
            old.close()
            if case.failure == "bad-input" and rank == 1:
                tensors = dict(list(tensors.items())[1:])
            saved = _inject(case, rank)
            try:
                got = migrate(tensors, old_layout, new_layout, optimizers=[named],
                              scaler=scaler.state_dict() if scaler else None, timeout=TIMEOUT,
                              step=step)
            except Exception as exc:
                rows["error"] = (type(exc).__name__, str(exc))
                return rows
            finally:
                for (module, attr), value in saved.items():
                    setattr(module, attr, value)
            new = _Pipeline(blocks, layout, rank, world, got.tensors)
            kept = {id(t) for t in new.tensors().values()}
            _release(tensors, kept)
            params = {n: p for n, p in new.tensors().items() if isinstance(p, nn.Parameter)}
            rebind_optimizer(opt, params, got.optimizers[0])
            if scaler is not None:  # a fresh scaler, as a strategy rebuilding it would make
                scaler = PipelineGradScaler("cpu", **SCALER)
                scaler.load_state_dict(got.scaler)
            rows["stats"].append(got.stats)
            pipe = new
        if scaler is not None:
            pipe.executor.loss_scale = scaler.scale
        for _ in range(case.steps):
            opt.zero_grad(set_to_none=True)
            loss = pipe.executor.train_step(pipe.shard(batch(case.model, step)), step=step)
            if step == case.overflow_step and "wpe.weight" in pipe.tensors():
                pipe.tensors()["wpe.weight"].grad[0, 0] = float("inf")
            if scaler is not None:
                scaler.unscale_(opt)  # a stage that scales no loss has no scale before this
            _optimizer_step(opt, sched, scaler, rows["scales"])
            rows["losses"].append(float(loss))
            step += 1
    rows["state"] = {n: t.detach().clone() for n, t in pipe.tensors().items()}
    rows["replica"] = pipe.lay.replica
    pipe.close()
    return rows


def reference(case: Case) -> dict[str, Any]:
    """One process on the global batches; BatchNorm: each replica's units in order with its
    own statistics, a new replica starting from the statistics of old replica ``r mod R``."""
    net = build(case.model)
    opt, sched = optimizer(case, net.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER) if case.scaler else None
    bn = case.model == "cnn_bn"
    buffers = [{k: v.clone() for k, v in net.named_buffers()}]
    out: dict[str, Any] = {"losses": [], "scales": []}
    step = 0
    for layout in case.layouts:
        R = layout.replicas
        buffers = [buffers[r % len(buffers)] for r in range(R)]
        for _ in range(case.steps):
            opt.zero_grad(set_to_none=True)
            x, y = batch(case.model, step)
            if bn:
                total = 0.0
                per = BATCH // R
                for r in range(R):
                    _load(net, buffers[r])
                    xs, ys = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
                    for lo, hi in unit_bounds(per, M, 1, 1).values():
                        part = (xs[lo:hi], ys[lo:hi])
                        loss = loss_fn(net(part[0]), part) * ((hi - lo) / per) / R
                        loss.backward()
                        total += float(loss.detach())
                    buffers[r] = {k: v.clone() for k, v in net.named_buffers()}
                out["losses"].append(total)
            else:
                loss = loss_fn(net(x), (x, y))
                (scaler.scale(loss) if scaler else loss).backward()
                out["losses"].append(float(loss.detach()))
            if step == case.overflow_step:
                net.wpe.weight.grad[0, 0] = float("inf")
            _optimizer_step(opt, sched, scaler, out["scales"])
            step += 1
    out["states"] = []
    for r in range(len(buffers)):
        if bn:
            _load(net, buffers[r])
        out["states"].append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return out


def _load(net: nn.Module, bufs: dict[str, torch.Tensor]) -> None:
    for name, buf in net.named_buffers():
        buf.copy_(bufs[name])


def world(rank: int, size: int, port: int, out: str, cases: list[Case]) -> None:
    """One rank of a world: every case in turn, each one's result saved as it ends."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=TIMEOUT)
    try:
        for case in cases:
            t0 = time.perf_counter()
            try:
                rows = run_case(case, rank, size)
            except Exception as exc:  # recorded: the test names the case that broke
                rows = {"crash": f"{type(exc).__name__}: {exc}", "rank": rank}
            rows["seconds"] = time.perf_counter() - t0
            torch.save(rows, f"{out}/{case.name}.rank{rank}.pt")
            if "crash" in rows:
                break
    finally:
        dist.destroy_process_group()
