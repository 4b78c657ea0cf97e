"""Live re-planning: decide on rank 0, agree on every rank, switch the pipeline in memory.

The pieces exist apart: step telemetry and the decision (:mod:`.monitor`, :mod:`.speeds`), the
migration of parameters, buffers and optimizer state between two plans' layouts
(:mod:`.migrate`, :mod:`.rebind`) and a new local pipeline over the same traced blocks
(:func:`~lightning_autopipe.runtime.build.rebuild_pipeline`). This module joins them at a step
boundary after the optimizer step (no gradients in flight):

1. :func:`propose` (rank 0): a plan for the measured speeds (the run's planner and pins, the
   pipeline depth kept so the data-parallel layout, and so the data loaders, stay valid), and
   :func:`~lightning_autopipe.runtime.speeds.decide_replan`'s verdict with the switch priced
   by :func:`switch_cost` (the bytes :func:`~lightning_autopipe.runtime.migrate.migrate` will
   send at the cluster's measured link rates, plus the rebuild time the running pipeline's
   build measured);
2. :func:`agree_switch`: rank 0's :class:`SwitchMessage` reaches every rank (one broadcast), so
   every rank switches at the same step or none does;
3. :func:`switch_pipeline` (every rank): snapshot the stage's tensors and named optimizer
   state, close the old executor, migrate, rebuild, load the migrated tensors into the new
   stage and rebind the optimizers in place (the same objects: schedulers keep working).

A rank whose local part fails posts its error and still joins the phase's closing all-reduce
(under ``timeout``), so every rank raises at once, naming it, instead of waiting; a rank that
dies makes its peers' waits fail within the timeout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.replica_batches import balance_replicas
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.runtime.build import LocalPipeline, rebuild_pipeline
from lightning_autopipe.runtime.data_layout import keep_replicas, same_data_layout
from lightning_autopipe.runtime.failure import FailureBoard, describe
from lightning_autopipe.runtime.migrate import Migrated, StateLayout, migrate
from lightning_autopipe.runtime.optim_state import named_optimizer_state, unwrap
from lightning_autopipe.runtime.rebind import (
    load_stage_tensors,
    rebind_optimizer,
    stage_tensors,
    tie_aliases,
)
from lightning_autopipe.runtime.speeds import ReplanDecision, decide_replan, measured_cluster
from lightning_autopipe.runtime.state_layout import plan_transfers, transfer_bytes

__all__ = [
    "SwitchMessage",
    "agree_switch",
    "optimizer_state_ratio",
    "propose",
    "state_layouts",
    "switch_cost",
    "switch_pipeline",
    "verdict_cluster",
]


@dataclass(frozen=True)
class SwitchMessage:
    """Rank 0's verdict at a re-plan boundary, the same on every rank after the broadcast.

    Attributes:
        step: the training steps done when it was decided (every rank checks it is its own).
        switch: every rank switches to ``plan``.
        reason: why (or why not), in words.
        plan: the new plan's JSON when ``switch``.
        measured_step_ms, candidate_step_ms: the slowest rank's measured step and the new
            plan's predicted one.
        switch_cost_ms: the switch's predicted cost; ``switch_bytes`` what it moves.
        speeds: device -> measured / planned speed.
        running_step_ms: the running plan's step predicted on the measured speeds (NaN when
            the check priced nothing: too few steps measured, no profile).
    """

    step: int
    switch: bool
    reason: str
    plan: str | None = None
    measured_step_ms: float = math.nan
    candidate_step_ms: float = math.nan
    switch_cost_ms: float = 0.0
    switch_bytes: int = 0
    speeds: tuple[tuple[str, float], ...] = ()
    running_step_ms: float = math.nan

    @classmethod
    def of(cls, step: int, decision: ReplanDecision, switch_bytes: int = 0) -> SwitchMessage:
        plan = decision.candidate.to_json() if decision.switch else None
        return cls(step, bool(decision.switch), decision.reason, plan,
                   float(decision.measured_step_ms), float(decision.candidate_step_ms),
                   float(decision.switch_cost_ms), int(switch_bytes),
                   tuple(sorted((decision.speeds or {}).items())),
                   float(decision.running_predicted_ms))

    def new_plan(self) -> Plan:
        assert self.plan is not None
        return Plan.from_json(self.plan)


def state_layouts(source: Any, *plans: Plan) -> list[StateLayout]:
    """The :class:`StateLayout` of each plan over ``source``'s blocks (a ``StageSource``).

    The stages of other plans share the user's submodules, whose slots the running binding
    emptied; they are filled for the reading and put back as they were after it.
    """
    with _every_slot_filled(source):
        return [StateLayout.from_plan(p, source.blocks, source.names) for p in plans]


@contextmanager
def _every_slot_filled(source: Any) -> Iterator[None]:
    held = []
    for name, t in source.tensors.items():
        path, _, attr = name.rpartition(".")
        owner = source.module.get_submodule(path) if path else source.module
        slots = owner._parameters if isinstance(t, nn.Parameter) else owner._buffers
        held.append((slots, attr, slots.get(attr)))
        slots[attr] = t
    try:
        yield
    finally:
        for slots, attr, value in held:
            slots[attr] = value


def optimizer_state_ratio(optimizers: Sequence[Any], params: Sequence[nn.Parameter]) -> float:
    """Bytes of per-parameter optimizer state per byte of parameter on this rank (Adam: about
    2; plain SGD: 0), to price the optimizer state a switch moves with the parameters."""
    want = {id(p) for p in params}
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = 0
    for opt in optimizers:
        for p, st in unwrap(opt).state.items():
            if id(p) in want:
                state_bytes += sum(v.numel() * v.element_size() for v in st.values()
                                   if isinstance(v, torch.Tensor))
    return state_bytes / param_bytes if param_bytes else 0.0


def switch_cost(pipe: LocalPipeline, candidate: Plan, *, optimizer_ratio: float,
                overhead_ms: float | None = None) -> tuple[float, int]:
    """(predicted ms, bytes) of switching ``pipe``'s plan to ``candidate``.

    Both parts are measured quantities: the bytes are what the migration sends (parameters
    with ``optimizer_ratio`` times their bytes of optimizer state, buffers alone), each
    (source, destination) pair at its link's measured bandwidth and latency in the
    pipeline's cluster, the pairs one after another (an upper bound); the rebuild (snapshot,
    new stage and process groups, executor, loading the moved tensors) costs what the
    running pipeline's own build measured (``pipe.build_ms``: after a switch, that switch's
    local part apart from the wire), unless ``overhead_ms`` is given. A measured step is no
    part of it: a switch runs no micro-batch.
    """
    source = pipe.source
    assert source is not None
    old, new = state_layouts(source, pipe.plan, candidate)
    nbytes = {}
    for name, t in source.tensors.items():
        shape = source.shapes.get(name, t.shape)
        size = math.prod(shape) * t.element_size()
        nbytes[name] = int(size * (1.0 + optimizer_ratio)) if isinstance(t, nn.Parameter) \
            else int(size)
    pairs = transfer_bytes(plan_transfers(old, new), nbytes)
    rebuild = pipe.build_ms if overhead_ms is None else overhead_ms
    ms = float(rebuild) if math.isfinite(rebuild) else 0.0
    cluster = pipe.cluster
    for (src, dst), size in pairs.items():
        a, b = source.names[src], source.names[dst]
        gbps = cluster.bandwidth_gbps(a, b) if cluster is not None else 10.0
        lat = cluster.latency_us(a, b) if cluster is not None else 50.0
        ms += size * 8 / (gbps * 1e9) * 1e3 + lat / 1e3
    return ms, int(sum(pairs.values()))


def propose(
    pipe: LocalPipeline, summaries: Sequence[Any], options: Any, *, step: int,
    remaining_steps: int, steps_since_switch: int, optimizer_ratio: float,
    overhead_ms: float | None = None,
) -> SwitchMessage:
    """Rank 0: whether to switch, and to which plan (see the module docstring).

    A pipeline without a profile (a plan given as it is) or whose re-planning fails is kept,
    with the reason.
    """
    plan, source = pipe.plan, pipe.source
    if pipe.profile is None or pipe.cluster is None or source is None:
        return SwitchMessage(step, False, "no profile to re-plan from (a given plan is kept)")
    replica_batch = plan.global_batch_size // plan.replicas
    # the pipeline's depth in ranks (a chunked plan's stages are its p v chunks)
    pins = {**options.pins, "num_stages": plan.num_ranks}
    made: list[Plan] = []
    refused: list[str] = []

    def planner(cluster: Any) -> Plan:
        if not made:  # replicas renumbered to the running ones where that is all it takes
            made.append(keep_replicas(search_plan(
                pipe.profile, cluster, source.names, replica_batch, planner=options.planner,
                schedules=options.schedules, optimizer_factor=source.options.optimizer_factor,
                balance=options.balance_replicas, **pins), plan, source.names))
            if not same_data_layout(made[0], plan, source.names):  # one the loaders allow
                made[0] = rebalance(cluster)
                refused.append("the plan for the measured speeds gives ranks other data-parallel "
                               "replicas, which the data loaders fix, so the running layout "
                               "re-balanced was judged instead: ")
        return made[0]

    def predict(p: Plan, cluster: Any) -> float:
        return simulate(p, pipe.profile, cluster).iteration_ms

    balanced: list[Plan] = []

    def rebalance(cluster: Any) -> Plan:  # the running layout, its batches for the speeds
        if not balanced:
            balanced.append(balance_replicas(plan, pipe.profile, cluster,
                                             source.options.optimizer_factor)
                            if options.balance_replicas else plan)
        return balanced[0]

    kw = dict(options=options, remaining_steps=remaining_steps,
              steps_since_switch=steps_since_switch, predict=predict, rebalance=rebalance)
    try:
        first = decide_replan(summaries, plan, pipe.cluster, planner, switch_cost_ms=0.0, **kw)
        if first.candidate is None or not first.switch:
            return SwitchMessage.of(step, first)
        cost, nbytes = switch_cost(pipe, first.candidate, optimizer_ratio=optimizer_ratio,
                                   overhead_ms=overhead_ms)
        decision = decide_replan(summaries, plan, pipe.cluster, planner, switch_cost_ms=cost,
                                 **kw)
    except Exception as exc:  # a failed re-plan keeps the running plan
        return SwitchMessage(step, False, f"re-planning failed ({describe(exc)}); the running "
                             "plan is kept")
    finally:  # pricing read the candidate's stages: the cache keeps the running plan's only
        source.blocks.keep_stages(s.blocks for s in plan.stages)
    if decision.switch and not same_data_layout(plan, decision.candidate, source.names):
        decision = replace(decision, switch=False, reason="the plan for the measured speeds "
                           "changes the data-parallel layout, which the data loaders fix")
    elif refused:
        decision = replace(decision, reason=refused[0] + decision.reason)
    return SwitchMessage.of(step, decision, nbytes)


def verdict_cluster(pipe: LocalPipeline, message: SwitchMessage) -> Any:
    """The cluster the verdict priced plans on: the pipeline's, with the measured speeds.

    A switch's new pipeline carries it (its telemetry then predicts the step the new plan was
    chosen for, and the next check measures speeds against the ones it was planned with), and
    so does a kept pipeline whose ranks measure away from their planned speeds
    (:func:`~lightning_autopipe.runtime.speeds.speeds_moved`): the closed loop's prediction of
    the running plan. The same on every rank (one message, one cluster). None without one."""
    return measured_cluster(pipe.cluster, dict(message.speeds)) if pipe.cluster else None


def agree_switch(message: SwitchMessage | None, *, rank: int, step: int,
                 broadcast: Callable[[Any, int], Any]) -> SwitchMessage:
    """Rank 0's ``message`` on every rank (collective through ``broadcast(obj, src)``)."""
    got = broadcast(message if rank == 0 else None, 0)
    if not isinstance(got, SwitchMessage) or got.step != step:
        raise PipelineRuntimeError(
            f"rank {rank} expected rank 0's re-plan verdict for step {step} but received "
            f"{got!r}; every rank must run the same version with the same replan options"
        )
    return got


