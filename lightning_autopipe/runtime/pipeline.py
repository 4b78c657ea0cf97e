"""Build this rank's part of a pipeline: trace, profile, (rank 0) plan, local stage, groups.

Kept apart from the Lightning strategy so the benchmark and tests can build a pipeline from any
``nn.Module`` with a ``pipeline_loss`` under a plain ``torch.distributed`` launch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_autopipe import errors
from lightning_autopipe.errors import InputError, PipelineRuntimeError, PlanError
from lightning_autopipe.graph.trace import has_meta
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.generators import SCHEDULES
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.report import plan_table
from lightning_autopipe.planner.schedule import forward_only, lower_communication
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.profile import Profile
from lightning_autopipe.runtime import profiler
from lightning_autopipe.runtime.checks import (
    check_loss_contract,
    check_num_stages,
    check_plan_for_run,
)
from lightning_autopipe.runtime.compiled_stage import compiled_stage, profile_for
from lightning_autopipe.runtime.discover import (
    compare_with_declared,
    device_names,
    discover,
    gather_reports,
    host_name,
    write_cluster,
)
from lightning_autopipe.runtime.executor import PipelineExecutor, TiedParameter
from lightning_autopipe.runtime.failure import FailureBoard
from lightning_autopipe.runtime.groups import (
    ProcessGroups,
    RankLayout,
    build_groups,
    layout_for_rank,
)
from lightning_autopipe.runtime.local_stage import as_call_args, bind_local_stage, model_inputs
from lightning_autopipe.runtime.materialize import Materializer, retarget_devices
from lightning_autopipe.runtime.memory import MemoryMeter
from lightning_autopipe.runtime.recompute import Recomputed
from lightning_autopipe.runtime.units import slice_batch

__all__ = ["LocalPipeline", "build_local_pipeline", "resolve_cluster"]


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


def resolve_cluster(
    cluster: Any,
    world_size: int,
    device: torch.device,
    exact: bool = False,
    calibrate: bool = True,
    num_nodes: int = 1,
) -> Any:
    """A ``Cluster`` from an instance, a YAML path, or None (the launched world, homogeneous).

    ``exact`` requires the cluster to describe exactly the launched devices (not more); with
    ``num_nodes > 1`` launcher node ``i`` must be the file's server instance ``i``. For
    None, with ``calibrate``, more than one process and ``torch.distributed`` initialized, the
    link of ``Cluster.local`` and its all-reduce's reduction rate are measured
    (:func:`~lightning_autopipe.runtime.calibrate.measure_link` and ``measure_reduce``,
    collectives: every rank calls this before any other collective, in the same order) instead
    of assumed, since the planner prices pipeline transfers and gradient all-reduces with them;
    rank 0 reports the figures once. Otherwise the fixed defaults stay.
    """
    from lightning_autopipe.cluster import Cluster

    if cluster is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        link = reduce = None
        if calibrate and world_size > 1 and dist.is_available() and dist.is_initialized():
            from lightning_autopipe.runtime.calibrate import measure_link, measure_reduce

            link = measure_link(device=device)
            # Across nodes the all-reduce would also time the network, which the one-server
            # local cluster cannot describe: there the reduction stays free (a cluster file
            # describes such a run properly).
            if link is not None:
                reduce = measure_reduce(link, device=device) if num_nodes == 1 else math.inf
        if link is None or reduce is None:
            return Cluster.local(world_size, device_name=name)
        latency_us, gbps = link
        if dist.get_rank() == 0:
            from lightning_autopipe.runtime.log import rank_zero_info

            rank_zero_info(
                f"local cluster: {dist.get_backend()} link measured at {gbps:.2f} Gb/s, "
                f"{latency_us:.1f} us per message; all-reduce reduces at "
                + (f"{reduce:.2f} Gb/s" if math.isfinite(reduce) else "no extra cost")
            )
        return Cluster.local(
            world_size, device_name=name, gbps=gbps, latency_us=latency_us, reduce_gbps=reduce
        )
    if isinstance(cluster, str | Path):
        cluster = Cluster.load(cluster)
    cluster.validate_world_size(world_size, exact=exact)
    cluster.validate_nodes(num_nodes, world_size // max(num_nodes, 1))
    if cluster.num_devices > world_size and (not dist.is_initialized() or dist.get_rank() == 0):
        from lightning_autopipe.runtime.log import rank_zero_info

        used = cluster.devices[:world_size]
        rank_zero_info(
            f"cluster {cluster.name!r} describes {cluster.num_devices} devices; this run of "
            f"{world_size} processes is planned on the first {world_size} in file order "
            f"({used[0].name} .. {used[-1].name})"
        )
    return cluster


def _reraise_from_rank0(kind: str, message: str, cause: BaseException | None = None) -> None:
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.AutoPipeError):
        raise cls(f"(raised on rank 0) {message}") from cause
    raise PipelineRuntimeError(
        f"rank 0 failed while profiling/planning: {kind}: {message}"
    ) from cause


class _LossProfileError(Exception):
    """``pipeline_loss`` failed on the example batch while profiling (not a user-facing error)."""


def _profile(
    blocks: Any,
    example: Any,
    example_batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device,
    repeats: int,
) -> Any:
    """``profile_blocks`` with the training loss on the last block when a batch is known.

    The loss's first ``n`` samples are ``slice_batch(example_batch, 0, n, size)`` with ``size``
    the example's sample count, as the executor slices a batch for a micro-batch. Should
    ``pipeline_loss`` fail here (e.g. it logs, which Lightning refuses before the loop runs),
    the blocks are profiled without the loss, as before it was profiled, with a warning.
    """
    if example_batch is None:
        return profiler.profile_blocks(blocks, example, device=str(device), repeats=repeats)
    flat = blocks.flatten_inputs(example)
    size = next((int(t.shape[0]) for t in flat if t.dim() > 0), 1)
    batch = apply_to_collection(example_batch, torch.Tensor, lambda t: t.to(device))

    def loss(outputs: tuple[Any, ...], n: int) -> torch.Tensor:
        try:
            return loss_fn(blocks.unflatten_outputs(outputs), slice_batch(batch, 0, n, size))
        except Exception as exc:
            raise _LossProfileError(f"{type(exc).__name__}: {exc}") from exc

    try:
        return profiler.profile_blocks(
            blocks, example, device=str(device), repeats=repeats, loss_fn=loss
        )
    except _LossProfileError as exc:
        warnings.warn(
            f"pipeline_loss failed on the example batch while profiling ({exc}); profiling "
            "without the loss, so the plan underestimates the last stage",
            stacklevel=3,
        )
    return profiler.profile_blocks(blocks, example, device=str(device), repeats=repeats)


def _tie_locals(tie: Any) -> dict[int, str]:
    """Stage index -> local name of the parameter in that stage (graph layer's ``TieGroup``)."""
    return {
        int(s): str(names[0] if isinstance(names, tuple | list) else names)
        for s, names in tie.stages.items()
    }


def build_local_pipeline(
    module: nn.Module,
    example: tuple[Any, ...] | dict[str, Any],
    replica_batch: int,
    options: AutoPipeOptions,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    broadcast: Callable[[Any, int], Any],
    backend: str | None = None,
    example_batch: Any = None,
    num_nodes: int = 1,
    run_dir: str | Path | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    initial_state: Any = None,
    measure_memory: bool = True,
) -> LocalPipeline:
    """Trace on every rank, profile on every rank, plan on rank 0, keep only the local stage.

    Every rank traces (so an untraceable model raises the graph layer's ``TraceError`` on every
    rank before any collective, never a hang). Without a given plan every rank profiles on its
    own ``device`` at the same time (in training all ranks compute at once and contend for
    shared cores and memory bandwidth, so a profile taken while the others idle would be
    optimistic), and a rank whose profiling fails stops every rank with its error.

    Without a cluster file the cluster is discovered from the ranks
    (:func:`~lightning_autopipe.runtime.discover.discover`: hosts, devices, each rank's own
    profile, measured links) and, when ``run_dir`` is given, written there as
    ``cluster.yaml`` with a profile per device type; rank 0 plans from the fastest type's
    profile, pricing every other type from its own. With a cluster file rank 0 plans from its
    own profile on that cluster and warns where the file contradicts what the ranks measured.
    Without ``torch.distributed`` (a single process) the launched world is ``Cluster.local``.
    Rank 0's plan (or its error) is broadcast. The module's parameters are then rebound to the
    local stage (:func:`bind_local_stage`). User input is checked first (``pipeline_loss``,
    cluster size, pinned depth vs. blocks, a given plan's fingerprint, batch and memory) so a
    bad configuration fails on every rank before any profiling or training.

    ``options`` are the strategy's: the cluster, the given plan (or the planner and its pins),
    the granularity, profiling repeats and the runtime's settings. ``backend`` overrides
    ``options.process_group_backend`` with the one the default group was started with.

    ``example_batch``, when given, is the batch the ``example`` inputs came from, holding the
    same samples (its per-sample tensors have the example's first dimension). The last block is
    then profiled with ``module.pipeline_loss`` on it, as the last stage runs in training;
    without it the loss is left out of the profile.

    ``loss_fn``, when given, is the last stage's loss per slice instead of
    ``module.pipeline_loss`` (the strategy passes its runner of the module's own steps).

    A module whose parameters are on the meta device (built under
    :func:`~lightning_autopipe.runtime.materialize.deferred_init`, e.g. in ``configure_model``)
    is traced on shapes, profiled block by block (one block's parameters materialised at a
    time; none with a given plan) and only the local stage is materialised, on ``device``:
    read by original name from ``initial_state`` (a mapping such as a memory-mapped
    checkpoint's ``state_dict``, or a sharded checkpoint's reader: only this stage's keys are
    read), else initialised by the model's own initialisers from rank 0's
    ``torch.initial_seed()`` (the same weights under any layout, see
    :mod:`~lightning_autopipe.runtime.materialize`). ``initial_state`` is refused for a
    module built for real (it already holds its weights).

    With ``measure_memory`` the executor measures this rank's peak memory in the second
    training step and rank 0 logs every rank's beside the plan's prediction
    (:mod:`~lightning_autopipe.runtime.memory`). A stage the plan recomputes runs its forward
    under activation checkpointing (its backward recomputes it).

    With ``options.compile`` the executor runs the local stage compiled once
    (:mod:`~lightning_autopipe.runtime.compiled_stage`; under a schedule that splits the
    backward, its compiled backward is cut into input- and weight-gradient graphs) and each
    rank's profile is corrected to the compiled speed.
    """
    from lightning_autopipe.graph import split_model

    if loss_fn is None:
        check_loss_contract(module)
        loss_fn = module.pipeline_loss
    deferred = has_meta(module)
    if initial_state is not None and not deferred:
        raise InputError(
            "initial_state is for a model built on the meta device (its stage is read from "
            "it); this module already holds its weights: load them into it before the "
            "pipeline is built, or build it under deferred_init() / trainer.init_module()"
        )
    planning = options.plan is None  # else the given plan is used as it is
    distributed = dist.is_available() and dist.is_initialized() and world_size > 1
    discovering = planning and options.cluster is None and distributed
    cluster = None
    if not discovering:  # every rank, before any other collective
        cluster = resolve_cluster(
            options.cluster,
            world_size,
            device,
            exact=options.exact_cluster,
            calibrate=planning,
            num_nodes=num_nodes,
        )
    names = _launched_names(cluster, options, world_size) if cluster is not None else []
    blocks = split_model(module, example, granularity=options.granularity)
    pins = options.pins
    check_num_stages(pins["num_stages"], len(blocks), world_size, options.granularity)

    payload: Any = None
    failure: BaseException | None = None
    load_failure: BaseException | None = None  # another rank's throw-away profile failed
    profile = mine = None
    repeats = options.profile_repeats
    if planning and (distributed or rank != 0):
        try:
            mine = profile_for(options.compile_backend, _profile(
                blocks, example, example_batch, loss_fn, device, repeats), blocks, example, device)
        except Exception as exc:
            if not distributed:  # a pretend world: only load for rank 0's profile
                load_failure = exc
            else:
                _stop_everywhere(exc, rank)
        if distributed:
            _stop_everywhere(None, rank)  # no rank failed: go on together
    if discovering:
        cluster, profile, _ = discover(mine, device)
        names = [d.name for d in cluster.devices]
        if rank == 0 and run_dir is not None:
            where = write_cluster(cluster, run_dir, profile)
            _info(f"discovered cluster written to {where} (reuse it as cluster=<that file>)")
    elif planning and distributed:
        reports = gather_reports(mine, device)
        if rank == 0:
            for line in compare_with_declared(cluster, reports):
                warnings.warn(f"cluster {cluster.name!r} contradicts the measurement: {line}",
                              stacklevel=2)
    if rank == 0:
        try:
            if planning:
                if profile is None:
                    profile = mine if distributed else profile_for(
                        options.compile_backend, _profile(
                            blocks, example, example_batch, loss_fn, device, repeats),
                        blocks, example, device)
                plan = search_plan(
                    profile, cluster, names, replica_batch, planner=options.planner,
                    schedules=options.schedules, **pins
                )
                _check_fingerprint(plan, blocks)
            else:
                plan = options.given_plan()
                _check_fingerprint(plan, blocks)
                check_plan_for_run(plan, replica_batch, cluster)
            seed = torch.initial_seed()  # every rank initialises its stage from rank 0's seed
            payload = ("ok", plan.to_json(), profile.to_json() if profile is not None else None,
                       seed)
        except Exception as exc:  # every rank must learn of it, or they would wait forever
            failure = exc
            payload = ("error", type(exc).__name__, str(exc))
    payload = broadcast(payload, 0)
    if payload[0] == "error":
        if failure is not None:
            raise failure
        _reraise_from_rank0(payload[1], payload[2], cause=load_failure)
    if load_failure is not None:
        warnings.warn(
            f"rank {rank}: profiling (as load while rank 0 profiled) failed with "
            f"{type(load_failure).__name__}: {load_failure}; rank 0 profiled fine, continuing "
            "with its plan",
            stacklevel=2,
        )
    plan = Plan.from_json(payload[1])
    profile = Profile.from_json(payload[2]) if payload[2] is not None else None
    seed = int(payload[3]) if len(payload) > 3 else torch.initial_seed()

    layout = layout_for_rank(plan, names, rank)
    s = layout.stage
    i, j = plan.stages[s].blocks
    # Tie groups first: they look at every stage, which binding strips of foreign parameters.
    ties = list(blocks.tie_groups(plan.cuts))
    stage = blocks.stage(i, j)
    if deferred:  # only this stage ever gets storage on this rank
        retarget_devices(stage, device)
        Materializer(module, seed, source=initial_state).materialize(
            [*stage.parameters(), *(b for b in stage.buffers() if b is not None)], device)
    stage = stage.to(device)
    bind_local_stage(module, stage, stage.param_names)

    tie_sets = [sorted(_tie_locals(t)) for t in ties]
    local_params = dict(stage.named_parameters(remove_duplicate=False))
    tied = []
    for t, tie in enumerate(ties):
        where = _tie_locals(tie)
        if s in where and len(where) > 1:
            tied.append(TiedParameter(t, local_params[where[s]], counted=s == min(where)))
    groups = None
    timeout = options.timeout_delta
    if dist.is_available() and dist.is_initialized():
        backend = backend or options.process_group_backend
        groups = build_groups(layout, tie_sets, backend=backend, timeout=timeout)

    gen = SCHEDULES[plan.schedule]
    num_stages = plan.num_stages
    recompute = plan.recomputes(s)
    meter = None
    if measure_memory:
        predicted = plan.peak_memory_bytes.get(names[rank], 0) if rank < len(names) else 0
        meter = MemoryMeter(list(stage.parameters()), device, predicted=predicted, rank=rank,
                            stage=s)
    executor = PipelineExecutor(
        _compiled(Recomputed(stage) if recompute else stage, plan, options, first=s == 0),
        layout,
        groups,
        num_microbatches=plan.num_microbatches,
        startup_slices=plan.startup_slices,
        drain_slices=plan.drain_slices,
        train_schedule=lambda m, k, j: lower_communication(gen(num_stages, m, k, j))[s],
        eval_schedule=lambda m: lower_communication(forward_only(num_stages, m))[s],
        inputs_fn=lambda batch: as_call_args(model_inputs(module, batch)),
        flatten_inputs=blocks.flatten_inputs,
        unflatten_outputs=blocks.unflatten_outputs,
        loss_fn=loss_fn,
        device=device,
        tied=tied,
        bucket_bytes=options.bucket_bytes,
        failures=FailureBoard.for_current_group(),
        check_batch=options.check_batch,
        timeout_s=timeout.total_seconds(),
        memory=meter,
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
    )


def _compiled(stage: nn.Module, plan: Plan, options: AutoPipeOptions, first: bool) -> nn.Module:
    """The stage as the executor runs it: compiled with ``options.compile``'s backend, if any
    (``first``: the pipeline's first stage, whose backward is never split)."""
    backend = options.compile_backend
    if backend is None:
        return stage
    return compiled_stage(stage, plan.schedule, backend, first=first)


def _info(text: str) -> None:
    from lightning_autopipe.runtime.log import rank_zero_info

    rank_zero_info(text)


def _stop_everywhere(exc: BaseException | None, rank: int) -> None:
    """Collective: when any rank's ``exc`` is set, every rank raises with that rank's error.

    A rank that fails alone would leave the others waiting in the next collective; so every
    rank says how its profiling went and all of them stop on the first failure (the failing
    rank re-raises its own exception, the others a :class:`PipelineRuntimeError` naming it).
    """
    said = None if exc is None else f"{type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, said)
    failed = [(r, msg) for r, msg in enumerate(everyone) if msg is not None]
    if not failed:
        return
    if exc is not None:
        raise exc
    first, msg = failed[0]
    raise PipelineRuntimeError(
        f"rank {first} failed while profiling the blocks for discovery and planning: {msg}"
    )


def _launched_names(cluster: Any, options: AutoPipeOptions, world_size: int) -> list[str]:
    """Device names of the launched ranks: the cluster's, or for a given plan made on a
    discovered cluster (host-named devices) run without a cluster file, the names discovery
    gives these hosts (a collective then: every rank's host is gathered)."""
    names = [d.name for d in cluster.devices[:world_size]]
    plan = options.given_plan() if options.plan is not None else None
    if options.cluster is not None or plan is None or set(plan.devices) <= set(names):
        return names
    if not (dist.is_available() and dist.is_initialized()):
        return names
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_name())
    return device_names(hosts)


def _check_fingerprint(plan: Plan, blocks: Any) -> None:
    mine = getattr(blocks, "fingerprint", None)
    if plan.fingerprint and mine and plan.fingerprint != mine:
        raise PlanError(
            f"the plan was made for a model with fingerprint {plan.fingerprint} but this model's "
            f"blocks have {mine}; re-plan for this model (or drop `plan=`)"
        )
    if plan.num_blocks != len(blocks):
        raise PlanError(
            f"the plan covers {plan.num_blocks} blocks but the model splits into {len(blocks)}; "
            "re-plan for this model and granularity"
        )
