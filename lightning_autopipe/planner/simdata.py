"""What the simulator reads and returns: per-stage costs, unit sizes, timeline events, results.

:func:`stage_costs` sums a plan's blocks per stage, :func:`unit_samples` sizes every unit of the
step, :func:`overlaps` and :func:`peers` say which replica feeds which over which link,
:func:`stage_peaks` is each stage's peak memory under a schedule; :class:`SimResult` and its
:class:`Event` list are what :func:`~.simulate.simulate` predicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.layout import shared_param_bytes, weights_shared_within
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.pricing import (
    peak_memory_bytes,
    recompute_memory,
    stage_memory,
    unit_prices,
)
from lightning_autopipe.planner.schedule import (
    Kind,
    Schedule,
    is_split,
    slice_count,
    unit_sizes,
    units,
)
from lightning_autopipe.profile import Profile

__all__ = ["CODE", "Event", "Peer", "SimResult", "StageCost", "device_scale", "overlaps",
           "peers", "rank_param_bytes", "stage_costs", "stage_peaks", "unit_samples"]

#: action codes of the simulator's per-stage lists and of its raw timeline records
F, B, SF, SB, RF, RB, AR, W = range(8)
CODE = {
    Kind.FORWARD: F,
    Kind.BACKWARD: B,
    Kind.SEND_F: SF,
    Kind.SEND_B: SB,
    Kind.RECV_F: RF,
    Kind.RECV_B: RB,
    Kind.WEIGHT: W,
}
_NAME = ["F", "B", "SF", "SB", "RF", "RB", "AR", "W"]


@dataclass(frozen=True)
class Event:
    """One interval on the timeline.

    ``kind`` is ``F``/``B``/``W`` (compute on ``device``; ``W`` the weight gradient of a split
    backward, whose ``B`` is then the input gradient), ``SF``/``SB`` (a transfer from ``device``
    to ``peer``: activations / gradients, from the send until it arrives) or ``AR`` (the
    stage's gradient all-reduce on ``device``). ``unit`` is (micro-batch, slice) or None;
    ``stage`` is the chunk (with one chunk per rank: the stage; an ``AR`` names the rank's
    first chunk: a rank all-reduces the gradients of all its chunks in one ring).
    """

    device: str
    stage: int
    kind: str
    unit: tuple[int, int] | None
    start_ms: float
    end_ms: float
    peer: str | None = None

    @property
    def label(self) -> str:
        if self.unit is None:
            return f"{self.stage}{self.kind}"
        return f"{self.stage}{self.kind}{self.unit[0]}.{self.unit[1]}"


@dataclass
class SimResult:
    """What :func:`simulate` predicts for one training step."""

    iteration_ms: float
    bubble_fraction: float
    busy_ms: dict[str, float]
    peak_memory_bytes: dict[str, int]
    stage_ms: list[float]
    allreduce_ms: list[float] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    _raw: list[tuple] = field(default_factory=list, repr=False)
    _units: list[tuple[int, int]] = field(default_factory=list, repr=False)

    @cached_property
    def events(self) -> list[Event]:
        """Every compute, transfer and all-reduce interval (built on first access)."""
        out = []
        devs, us = self.devices, self._units
        for d, code, u, start, end, peer, chunk in self._raw:
            out.append(
                Event(
                    devs[d],
                    chunk,
                    _NAME[code],
                    None if u < 0 else us[u],
                    start,
                    end,
                    None if peer < 0 else devs[peer],
                )
            )
        return out


@dataclass(frozen=True)
class StageCost:
    """Per-stage sums over its blocks (for ``profile.micro_batch_size`` samples)."""

    forward_ms: float
    backward_ms: float
    param_bytes: int  # block by block: a parameter two blocks share counted twice
    memory_bytes: int
    activation_bytes: int  # output of the stage's last block: what it sends to the next stage
    forward_fixed_ms: float = 0.0  # the parts of forward_ms / backward_ms that do not scale
    backward_fixed_ms: float = 0.0  # with samples (see pricing.unit_parts)
    # a split backward (BlockProfile.split_backward): input part, weight part, their fixed parts
    split: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    once_bytes: int = 0  # held once at the peak (a recomputing stage's backward)
    recompute: bool = False  # the stage recomputes its activations (its backward pays F again)
    loss_bytes: int = 0  # of memory_bytes, what the loss saves (freed by a split backward's B)
    blocks: tuple[int, int] = (0, 0)  # the stage's block range
    # the profile's (block, earlier block, bytes) of shared parameters (BlockProfile.tied_to),
    # which rank_param_bytes counts once over a rank's chunks
    ties: tuple[tuple[int, int, int], ...] = ()

    def prices(self, first: bool, split: bool) -> list[tuple[float, float]]:
        """(ms, fixed ms) per action kind: :func:`~.pricing.unit_prices` of this stage."""
        return unit_prices((self.forward_ms, self.forward_fixed_ms),
                           (self.backward_ms, self.backward_fixed_ms), self.split, first=first,
                           split=split, recompute=self.recompute)


def stage_costs(plan: Plan, profile: Profile) -> list[StageCost]:
    """Sum the profile's block costs over each stage's block range (a recomputing stage's
    memory by :func:`~.pricing.recompute_memory`; its time is priced where its units are, by
    :func:`~.pricing.unit_prices`)."""
    if plan.num_blocks > len(profile.blocks):
        raise PlanError(
            f"plan covers blocks [0, {plan.num_blocks}) but the profile of {profile.model!r} has "
            f"{len(profile.blocks)} blocks; re-plan with this profile"
        )
    mem = list(accumulate((b.memory_bytes for b in profile.blocks), initial=0))
    shared = list(accumulate((b.shared_input_bytes for b in profile.blocks), initial=0))
    ties = tuple((b, x.tied_to, x.tied_bytes) for b, x in enumerate(profile.blocks)
                 if x.tied_bytes)
    out = []
    for st in plan.stages:
        bl = profile.blocks[st.blocks[0] : st.blocks[1]]
        # a storage two blocks save counted once; the first stage's saved inputs are slices
        # of the replica's batch, held once (m micro-batches' worth): one formula for all
        held, once = stage_memory(mem, shared, st.blocks[0], st.blocks[1], plan.num_microbatches)
        if weights_shared_within(ties, *st.blocks):  # the whole backward in B, which frees all
            split = (sum(b.backward_ms for b in bl), 0.0, sum(b.backward_fixed_ms for b in bl),
                     0.0)
            loss_bytes = held
        else:
            split = tuple(sum(x) for x in zip(*(b.split_backward() for b in bl)))
            loss_bytes = sum(b.loss_bytes for b in bl)
        out.append(
            StageCost(
                forward_ms=sum(b.forward_ms for b in bl),
                backward_ms=sum(b.backward_ms for b in bl),
                param_bytes=sum(b.param_bytes for b in bl),
                memory_bytes=held,
                once_bytes=once,
                activation_bytes=bl[-1].activation_bytes,
                forward_fixed_ms=sum(b.forward_fixed_ms for b in bl),
                backward_fixed_ms=sum(b.backward_fixed_ms for b in bl),
                split=split,
                loss_bytes=loss_bytes,
                blocks=st.blocks,
                ties=ties,
            )
        )
    for s, st in enumerate(plan.stages):
        if plan.recomputes(s):
            c, i = out[s], st.blocks[0]
            # the first stage's saved inputs are the batch, in c.once_bytes already
            inputs = profile.blocks[i - 1].activation_bytes if i > 0 else 0
            kept = profile.blocks[i].shared_input_bytes if i > 0 else 0
            held, once = recompute_memory(c.memory_bytes, inputs, kept)
            out[s] = replace(c, memory_bytes=held, once_bytes=once + c.once_bytes,
                             recompute=True, loss_bytes=0)
    return out


def unit_samples(plan: Plan) -> tuple[list[float], list[int]]:
    """Global samples of each unit (summed over a stage's replicas) and replicas per stage."""
    reps = [s.replicas for s in plan.stages]
    m, k, j = plan.num_microbatches, plan.startup_slices, plan.drain_slices
    if plan.replica_batches:  # uneven replicas: unit sizes as fractions (replica_scale)
        g = plan.global_batch_size / m
        return [g / slice_count(mb, m, k, j) for mb, _ in units(m, k, j)], reps
    if len(set(reps)) == 1:
        r = reps[0]
        n = plan.microbatch_size  # raises PlanError when B is not divisible into R x m
        return [float(sz * r) for sz in unit_sizes(n, m, k, j)], reps
    if plan.global_batch_size % m:
        raise PlanError(
            f"global batch {plan.global_batch_size} is not divisible into {m} micro-batches; "
            f"use a multiple of {m}"
        )
    g = plan.global_batch_size / m
    if max(k, j) > g:
        raise PlanError(
            f"cannot split a micro-batch of {g:g} samples into {max(k, j)} startup/drain slices"
        )
    return [g / slice_count(mb, m, k, j) for mb, _ in units(m, k, j)], reps


def overlaps(r_a: int, r_b: int) -> list[tuple[int, int, float]]:
    """(i, j, fraction of a unit) pairs where replica i of one stage feeds replica j of the next."""
    out = []
    for i in range(r_a):
        lo_a, hi_a = i * r_b, (i + 1) * r_b
        for j in range(r_b):
            ov = min(hi_a, (j + 1) * r_a) - max(lo_a, j * r_a)
            if ov > 0:
                out.append((i, j, ov / (r_a * r_b)))
    return out


@dataclass
class Peer:
    """Where a device sends one direction's messages: bytes per global sample and link."""

    dst: int
    bytes_per_sample: float
    gbps: float
    latency_ms: float
    resources: tuple


def device_scale(plan: Plan, stage_devs: list[list[int]], count: int) -> list[float]:
    """Per device (index in ``plan.devices``): its replica's samples against an even share
    (:meth:`~.plan.Plan.replica_weight`; all 1 when even), what its units' compute, messages
    and held activations are scaled by."""
    scale = [1.0] * count
    if plan.replica_batches:
        for devs in stage_devs:
            for i, d in enumerate(devs):
                scale[d] = plan.replica_weight(i)
    return scale


def peers(
    plan: Plan, profile: Profile, cluster: Cluster, costs: list[StageCost], reps: list[int],
    stage_devs: list[list[int]],
) -> tuple[list[dict[int, list[Peer]]], list[dict[int, list[Peer]]], list[dict[int, list[int]]]]:
    """Per device (index in ``plan.devices``) and chunk it holds: whom it sends activations
    and gradients, and how many messages it receives per unit from the previous and from the
    next chunk. Neighbouring chunks on one rank hand over locally: no message."""
    names = plan.devices
    nd, link = len(names), cluster._link
    out_f: list[dict[int, list[Peer]]] = [{} for _ in range(nd)]
    out_b: list[dict[int, list[Peer]]] = [{} for _ in range(nd)]
    indeg: list[dict[int, list[int]]] = [{} for _ in range(nd)]  # chunk -> [prev, next]
    for s, devs in enumerate(stage_devs):
        for d in devs:
            out_f[d][s], out_b[d][s], indeg[d][s] = [], [], [0, 0]
    owner = plan.chunk_ranks
    mbs = float(profile.micro_batch_size)
    for s in range(plan.num_stages - 1):
        if owner[s] == owner[s + 1]:
            continue
        per_sample = costs[s].activation_bytes / mbs  # activations out = gradients back
        for i, j, frac in overlaps(reps[s], reps[s + 1]):
            frac *= plan.replica_weight(i)  # uneven batches (even widths): replica i's share
            a, b = stage_devs[s][i], stage_devs[s + 1][j]
            gbps, lat, res = link(names[a], names[b])
            out_f[a][s].append(Peer(b, per_sample * frac, gbps, lat / 1e3, res))
            gbps, lat, res = link(names[b], names[a])
            out_b[b][s + 1].append(Peer(a, per_sample * frac, gbps, lat / 1e3, res))
            indeg[b][s + 1][0] += 1
            indeg[a][s][1] += 1
    return out_f, out_b, indeg


def stage_peaks(
    schedule: Schedule,
    costs: list,
    gsamples: list[float],
    reps: list[int],
    uidx: dict,
    mbs: float,
    opt: float,
    whole: float,
) -> list[int]:
    """Per rank position: the parameter state of its chunks plus the most activation memory
    it holds in flight (a unit's activations are held on a chunk from its forward to its
    backward, or to its weight backward when the backward is split: W still reads what the
    forward saved; a rank's chunks summed), plus what its chunks hold once (``once_bytes`` of
    a whole micro-batch of ``whole`` global samples). With one chunk per rank: per stage.
    Under a split backward what the loss saves (``loss_bytes``) is held only until the
    backward's B, which frees it."""
    split = is_split(schedule)
    release = Kind.WEIGHT if split else Kind.BACKWARD
    out = []
    for r in sorted(schedule):
        mine = sorted({a.stage for a in schedule[r]})
        freed = {c: costs[c].loss_bytes if split else 0 for c in mine}  # at B, before W
        rest = {c: (costs[c].memory_bytes - freed[c]) / mbs / reps[c] for c in mine}
        loss = {c: freed[c] / mbs / reps[c] for c in mine}
        held = peak = 0.0
        for a in schedule[r]:
            g = gsamples[uidx[a.unit]]
            if a.kind is Kind.FORWARD:
                held += (rest[a.stage] + loss[a.stage]) * g
                peak = max(peak, held)
                continue
            if a.kind is release:
                held -= rest[a.stage] * g
            if a.kind is Kind.BACKWARD:
                held -= loss[a.stage] * g
        once = sum(costs[c].once_bytes / mbs / reps[c] * whole for c in mine)
        out.append(int(round(peak_memory_bytes(rank_param_bytes(costs, mine), peak, 1.0, opt,
                                               once))))
    return out


def rank_param_bytes(costs: list, chunks: Sequence[int]) -> int:
    """The parameter bytes a rank holds for its ``chunks``: a parameter two of them share (a
    tied head and embedding on one rank) once, as the runtime holds it."""
    ties = costs[chunks[0]].ties if chunks else ()
    return sum(costs[c].param_bytes for c in chunks) - shared_param_bytes(
        ties, [costs[c].blocks for c in chunks])