def switch_pipeline(
    pipe: LocalPipeline, plan: Plan, optimizers: Sequence[Any], *, scaler: Any = None,
    step: int | None = None, timeout: timedelta = timedelta(seconds=60),
    on_built: Callable[[LocalPipeline], None] | None = None, cluster: Any = None,
) -> tuple[LocalPipeline, Migrated]:
    """Every rank: move this rank's training state to ``plan``'s layout and return its new
    pipeline (collective; call on every rank at the same step boundary).

    ``optimizers`` are rebound in place to the new stage's parameters with their migrated
    state; ``scaler`` (a gradient scaler with ``state_dict`` / ``load_state_dict``) gets the
    migrated (rank 0's) state. ``on_built`` receives the new pipeline as soon as it exists,
    so a caller can release it should a later part fail. The old pipeline's executor is
    closed; its process groups are the caller's to destroy (on every rank together).
    ``cluster``: the one ``plan`` was made for (:func:`verdict_cluster`); default the old
    pipeline's.

    Raises:
        PipelineRuntimeError: a rank failed in its part; every rank raises, naming it.
    """
    source = pipe.source
    if source is None:
        raise PipelineRuntimeError("switch_pipeline needs a pipeline made by build_pipeline")
    board = FailureBoard.for_current_group()
    rank = source.rank
    when = f"the switch of plans after step {step}" if step is not None else "a switch of plans"
    blocks = source.blocks

    def local(what: str, fn: Callable[[], Any]) -> Any:
        error, out = None, None
        try:
            out = fn()
        except Exception as exc:
            error = exc
            if board is not None:
                board.post(f"rank {rank} failed in {what} of {when}: {describe(exc)}")
        _closing(error, rank, what, when, board, timeout)
        return out

    def snapshot() -> tuple[dict, list]:
        tensors = stage_tensors(pipe.stage, tie_aliases(blocks, pipe.plan.cuts))
        ids = {id(t): n for n, t in tensors.items()}
        return tensors, [named_optimizer_state(o, ids) for o in optimizers]

    start = time.perf_counter()
    tensors, named = local("snapshotting its stage", snapshot)
    old_layout, new_layout = state_layouts(source, pipe.plan, plan)
    pipe.executor.close()  # its gradient hooks sit on parameters the new stage may share
    wire = time.perf_counter()
    got = migrate(tensors, old_layout, new_layout, optimizers=named,
                  scaler=scaler.state_dict() if scaler is not None else None,
                  device=source.device, timeout=timeout, failures=board, step=step)
    wire = time.perf_counter() - wire
    new = rebuild_pipeline(pipe, plan, cluster=cluster)
    if on_built is not None:
        on_built(new)

    def load() -> None:
        aliases = tie_aliases(blocks, plan.cuts)
        load_stage_tensors(new.stage, got.tensors, aliases)
        params = {n: p for n, p in stage_tensors(new.stage, aliases).items()
                  if isinstance(p, nn.Parameter)}
        for opt, state in zip(optimizers, got.optimizers):
            rebind_optimizer(opt, params, state)
        if scaler is not None and got.scaler:
            scaler.load_state_dict(got.scaler)

    local("loading its new stage", load)
    blocks.keep_stages(s.blocks for s in plan.stages)  # the old plan's stages are gone
    # The next switch's rebuild is priced by this one's local part (everything but the wire).
    new.build_ms = (time.perf_counter() - start - wire) * 1e3
    return new, got


def _closing(error: BaseException | None, rank: int, what: str, when: str,
             board: FailureBoard | None, timeout: timedelta) -> None:
    """Every rank learns whether any failed its local part (one all-reduce under ``timeout``);
    all raise together, the failed rank its own error, the others naming it."""
    flag = torch.tensor([1.0 if error is not None else 0.0], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        start = time.monotonic()
        try:
            dist.all_reduce(flag, async_op=True).wait(timeout)
        except Exception as exc:
            first = board.first(wait_s=2.0) if board is not None else None
            raise PipelineRuntimeError(
                f"rank {rank} stopped in {when}: "
                + (first or f"a peer did not finish {what} within "
                   f"{time.monotonic() - start:.0f} s ({describe(exc)}); it died or hung: "
                   "check its log")
            ) from (error or exc)
    if error is not None:
        raise PipelineRuntimeError(
            f"rank {rank} failed in {what} of {when}: {describe(error)}") from error
    if float(flag.sum()) > 0:
        first = board.first(wait_s=2.0) if board is not None else None
        raise PipelineRuntimeError(
            f"rank {rank} stopped {when} because "
            + (first or "another rank failed its part (see its log)"))
