"""Setup's first phase on every rank: resolve or discover the cluster and profile the blocks.

What is measured here is what rank 0 plans from (:mod:`~lightning_autopipe.runtime.agree`):
the launched devices' cluster (a file, ``Cluster.local`` with a calibrated link, or one
discovered from the ranks) and, when no plan is given, the profile of the traced blocks. Every
rank profiles on its own device at the same time (in training all ranks compute at once and
contend for shared cores and memory bandwidth, so a profile taken while the others idle would
be optimistic), and a rank whose profiling fails stops every rank with its error. When
discovery finds a rank slower than its peers of one device name, every rank profiles once
more and discovery types the ranks by each one's faster profile (:func:`_confirmed`).

A cluster measured here (discovered, or the local one of a single process) also carries the
runtime's own cost per compute action, timed on every rank right after its profile by the
process's first fit
(:func:`~lightning_autopipe.runtime.action_overhead.measure_action_overhead`): the planner adds
it to every F, B and W, so a plan of many small actions (several chunks per rank, slices) is
priced at what it costs to run. A cluster file's ``overhead_ms`` stands as declared (rank 0
warns when it is well below the measured figure).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.profile import Profile
from lightning_autopipe.runtime import log, profiler
from lightning_autopipe.runtime.compiled_stage import CompileCorrection
from lightning_autopipe.runtime.discover import (
    compare_with_declared,
    device_names,
    discover,
    gather_reports,
    host_name,
    write_cluster,
)
from lightning_autopipe.runtime.failure import stop_everywhere
from lightning_autopipe.runtime.units import slice_batch

__all__ = ["Measurement", "is_distributed", "measure", "resolve_cluster", "with_overheads"]


@dataclass
class Measurement:
    """What a rank knows after measuring, and rank 0 plans from.

    Attributes:
        cluster: the launched world's cluster (resolved from the option, or discovered).
        names: the device name of each launched rank, in rank order.
        profile: the blocks' profile rank 0 plans from: the discovered fastest device type's,
            else this rank's own; None when a plan is given (nothing is profiled).
        failure: this rank's profiling error in a world without a process group (rank 0
            sends it to the others as its plan's error; another rank profiled only as load,
            and warns when rank 0 planned fine). With a process group a failure stops every
            rank at once instead.
    """

    cluster: Cluster
    names: list[str] = field(default_factory=list)
    profile: Profile | None = None
    failure: BaseException | None = None


def is_distributed(world_size: int) -> bool:
    """Whether this run has a process group to run collectives on (more than one rank)."""
    return dist.is_available() and dist.is_initialized() and world_size > 1


def measure(
    blocks: Any,
    example: Any,
    options: AutoPipeOptions,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any = None,
    num_nodes: int = 1,
    run_dir: str | Path | None = None,
) -> Measurement:
    """The cluster and (without a given plan) the profile of ``blocks``; collective.

    Without a cluster file the cluster is discovered from the ranks
    (:func:`~lightning_autopipe.runtime.discover.discover`: hosts, devices, each rank's own
    profile, measured links) and, when ``run_dir`` is given, written there as ``cluster.yaml``
    with a profile per device type. With a cluster file every rank's profile is gathered and
    rank 0 warns where the file contradicts what the ranks measured. Without
    ``torch.distributed`` (a single process) the launched world is ``Cluster.local``.

    ``example_batch``, when given, is the batch the ``example`` inputs came from: the last
    block is then profiled with ``loss_fn`` on it, as the last stage runs in training. With
    ``options.compile`` each rank's profile is corrected to the compiled speed.
    """
    planning = options.plan is None  # else the given plan is used as it is
    distributed = is_distributed(world_size)
    discovering = planning and options.cluster is None and distributed
    overhead = 0.0
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
    mine = failure = None
    profiling = "while profiling the blocks for discovery and planning"
    correct = CompileCorrection(options.compile_backend, blocks, example, device)

    def profiled() -> Profile:  # compiled: by the ratios the first call measures
        return correct(_profile(
            blocks, example, example_batch, loss_fn, device, options.profile_repeats))

    if planning:
        try:
            mine = profiled()
            overhead = _action_overhead(device)  # as the profile: while every rank does it
        except Exception as exc:
            if distributed:
                stop_everywhere(exc, profiling)
            failure = exc
        if distributed:
            stop_everywhere(None, profiling)  # no rank failed: go on together
    profile = mine
    if discovering:
        assert mine is not None  # a rank whose profiling failed stopped every rank above
        cluster, profile, _ = discover(mine, device, confirm=lambda: _confirmed(mine, profiled))
        names = [d.name for d in cluster.devices]
        # its file carries the measured cost per action too (failure is None: profiling
        # failures stop every rank in a process group)
        cluster = _priced_actions(cluster, overhead, True, distributed, rank)
        if rank == 0 and run_dir is not None:
            where = write_cluster(cluster, run_dir, profile)
            log.rank_zero_info(
                f"discovered cluster written to {where} (reuse it as cluster=<that file>)")
    elif planning and distributed:
        reports = gather_reports(mine, device)
        if rank == 0:
            for line in compare_with_declared(cluster, reports):
                warnings.warn(f"cluster {cluster.name!r} contradicts the measurement: {line}",
                              stacklevel=3)
    assert cluster is not None
    if planning and failure is None and not discovering:
        cluster = _priced_actions(cluster, overhead, options.cluster is None, distributed, rank)
    return Measurement(cluster=cluster, names=names, profile=profile, failure=failure)


def _confirmed(first: Profile, again: Callable[[], Profile]) -> Profile:
    """This rank's faster of ``first`` and a second profile (``again``), which every rank
    takes once discovery has found a rank slower than its peers of one device name.

    A short profile can meet a transient (a core lent to another job for a second, a VM's
    neighbour): on the 2-core development machines two alike cores profiled 1.0-1.3x apart
    from run to run, and at 1.2x (:data:`~lightning_autopipe.runtime.discover.SLOWER`) such a
    rank became a slower device type of its own for the whole run. Noise only adds time, so
    each rank keeps its faster profile: a device slowed for good (a throttled card, another job
    on its core) is slow in both and stays its own type; one that met a transient is not.
    Collective: a rank whose second profile fails stops every rank with its error. What the
    first profile warned about (a loss that could not be profiled, a compile backend) it does
    not warn again."""
    where = "while profiling the blocks again to confirm a slower rank"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second = again()
    except Exception as exc:
        stop_everywhere(exc, where)
        raise  # not reached: the failing rank re-raises its own error there
    stop_everywhere(None, where)
    return min((first, second), key=lambda p: p.total_ms)


#: The runtime's cost per compute action, per device, once per process (:func:`_action_overhead`).
_OVERHEADS: dict[str, float] = {}


def _action_overhead(device: torch.device) -> float:
    """:func:`~lightning_autopipe.runtime.action_overhead.measure_action_overhead` on
    ``device``, timed by the first fit of this process and reused by every later one (a
    notebook, a sweep, a second ``fit``): it is the cost of the runtime's own code on that
    device, which a later fit of the same process runs unchanged, and timing it takes a
    third of a second of every rank's start-up."""
    key = str(device)
    if key not in _OVERHEADS:
        from lightning_autopipe.runtime.action_overhead import measure_action_overhead

        _OVERHEADS[key] = measure_action_overhead(device)
    return _OVERHEADS[key]


