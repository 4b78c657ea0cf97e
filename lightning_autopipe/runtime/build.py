"""Setup's last phase: this rank's stage, process groups and executor for an agreed plan.

:func:`build_pipeline` turns a plan into what one rank runs: the plan's stage for this rank
(materialised on its device when the model was built on the meta device), the module's
parameters rebound to it, the tied copies, the process groups and the executor. Everything it
reads besides the plan is one :class:`StageSource`, fixed for a run, so the pipeline can be
built again for another plan over the same traced blocks without tracing, profiling or
planning again (:func:`rebuild_pipeline`, for live re-planning).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import swap_tensors

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.generators import generate
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.report import plan_table
from lightning_autopipe.planner.schedule import (
    Action,
    Kind,
    Schedule,
    forward_only,
    lower_communication,
)
from lightning_autopipe.profile import Profile
from lightning_autopipe.runtime.chunks import RankChunks
from lightning_autopipe.runtime.compiled_stage import compiled_stage
from lightning_autopipe.runtime.executor import PipelineExecutor, TiedParameter
from lightning_autopipe.runtime.failure import FailureBoard
from lightning_autopipe.runtime.groups import (
    ProcessGroups,
    RankLayout,
    build_groups,
    layout_for_rank,
)
from lightning_autopipe.runtime.local_stage import (
    as_call_args,
    bind_local_stage,
    model_inputs,
    restore_tensors,
    tensor_names,
)
from lightning_autopipe.runtime.materialize import Materializer, retarget_devices
from lightning_autopipe.runtime.memory import MemoryMeter
from lightning_autopipe.runtime.modes import ModeFollower
from lightning_autopipe.runtime.recompute import Recomputed

__all__ = ["LocalPipeline", "StageSource", "build_pipeline", "rebuild_pipeline"]


@dataclass
class StageSource:
    """What building a rank's pipeline reads besides the plan (fixed for a run).

    Attributes:
        module: the user's module, traced into ``blocks`` (it ends up holding the local
            stage's parameters under their original names).
        blocks: the traced :class:`~lightning_autopipe.graph.BlockGraph`.
        options: the strategy's options (compile backend, timeout, buckets, batch checks).
        rank: this process's global rank; ``names[rank]`` is its device in the plans.
        device: where this rank's stage runs.
        names: the device name of each launched rank, in rank order.
        loss_fn: the last stage's loss per slice, ``(outputs, batch slice) -> loss``.
        seed: rank 0's seed, from which a meta-device stage is initialised on every rank.
        backend: the default process group's backend (else ``options``').
        initial_state: where a meta-device stage is read from by original name (None: the
            model's own initialisers); used by the first build only.
        measure_memory: the executor measures this rank's peak memory in a training step.
        deferred: the module was built on the meta device.
        aliases: every original name of each parameter or buffer, keyed by each of its names
            (tied weights have several), taken before the first build unbinds foreign ones.
        tensors: each parameter and buffer object by original name, taken then too (a
            binding empties the slots of other stages' tensors, a rebuild restores them).
        shapes: their shapes, taken then too (a binding releases another stage's storage,
            and a rebuild allocates it again).
    """

    module: nn.Module
    blocks: Any
    options: AutoPipeOptions
    rank: int
    device: torch.device
    names: list[str]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    seed: int
    backend: str | None = None
    initial_state: Any = None
    measure_memory: bool = True
    deferred: bool = False
    aliases: dict[str, list[str]] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, torch.Size] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.aliases:
            self.aliases = tensor_names(self.module)
        if not self.tensors:
            self.tensors = dict([*self.module.named_parameters(remove_duplicate=False),
                                 *self.module.named_buffers(remove_duplicate=False)])
        if not self.shapes:
            self.shapes = {name: t.shape for name, t in self.tensors.items()}


@dataclass
class LocalPipeline:
    """Everything one rank holds of a running pipeline."""

    plan: Plan
    profile: Any
    cluster: Any
    layout: RankLayout
    groups: ProcessGroups | None
    stage: nn.Module
    executor: PipelineExecutor
    table: str
    source: StageSource | None = None  # what it was built from: rebuild_pipeline reads it
    #: Wall time this rank took to build it (a switch's rebuild: its whole local part),
    #: the measured rebuild time a live switch's cost is predicted with.
    build_ms: float = math.nan

    def nonfinite_origin(self) -> str:
        """Where a step's non-finite loss came from, in words (collective: every rank calls it).

        The first stage whose outputs were non-finite, its blocks and ranks; the last stage
        (its outputs or ``pipeline_loss``) when every stage's outputs were finite.
        """
        stage, ranks = self.executor.nonfinite_origin()
        first, stop = self.plan.stages[stage].blocks
        blocks = f"[{first}, {stop})"  # half-open, as the plan table writes it
        if stage < self.plan.num_stages - 1:
            return (
                f"values first became non-finite in the outputs of stage {stage} (blocks "
                f"{blocks}, ranks {ranks})"
            )
        return (
            f"every stage's outputs were finite up to the last stage {stage} (blocks "
            f"{blocks}, ranks {ranks}), whose outputs or loss produced it"
        )


def build_pipeline(
    source: StageSource, plan: Plan, profile: Profile | None = None, cluster: Any = None,
    *, fresh: bool = True,
) -> LocalPipeline:
    """This rank's pipeline for ``plan``; collective (process groups are created).

    With several chunks per rank (``plan.chunks_per_rank``) the rank's chunks are bound
    together as one :class:`~lightning_autopipe.runtime.chunks.RankChunks` (``pipe.stage``),
    each compiled or recomputed on its own, and the executor runs them all; a weight two of
    them use is one Parameter, a weight shared with another rank a tie group over rows.

    The plan's stage for this rank is taken from ``source.blocks``; on a meta-device model only
    that stage is materialised, on ``source.device`` (read from ``source.initial_state`` by
    original name, else initialised from ``source.seed``, see
    :mod:`~lightning_autopipe.runtime.materialize`). The module's parameters are then rebound
    to the stage (:func:`~lightning_autopipe.runtime.local_stage.bind_local_stage`). A stage
    the plan recomputes runs its forward under activation checkpointing; with
    ``options.compile`` it runs compiled. ``profile`` and ``cluster`` only label the plan's
    table.

    ``fresh`` is False for a rebuild (:func:`rebuild_pipeline`): tensors of the new stage that
    this rank released under the earlier plan get storage again, uninitialised.
    """
    start = time.perf_counter()
    options, rank, device = source.options, source.rank, source.device
    layout = layout_for_rank(plan, source.names, rank)
    held = layout.chunks  # this rank's chunks of the model (one with one chunk per rank)
    if not fresh:  # the slots an earlier binding emptied, which the stages share
        restore_tensors(source.module, source.tensors)
    # Tie groups first: they look at every stage, which binding strips of foreign parameters.
    ties = list(source.blocks.tie_groups(plan.cuts))
    parts = {c: source.blocks.stage(*plan.stages[c].blocks) for c in held}
    stage: nn.Module = parts[held[0]] if len(held) == 1 else RankChunks(parts)
    if source.deferred:
        for part in parts.values():
            retarget_devices(part, device)
    if not fresh and source.deferred:  # buffers no migration brings: created as at first
        _create_unsaved_buffers(source, parts.values(), device)
    if not fresh:  # tensors this rank did not hold under the earlier plan: storage again
        for part in parts.values():
            _allocate_released(part, source.shapes, device)
    elif source.deferred:  # only this rank's chunks ever get storage on this rank
        Materializer(source.module, source.seed, source=source.initial_state).materialize(
            [*stage.parameters(), *(b for b in stage.buffers() if b is not None)], device)
    stage = stage.to(device)
    bind_local_stage(source.module, stage, stage.param_names, aliases=source.aliases)

    # A tie across ranks sums its copies' gradients; chunks of one rank share one Parameter.
    tie_sets = [sorted({layout.position(c) for c in _tie_locals(t)}) for t in ties]
    tied = []
    for t, (tie, rows) in enumerate(zip(ties, tie_sets)):
        here = [c for c in _tie_locals(tie) if c in parts]
        if here and len(rows) > 1:
            param = dict(parts[here[0]].named_parameters(remove_duplicate=False))[
                _tie_locals(tie)[here[0]]]
            tied.append(TiedParameter(t, param, counted=layout.stage == rows[0]))
    groups = None
    timeout = options.timeout_delta
    if dist.is_available() and dist.is_initialized():
        backend = source.backend or options.process_group_backend
        groups = build_groups(layout, tie_sets, backend=backend, timeout=timeout)

    meter = None
    if source.measure_memory:
        names = source.names
        predicted = plan.peak_memory_bytes.get(names[rank], 0) if rank < len(names) else 0
        meter = MemoryMeter(list(stage.parameters()), device, predicted=predicted, rank=rank,
                            stage=layout.stage)
    module = source.module
    runs = {c: _compiled(Recomputed(part, meter) if plan.recomputes(c) else part, plan,
                          options, c)
            for c, part in parts.items()}
    row = layout.stage
    executor = PipelineExecutor(
        runs[held[0]] if len(held) == 1 else runs,
        layout,
        groups,
        num_microbatches=plan.num_microbatches,
        startup_slices=plan.startup_slices,
        drain_slices=plan.drain_slices,
        train_schedule=lambda m, k, j: lower_communication(_train(plan, m, k, j))[row],
        eval_schedule=lambda m: lower_communication(_forward_only(plan, m))[row],
        inputs_fn=lambda batch: as_call_args(model_inputs(module, batch)),
        flatten_inputs=source.blocks.flatten_inputs,
        unflatten_outputs=source.blocks.unflatten_outputs,
        loss_fn=source.loss_fn,
        device=device,
        tied=tied,
        bucket_bytes=options.bucket_bytes,
        failures=FailureBoard.for_current_group(),
        check_batch=options.check_batch,
        timeout_s=timeout.total_seconds(),
        memory=meter,
        replica_batches=plan.replica_batches,
        modes=ModeFollower(module, parts),
    )
    return LocalPipeline(
        plan=plan,
        profile=profile,
        cluster=cluster,
        layout=layout,
        groups=groups,
        stage=stage,
        executor=executor,
        table=plan_table(plan, profile, cluster),
        source=source,
        build_ms=(time.perf_counter() - start) * 1e3,
    )


def rebuild_pipeline(pipe: LocalPipeline, plan: Plan, profile: Profile | None = None,
                     cluster: Any = None) -> LocalPipeline:
    """This rank's pipeline for another ``plan`` over the blocks ``pipe`` was built from.

    Nothing is traced, profiled or planned again; collective (every rank calls it at the same
    step boundary: new process groups are created). Call it once the state this rank will
    no longer hold has been moved out (e.g. by an in-memory migration of the old stage's
    parameters, buffers and optimizer state): binding the module to the new stage releases
    the old stage's other tensors. The new stage shares the parameter objects of the blocks
    it has in common with the old one (values and ``.grad`` kept); a parameter or buffer this
    rank did not hold gets storage of its shape on ``source.device``, uninitialised, for the
    caller to load; a meta-device model's non-persistent buffers, which no migration moves,
    are created by the model's initialisers as at the first build. The old pipeline's
    executor and groups stay: the caller closes them (``pipe.executor.close()``, then
    :func:`~lightning_autopipe.runtime.groups.destroy_groups`) and builds its optimizer over
    the new stage's parameters.

    ``profile`` and ``cluster`` default to ``pipe``'s (a live switch passes the cluster with
    the measured speeds the new plan was made for).

    Raises:
        PipelineRuntimeError: ``pipe`` was not made by :func:`build_pipeline`.
    """
    if pipe.source is None:
        raise PipelineRuntimeError(
            "this LocalPipeline has no StageSource (it was not made by build_pipeline), so it "
            "cannot be rebuilt for another plan; build it with build_local_pipeline"
        )
    return build_pipeline(pipe.source, plan, profile if profile is not None else pipe.profile,
                          cluster if cluster is not None else pipe.cluster, fresh=False)


def _create_unsaved_buffers(source: StageSource, parts: Any, device: torch.device) -> None:
    """Materialise the meta non-persistent buffers of a rebuilt stage (e.g. position ids of a
    model built on the meta device) by their initialisers, as a fresh build does: they are in
    no state dict, so the migration does not move them, and storage alone would leave them
    uninitialised."""
    todo = []
    for part in parts:
        saved = {id(t) for t in part.state_dict(keep_vars=True).values()}
        todo += [b for b in part.buffers() if b is not None and b.is_meta and id(b) not in saved]
    if todo:
        Materializer(source.module, source.seed, source=source.initial_state).materialize(
            todo, device)


def _allocate_released(
    stage: Any, shapes: dict[str, torch.Size], device: torch.device
) -> None:
    """Storage of its original shape, uninitialised, for each tensor of ``stage`` that has
    none: released by an earlier binding, or never materialised (a meta-device model's)."""
    for local_key, t in [*stage.named_parameters(), *stage.named_buffers()]:
        shape = shapes.get(stage.param_names.get(local_key, local_key))
        if t is None or shape is None or (t.shape == shape and not t.is_meta):
            continue
        new = torch.empty(shape, dtype=t.dtype, device=device)
        if t.is_meta:  # another tensor type: swap the objects' contents
            swap_tensors(t, nn.Parameter(new, t.requires_grad) if isinstance(
                t, nn.Parameter) else new)
        else:
            t.data = new


def _train(plan: Plan, m: int, k: int, j: int) -> Schedule:
    """The compute-only training schedule of ``plan`` for ``m`` micro-batches, ``k`` startup
    and ``j`` drain slices (a short batch may need fewer than the plan's), keyed by rank."""
    return generate(plan.schedule, plan.num_ranks, m, k, j, plan.chunks_per_rank)


def _forward_only(plan: Plan, m: int) -> Schedule:
    """Forwards of ``m`` whole micro-batches, each through every chunk of a rank in model
    order (the projection of one sequential pass, so no rank waits on a later one)."""
    if plan.chunks_per_rank == 1:
        return forward_only(plan.num_stages, m)
    return {r: [Action(c, Kind.FORWARD, mb, 0) for mb in range(m) for c in plan.rank_stages(r)]
            for r in range(plan.num_ranks)}


def _compiled(stage: nn.Module, plan: Plan, options: AutoPipeOptions, index: int) -> nn.Module:
    """The stage as the executor runs it: compiled with ``options.compile``'s backend, if any
    (``index``: its chunk; the first chunk's backward is never split)."""
    backend = options.compile_backend
    if backend is None:
        return stage
    return compiled_stage(stage, plan.schedule, backend, stage_index=index)


def _tie_locals(tie: Any) -> dict[int, str]:
    """Stage index -> local name of the parameter in that stage (graph layer's ``TieGroup``)."""
    return {
        int(s): str(names[0] if isinstance(names, tuple | list) else names)
        for s, names in tie.stages.items()
    }
