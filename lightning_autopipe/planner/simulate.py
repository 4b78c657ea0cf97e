"""Replays a plan's schedule on a cluster: predicted iteration time, bubble, memory per device.

Cost model (the one every planner here is judged by):

* **Compute.** Block costs in the :class:`~lightning_autopipe.profile.Profile` are for
  ``profile.micro_batch_size`` samples on the profiled device. A unit of ``n`` samples on a
  stage costs :func:`~.pricing.unit_ms` of the stage's summed block times at
  ``n / profile.micro_batch_size`` on the device (``(fixed + (ms - fixed) * n /
  micro_batch_size) / speed + overhead_ms``: linear in samples when the profile has no fixed
  parts).
* **Replicas.** Stage ``s`` has ``r_s`` replicas (its ``devices``). Each unit of the global step
  (global micro-batch = ``B / m`` samples; micro-batch 0 split into ``k`` slices) is split evenly
  over a stage's replicas, so with the same ``R`` on every stage this is ``R`` independent
  pipelines of ``B / (R m)``-sample micro-batches (slices sized by ``unit_sizes``). With uneven
  counts, replica ``i`` of ``s`` holds the fraction ``[i/r_s, (i+1)/r_s)`` of every unit and
  sends each replica of ``s + 1`` the part of it that replica holds.
* **Transfers.** Activations from ``s`` to ``s + 1`` are the ``activation_bytes`` of the stage's
  last block scaled by samples; gradients flow back with the same size. Sends are non-blocking,
  receives block (the lowered schedule is replayed literally). A transfer takes its link's
  latency plus its bytes over its bandwidth share: **contention** is a fluid model with
  max-min fair sharing (progressive filling) over the directional resources of
  :meth:`Cluster.link_resources` (NIC out/in, intra-server level uplinks), re-evaluated on every
  transfer start and end for the transfers that share resources with it.
* **All-reduce.** After the last action of all replicas of a stage, its gradients
  (``param_bytes``) are all-reduced in a ring (rank order): every replica sends
  ``2 (r-1)/r * bytes`` to its ring neighbour as one flow (contending like any transfer), and
  the ring finishes when its slowest flow does plus ``2 (r-1)`` times the slowest hop's latency
  plus the reduction's own work (:func:`~.pricing.reduce_ms_per_byte`, which shares no link);
  uncontended, that is exactly :func:`~.pricing.allreduce_ms`.
* **Results.** Iteration time = when the last device finishes (all-reduce included); bubble
  fraction = ``1 - mean(busy compute) / iteration``; peak memory per device is
  :func:`~.pricing.peak_memory_bytes` with the largest sum of ``memory_bytes`` (scaled by
  samples) of units forwarded but not yet backwarded. Optimizer
  step time and intra-server links crossed by network traffic are not modelled.
* **Recomputation.** A stage the plan recomputes is priced by :func:`~.pricing.recomputed`:
  its backward adds its forward, a unit in flight holds its inputs only, and one whole
  micro-batch's activations are held once on top.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import PlanError, ScheduleError
from lightning_autopipe.planner.fluid import FluidLinks
from lightning_autopipe.planner.generators import build_schedule
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.pricing import (
    device_profile,
    peak_memory_bytes,
    recomputed,
    reduce_ms_per_byte,
    ring_latency_ms,
    ring_volume,
    type_profiles,
    unit_ms,
)
from lightning_autopipe.planner.schedule import (
    Kind,
    Schedule,
    is_split,
    lower_communication,
    slice_count,
    unit_sizes,
    units,
)
from lightning_autopipe.profile import Profile

__all__ = ["Event", "SimResult", "StageCost", "simulate", "stage_costs"]

_F, _B, _SF, _SB, _RF, _RB, _AR, _W = range(8)
_CODE = {
    Kind.FORWARD: _F,
    Kind.BACKWARD: _B,
    Kind.SEND_F: _SF,
    Kind.SEND_B: _SB,
    Kind.RECV_F: _RF,
    Kind.RECV_B: _RB,
    Kind.WEIGHT: _W,
}
_NAME = ["F", "B", "SF", "SB", "RF", "RB", "AR", "W"]
# heap event types
_EV_FREE, _EV_ARRIVE, _EV_FLOW, _EV_AR = range(4)


@dataclass(frozen=True)
class Event:
    """One interval on the timeline.

    ``kind`` is ``F``/``B``/``W`` (compute on ``device``; ``W`` the weight gradient of a split
    backward, whose ``B`` is then the input gradient), ``SF``/``SB`` (a transfer from ``device``
    to ``peer``: activations / gradients, from the send until it arrives) or ``AR`` (the
    stage's gradient all-reduce on ``device``). ``unit`` is (micro-batch, slice) or None.
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
    _stage_of: list[int] = field(default_factory=list, repr=False)

    @cached_property
    def events(self) -> list[Event]:
        """Every compute, transfer and all-reduce interval (built on first access)."""
        out = []
        devs, us, st = self.devices, self._units, self._stage_of
        for d, code, u, start, end, peer in self._raw:
            out.append(
                Event(
                    devs[d],
                    st[d],
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
    param_bytes: int
    memory_bytes: int
    activation_bytes: int  # output of the stage's last block: what it sends to the next stage
    forward_fixed_ms: float = 0.0  # the parts of forward_ms / backward_ms that do not scale
    backward_fixed_ms: float = 0.0  # with samples (see pricing.unit_parts)
    # a split backward (BlockProfile.split_backward): input part, weight part, their fixed parts
    split: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    once_bytes: int = 0  # held once at the peak (a recomputing stage's backward)


def stage_costs(plan: Plan, profile: Profile) -> list[StageCost]:
    """Sum the profile's block costs over each stage's block range (a recomputing stage's
    priced by :func:`~.pricing.recomputed`)."""
    if plan.num_blocks > len(profile.blocks):
        raise PlanError(
            f"plan covers blocks [0, {plan.num_blocks}) but the profile of {profile.model!r} has "
            f"{len(profile.blocks)} blocks; re-plan with this profile"
        )
    out = []
    for st in plan.stages:
        bl = profile.blocks[st.blocks[0] : st.blocks[1]]
        out.append(
            StageCost(
                forward_ms=sum(b.forward_ms for b in bl),
                backward_ms=sum(b.backward_ms for b in bl),
                param_bytes=sum(b.param_bytes for b in bl),
                # a storage two blocks save counted once; the first stage's saved inputs are
                # slices of the replica's batch, held once (m micro-batches' worth)
                memory_bytes=sum(b.memory_bytes for b in bl)
                - sum(b.shared_input_bytes for b in bl[1:])
                - (bl[0].shared_input_bytes if st.blocks[0] == 0 else 0),
                once_bytes=bl[0].shared_input_bytes * plan.num_microbatches
                if st.blocks[0] == 0 else 0.0,
                activation_bytes=bl[-1].activation_bytes,
                forward_fixed_ms=sum(b.forward_fixed_ms for b in bl),
                backward_fixed_ms=sum(b.backward_fixed_ms for b in bl),
                split=tuple(sum(x) for x in zip(*(b.split_backward() for b in bl))),
            )
        )
    for s, st in enumerate(plan.stages):
        if plan.recomputes(s):
            c, i = out[s], st.blocks[0]
            inputs = profile.blocks[i - 1].activation_bytes if i > 0 else 0
            back, held, once = recomputed(c.forward_ms, c.backward_ms, c.memory_bytes, inputs)
            out[s] = replace(
                c, backward_ms=back, memory_bytes=held, once_bytes=once + c.once_bytes,
                backward_fixed_ms=recomputed(c.forward_fixed_ms, c.backward_fixed_ms, 0, 0)[0],
            )
    return out


def _unit_samples(plan: Plan) -> tuple[list[float], list[int]]:
    """Global samples of each unit (summed over a stage's replicas) and replicas per stage."""
    reps = [s.replicas for s in plan.stages]
    m, k, j = plan.num_microbatches, plan.startup_slices, plan.drain_slices
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


def _overlaps(r_a: int, r_b: int) -> list[tuple[int, int, float]]:
    """(i, j, fraction of a unit) pairs where replica i of one stage feeds replica j of the next."""
    out = []
    for i in range(r_a):
        lo_a, hi_a = i * r_b, (i + 1) * r_b
        for j in range(r_b):
            ov = min(hi_a, (j + 1) * r_a) - max(lo_a, j * r_a)
            if ov > 0:
                out.append((i, j, ov / (r_a * r_b)))
    return out


def simulate(
    plan: Plan,
    profile: Profile,
    cluster: Cluster,
    *,
    optimizer_bytes_per_param_byte: float = 2.0,
    schedule: Schedule | None = None,
) -> SimResult:
    """Replay ``schedule`` (default: the plan's own) for ``plan`` on ``cluster``.

    Raises:
        PlanError: the plan does not fit the profile or the batch does not divide.
        ClusterError: a plan device is not in the cluster.
        ScheduleError: the schedule deadlocks when replayed.
    """
    costs = stage_costs(plan, profile)
    if schedule is None:
        schedule = build_schedule(plan)
    if sorted(schedule) != list(range(plan.num_stages)):
        raise ScheduleError(
            f"schedule has stages {sorted(schedule)} but the plan has {plan.num_stages} stages"
        )
    if all(a.kind.is_compute for acts in schedule.values() for a in acts):
        lowered = lower_communication(schedule)
    else:
        lowered = schedule
    m, k, j = plan.num_microbatches, plan.startup_slices, plan.drain_slices
    ulist = units(m, k, j)
    uidx = {u: i for i, u in enumerate(ulist)}
    for acts in lowered.values():
        for a in acts:
            if a.unit not in uidx:
                raise ScheduleError(f"schedule action {a} is not a unit of m={m}, k={k}, j={j}")
    nu = len(ulist)
    gsamples, reps = _unit_samples(plan)
    mbs = float(profile.micro_batch_size)
    num_stages = plan.num_stages

    names = plan.devices
    dev_index = {n: i for i, n in enumerate(names)}
    specs = [cluster.device(n).spec for n in names]
    nd = len(names)
    stage_of = [0] * nd
    for s, st in enumerate(plan.stages):
        for n in st.devices:
            stage_of[dev_index[n]] = s
    stage_devs = [[dev_index[n] for n in st.devices] for st in plan.stages]

    # per-device compute durations per unit (each device type priced from its own profile when
    # it has one: :func:`~.pricing.device_profile`), and per-stage action codes
    type_profiles(profile, cluster)  # ClusterError when a type's profile is of other blocks
    own: dict[str, list[StageCost]] = {}  # per profiled device type
    split = is_split(lowered)
    fdur: list[list[float]] = []
    bdur: list[list[float]] = []
    wdur: list[list[float]] = []
    for d in range(nd):
        s, spec = stage_of[d], specs[d]
        prof, speed = device_profile(spec, profile)
        if prof is not profile and spec.name not in own:
            own[spec.name] = stage_costs(plan, prof)
        c = costs[s] if prof is profile else own[spec.name][s]
        per = reps[s] * float(prof.micro_batch_size)
        fdur.append([unit_ms(c.forward_ms, c.forward_fixed_ms, g / per, speed,
                             spec.overhead_ms) for g in gsamples])
        b_in, b_wt, fix_in, fix_wt = c.split
        if s == 0:  # the first stage sends no input gradient: its W is the whole backward
            b_in, b_wt, fix_in, fix_wt = 0.0, c.backward_ms, 0.0, c.backward_fixed_ms
        back = (b_in, fix_in) if split else (c.backward_ms, c.backward_fixed_ms)
        bdur.append([unit_ms(*back, g / per, speed, spec.overhead_ms) for g in gsamples])
        wdur.append([unit_ms(b_wt, fix_wt, g / per, speed, spec.overhead_ms) for g in gsamples]
                    if split else [])
    acts_of = [[(_CODE[a.kind], uidx[a.unit]) for a in lowered[s]] for s in range(num_stages)]

    # transfer peers: out_f[d] = [(dst, fraction)], out_b[d] likewise; in-degree per direction
    out_f: list[list[tuple]] = [[] for _ in range(nd)]  # (dst, bytes per sample, gbps, lat, res)
    out_b: list[list[tuple]] = [[] for _ in range(nd)]
    indeg = [[0, 0] for _ in range(nd)]  # [from previous stage, from next stage]
    link = cluster._link  # cached (gbps, latency_us, resources) of a -> b
    for s in range(num_stages - 1):
        per_sample = costs[s].activation_bytes / mbs  # activations out = gradients back
        for i, j, frac in _overlaps(reps[s], reps[s + 1]):
            a, b = stage_devs[s][i], stage_devs[s + 1][j]
            gbps, lat, res = link(names[a], names[b])
            out_f[a].append((b, per_sample * frac, gbps, lat / 1e3, res))
            gbps, lat, res = link(names[b], names[a])
            out_b[b].append((a, per_sample * frac, gbps, lat / 1e3, res))
            indeg[b][0] += 1
            indeg[a][1] += 1

    # ------------------------------------------------------------------ event loop state
    heap: list[tuple] = []
    ptr = [0] * nd
    waiting = [-1] * nd
    left = [[indeg[d][0]] * nu + [indeg[d][1]] * nu for d in range(nd)]
    busy = [0.0] * nd
    finish = [0.0] * nd
    stage_left = list(reps)
    raw: list[tuple] = []
    ar_state: dict[int, list] = {}
    ar_ms = [0.0] * num_stages

    heappush, heappop = heapq.heappush, heapq.heappop
    tick = itertools.count().__next__

    def push(t: float, typ: int, a: object, b: object = None) -> None:
        heappush(heap, (t, tick(), typ, a, b))

    links = FluidLinks(
        lambda r: cluster.resource_gbps(r) * BYTES_PER_MS_PER_GBPS, heap, tick, _EV_FLOW
    )

    def start_flow(
        now: float, nbytes: float, gbps: float, lat: float, res: tuple, done: tuple
    ) -> None:
        if nbytes <= 0 or not res or gbps == math.inf:  # nothing to share: a pure delay
            t = now + lat + (nbytes / (gbps * BYTES_PER_MS_PER_GBPS) if nbytes > 0 else 0.0)
            heappush(heap, (t, tick(), _EV_ARRIVE, done, now))
        else:
            links.start(now, nbytes, res, (lat, done, now))

    def start_allreduce(s: int, now: float) -> None:
        ring = cluster.ring_order([names[d] for d in stage_devs[s]])
        n = len(ring)
        nbytes = ring_volume(n, costs[s].param_bytes)
        lat = max(cluster.latency_us(ring[i], ring[(i + 1) % n]) for i in range(n)) / 1e3
        reduce = costs[s].param_bytes * reduce_ms_per_byte(cluster, ring)  # local, no link
        ar_state[s] = [n, now, ring_latency_ms(n, lat) + reduce]
        for i in range(n):
            gbps, _, res = link(ring[i], ring[(i + 1) % n])
            start_flow(now, nbytes, gbps, 0.0, res, ("ar", s))  # latency: per ring step, above

    def finish_device(d: int, now: float) -> None:
        finish[d] = now
        s = stage_of[d]
        stage_left[s] -= 1
        if stage_left[s] == 0 and reps[s] > 1 and costs[s].param_bytes > 0 and has_backward:
            start_allreduce(s, now)

    def advance(d: int, now: float) -> None:
        acts = acts_of[stage_of[d]]
        p = ptr[d]
        n = len(acts)
        while p < n:
            code, u = acts[p]
            if code <= _B or code == _W:
                dur = (fdur if code == _F else bdur if code == _B else wdur)[d][u]
                busy[d] += dur
                end = now + dur
                raw.append((d, code, u, now, end, -1))
                ptr[d] = p + 1
                heappush(heap, (end, tick(), _EV_FREE, d, None))
                return
            if code < _RF:  # a send (codes are ordered F, B, SF, SB, RF, RB)
                g = gsamples[u]
                for dst, per, gbps, lat, res in out_f[d] if code == _SF else out_b[d]:
                    start_flow(now, per * g, gbps, lat, res, ("msg", d, dst, code, u))
            else:  # receive
                slot = u if code == _RF else nu + u
                if left[d][slot] > 0:
                    ptr[d] = p
                    waiting[d] = slot
                    return
            p += 1
        ptr[d] = n
        finish_device(d, now)

    has_backward = any(a.kind is Kind.BACKWARD for acts in schedule.values() for a in acts)
    for d in range(nd):
        advance(d, 0.0)
    links.settle(0.0)
    while heap:
        t, _, typ, a, b = heappop(heap)
        if typ == _EV_FREE:
            advance(a, t)
        elif typ == _EV_FLOW:
            if not links.finish(a, b):
                continue
            lat, done, start = a.payload
            push(t + lat, _EV_ARRIVE, done, start)
        elif typ == _EV_ARRIVE:
            if a[0] == "msg":
                _, src, dst, code, u = a
                raw.append((src, code, u, b, t, dst))
                slot = u if code == _SF else nu + u
                left[dst][slot] -= 1
                if left[dst][slot] == 0 and waiting[dst] == slot:
                    waiting[dst] = -1
                    ptr[dst] += 1
                    advance(dst, t)
            else:  # all-reduce flow
                s = a[1]
                st = ar_state[s]
                st[0] -= 1
                if st[0] == 0:
                    push(t + st[2], _EV_AR, s)
        else:  # all-reduce done
            s = a
            start = ar_state[s][1]
            ar_ms[s] = t - start
            for d in stage_devs[s]:
                finish[d] = t
                raw.append((d, _AR, -1, start, t, -1))
        if links.pending and (not heap or heap[0][0] > t):
            links.settle(t)

    stuck = [names[d] for d in range(nd) if ptr[d] < len(acts_of[stage_of[d]])]
    if stuck:
        raise ScheduleError(f"schedule deadlocks in simulation; devices {stuck} never finish")

    iteration = max(finish) if finish else 0.0
    bubble = 1.0 - (sum(busy) / nd) / iteration if iteration > 0 else 0.0
    whole = sum(gsamples) / m  # one whole micro-batch (a slice of the first or last is not)
    stage_ms = []
    for s, ref in enumerate(costs):  # one whole micro-batch, priced as the timeline prices units
        ms = []
        for d in stage_devs[s]:
            prof, speed = device_profile(specs[d], profile)
            c = ref if prof is profile else own[specs[d].name][s]
            per = whole / reps[s] / prof.micro_batch_size
            ovh = specs[d].overhead_ms
            parts = (0.0, c.backward_ms, 0.0, c.backward_fixed_ms) if s == 0 else c.split
            ms.append(unit_ms(c.forward_ms, c.forward_fixed_ms, per, speed, ovh) + (
                unit_ms(parts[0], parts[2], per, speed, ovh)
                + unit_ms(parts[1], parts[3], per, speed, ovh) if split
                else unit_ms(c.backward_ms, c.backward_fixed_ms, per, speed, ovh)))
        stage_ms.append(max(ms))
    peak = _peak_memory(schedule, costs, gsamples, reps, uidx, mbs, optimizer_bytes_per_param_byte,
                        whole)
    return SimResult(
        iteration_ms=iteration,
        bubble_fraction=bubble,
        busy_ms={names[d]: busy[d] for d in range(nd)},
        peak_memory_bytes={names[d]: peak[stage_of[d]] for d in range(nd)},
        stage_ms=stage_ms,
        allreduce_ms=ar_ms,
        devices=list(names),
        _raw=raw,
        _units=ulist,
        _stage_of=stage_of,
    )


def _peak_memory(
    schedule: Schedule,
    costs: list,
    gsamples: list[float],
    reps: list[int],
    uidx: dict,
    mbs: float,
    opt: float,
    whole: float,
) -> list[int]:
    """Per stage: parameter state plus the most activation memory held in flight (a unit's
    activations are held from its forward to its backward, or to its weight backward when the
    backward is split: W still reads what the forward saved), plus what a stage holds once
    (``once_bytes`` of a whole micro-batch of ``whole`` global samples)."""
    release = Kind.WEIGHT if is_split(schedule) else Kind.BACKWARD
    out = []
    for s, c in enumerate(costs):
        per_sample = c.memory_bytes / mbs / reps[s]
        held = peak = 0.0
        for a in schedule[s]:
            if a.kind is Kind.FORWARD:
                held += per_sample * gsamples[uidx[a.unit]]
                peak = max(peak, held)
            elif a.kind is release:
                held -= per_sample * gsamples[uidx[a.unit]]
        once = c.once_bytes / mbs / reps[s] * whole
        out.append(int(round(peak_memory_bytes(c.param_bytes, peak, 1.0, opt, once))))
    return out