def with_overheads(cluster: Cluster, per_rank: Sequence[float]) -> Cluster:
    """``cluster`` whose every device type costs ``overhead_ms`` the most any of its ranks
    measured (``per_rank[r]``: the figure of ``cluster.devices[r]``; a type no rank measured
    keeps its own)."""
    by_type: dict[str, float] = {}
    for dev, ms in zip(cluster.devices, per_rank):
        by_type[dev.spec.name] = max(by_type.get(dev.spec.name, 0.0), float(ms))

    def spec(s: Any) -> Any:
        return replace(s, overhead_ms=by_type[s.name]) if s.name in by_type else s

    servers = [replace(sv, device=spec(sv.device),
                       devices=tuple((i, spec(d)) for i, d in sv.devices))
               for sv in cluster.servers]
    return replace(cluster, servers=servers)


def _priced_actions(cluster: Cluster, overhead: float, measured: bool, distributed: bool,
                    rank: int) -> Cluster:
    """A ``measured`` cluster with every rank's cost per action; a declared one as it is, rank
    0 warning where it declares well below what its ranks measured. Collective when
    ``distributed`` (every rank's figure is gathered)."""
    figures: list[Any] = [overhead]
    if distributed:
        figures = [None] * dist.get_world_size()
        dist.all_gather_object(figures, overhead)
    if measured:
        if rank == 0:
            log.rank_zero_info(
                f"the runtime adds {max(figures):.3f} ms per compute action (F, B, W) besides "
                "the model's own work (measured on every rank; the planner prices it on every "
                "action)")
        return with_overheads(cluster, figures)
    if rank == 0:
        for dev, ms in zip(cluster.devices, figures):
            if dev.spec.overhead_ms < 0.5 * ms:
                warnings.warn(
                    f"cluster {cluster.name!r} declares overhead_ms={dev.spec.overhead_ms:g} "
                    f"for {dev.name} ({dev.spec.name}), but the runtime measured {ms:.3f} ms "
                    "per compute action there: the planner will favour plans of many small "
                    "actions (several chunks per rank, slices) more than they pay; declare "
                    "the measured figure as the device's overhead_ms", stacklevel=4)
                break
    return cluster


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
            log.rank_zero_info(
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
        used = cluster.devices[:world_size]
        log.rank_zero_info(
            f"cluster {cluster.name!r} describes {cluster.num_devices} devices; this run of "
            f"{world_size} processes is planned on the first {world_size} in file order "
            f"({used[0].name} .. {used[-1].name})"
        )
    return cluster


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
    if example_batch is not None:
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
                f"pipeline_loss failed on the example batch while profiling ({exc}); "
                "profiling without the loss, so the plan underestimates the last stage's time",
                stacklevel=3,
            )
    return _loss_assumed(
        profiler.profile_blocks(blocks, example, device=str(device), repeats=repeats))


def _loss_assumed(profile: Profile) -> Profile:
    """``profile``, taken without the training loss, with the memory the loss saves assumed:
    one copy of the model's outputs, held by the last block until its backward
    (``loss_bytes``).

    That is what cross-entropy saves (the log-probabilities, the size of the logits) and what
    a squared error saves (the differences). The loss is profiled only through
    ``pipeline_loss``: an ordinary ``training_step`` cannot be run while profiling without its
    side effects (a torchmetrics update, a list it appends to, its logs), so its loss is
    assumed. Without the assumption a language model's last stage, trained by an ordinary
    step, peaked at 1.42x its predicted memory (vocabulary 8192: the log-probabilities
    outweighed everything else the stage saved); a loss that saves less is over-counted, on
    the safe side.
    """
    last = profile.blocks[-1]
    extra = last.activation_bytes
    blocks = [*profile.blocks[:-1],
              replace(last, memory_bytes=last.memory_bytes + extra, loss_bytes=extra)]
    return replace(profile, blocks=blocks)


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
