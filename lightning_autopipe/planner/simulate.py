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
* **Recomputation.** A stage the plan recomputes pays its forward again in its backward
  (:func:`~.pricing.unit_prices`), a unit in flight holds its inputs only, and one whole
  micro-batch's activations are held once on top (:func:`~.pricing.recompute_memory`).

**Several chunks per rank.** With ``plan.chunks_per_rank > 1`` the schedule is keyed by rank
position and its actions name chunks: each chunk is priced from its own blocks on its rank's
devices, neighbouring chunks on one rank hand over locally (no message), a rank all-reduces
the gradients of all its chunks in one ring after its last action, and its peak memory sums
its chunks' parameter state and the activations they hold at once.

The replay is a :class:`_Simulator`: a heap of typed events (:mod:`~.simevents`: a device
free again, a transfer's bytes through the links, a message or ring flow arriving, a ring
done), each handled by one method; the inputs and results (:class:`~.simdata.StageCost`,
:class:`~.simdata.SimResult`) live in :mod:`~.simdata`.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.fluid import FluidLinks
from lightning_autopipe.planner.generators import check_schedule, generate
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.pricing import (
    device_profile,
    reduce_ms_per_byte,
    ring_latency_ms,
    ring_volume,
    type_profiles,
    unit_ms,
)
from lightning_autopipe.planner.schedule import Kind, Schedule, is_split, lower_communication, units
from lightning_autopipe.planner.simdata import (
    AR,
    CODE,
    RB,
    RF,
    SF,
    B,
    Event,
    F,
    SimResult,
    StageCost,
    W,
    device_scale,
    peers,
    rank_param_bytes,
    stage_costs,
    stage_peaks,
    unit_samples,
)
from lightning_autopipe.planner.simevents import (
    Arrived,
    FlowDone,
    Free,
    Message,
    RingDone,
    RingFlow,
)
from lightning_autopipe.profile import Profile

__all__ = ["Event", "SimResult", "StageCost", "simulate", "stage_costs"]


# ---------------------------------------------------------------------------- simulator
class _Simulator:
    """One replay of a lowered schedule for a plan on a cluster (see the module docstring)."""

    def __init__(self, plan: Plan, profile: Profile, cluster: Cluster, schedule: Schedule,
                 lowered: Schedule, optimizer_factor: float) -> None:
        self.plan, self.profile, self.cluster = plan, profile, cluster
        self.schedule, self.optimizer_factor = schedule, optimizer_factor
        self.costs = stage_costs(plan, profile)
        m, k, j = plan.num_microbatches, plan.startup_slices, plan.drain_slices
        self.units = units(m, k, j)
        uidx = {u: i for i, u in enumerate(self.units)}
        for acts in lowered.values():
            for a in acts:
                if a.unit not in uidx:
                    raise ScheduleError(
                        f"schedule action {a} is not a unit of m={m}, k={k}, j={j}")
        self.uidx = uidx
        self.gsamples, self.reps = unit_samples(plan)
        self.names = plan.devices
        dev_index = {n: i for i, n in enumerate(self.names)}
        self.specs = [cluster.device(n).spec for n in self.names]
        self.rank_of = [0] * len(self.names)
        self.rank_devs = [[dev_index[n] for n in plan.rank_devices(r)]
                          for r in range(plan.num_ranks)]
        for r, devs in enumerate(self.rank_devs):
            for d in devs:
                self.rank_of[d] = r
        self.chunks = [plan.rank_stages(r) for r in range(plan.num_ranks)]
        self.stage_devs = [[dev_index[n] for n in st.devices] for st in plan.stages]
        self.rel = device_scale(plan, self.stage_devs, len(self.names))  # uneven batches
        self.split = is_split(lowered)
        self.acts_of = [[(CODE[a.kind], uidx[a.unit], a.stage) for a in lowered[r]]
                        for r in range(plan.num_ranks)]
        self.has_backward = any(a.kind is Kind.BACKWARD for acts in schedule.values()
                                for a in acts)
        type_profiles(profile, cluster)  # ClusterError when a type's profile is of other blocks
        self.own: dict[str, list[StageCost]] = {}  # per profiled device type
        self.dur = [self._durations(d) for d in range(len(self.names))]
        self.out_f, self.out_b, indeg = peers(plan, profile, cluster, self.costs, self.reps,
                                              self.stage_devs)
        nu, nc = len(self.units), plan.num_stages
        # event loop state
        self.heap: list[tuple] = []
        self.tick = itertools.count().__next__
        self.ptr = [0] * len(self.names)
        self.waiting = [-1] * len(self.names)
        # messages still due per (chunk, direction, unit) slot: _slot
        self.left = [[0] * (2 * nc * nu) for _ in range(len(self.names))]
        for d, per in enumerate(indeg):
            for c, (prev, nxt) in per.items():
                for u in range(nu):
                    self.left[d][self._slot(c, RF, u)] = prev
                    self.left[d][self._slot(c, RB, u)] = nxt
        self.busy = [0.0] * len(self.names)
        self.finish = [0.0] * len(self.names)
        self.rank_left = [len(devs) for devs in self.rank_devs]
        self.raw: list[tuple] = []
        self.rings: dict[int, list] = {}  # rank -> [flows left, start, latency + reduction]
        self.ar_ms = [0.0] * plan.num_ranks
        self.links = FluidLinks(
            lambda r: cluster.resource_gbps(r) * BYTES_PER_MS_PER_GBPS, self.heap, self.tick,
            FlowDone,
        )

    def _slot(self, chunk: int, code: int, unit: int) -> int:
        """Where device counts the messages a receive (RF or RB) of ``chunk`` waits for."""
        return (2 * chunk + (code == RB)) * len(self.units) + unit

    # ------------------------------------------------------------------ set-up
    def _cost(self, d: int, s: int) -> StageCost:
        """Chunk ``s``'s costs on device ``d``, from its device type's own profile if any."""
        spec = self.specs[d]
        prof, _ = device_profile(spec, self.profile)
        if prof is self.profile:
            return self.costs[s]
        if spec.name not in self.own:
            self.own[spec.name] = stage_costs(self.plan, prof)
        return self.own[spec.name][s]

    def _durations(self, d: int) -> dict[int, list[list[float]]]:
        """Per chunk of its rank and kind code (F, B and, split, W): device ``d``'s time for
        every unit."""
        spec = self.specs[d]
        prof, speed = device_profile(spec, self.profile)
        out = {}
        for s in self.chunks[self.rank_of[d]]:
            per = self.reps[s] * float(prof.micro_batch_size) / self.rel[d]
            prices = self._cost(d, s).prices(s == 0, self.split)
            out[s] = [[unit_ms(ms, fixed, g / per, speed, spec.overhead_ms)
                       for g in self.gsamples] for ms, fixed in prices]
        return out

    # ------------------------------------------------------------------ actions
    def _push(self, t: float, event: object) -> None:
        heapq.heappush(self.heap, (t, self.tick(), event))

    def _start_flow(self, now: float, nbytes: float, gbps: float, lat: float, res: tuple,
                    what: Message | RingFlow) -> None:
        if nbytes <= 0 or not res or gbps == math.inf:  # nothing to share: a pure delay
            t = now + lat + (nbytes / (gbps * BYTES_PER_MS_PER_GBPS) if nbytes > 0 else 0.0)
            self._push(t, Arrived(what, now))
        else:
            self.links.start(now, nbytes, res, (lat, what, now))

    def _grad_bytes(self, r: int) -> int:
        """Gradient bytes rank ``r`` all-reduces: all its chunks' parameters, in one ring."""
        return rank_param_bytes(self.costs, self.chunks[r])

    def _start_allreduce(self, s: int, now: float) -> None:
        cluster = self.cluster
        ring = cluster.ring_order([self.names[d] for d in self.rank_devs[s]])
        n = len(ring)
        nbytes = ring_volume(n, self._grad_bytes(s))
        lat = max(cluster.latency_us(ring[i], ring[(i + 1) % n]) for i in range(n)) / 1e3
        reduce = self._grad_bytes(s) * reduce_ms_per_byte(cluster, ring)  # no link
        self.rings[s] = [n, now, ring_latency_ms(n, lat) + reduce]
        for i in range(n):
            gbps, _, res = cluster._link(ring[i], ring[(i + 1) % n])
            # latency: once per ring step, added when the ring ends
            self._start_flow(now, nbytes, gbps, 0.0, res, RingFlow(s))

    def _finish_device(self, d: int, now: float) -> None:
        self.finish[d] = now
        r = self.rank_of[d]
        self.rank_left[r] -= 1
        if (self.rank_left[r] == 0 and len(self.rank_devs[r]) > 1 and self._grad_bytes(r) > 0
                and self.has_backward):
            self._start_allreduce(r, now)

    def _advance(self, d: int, now: float) -> None:
        """Run device ``d``'s actions from its pointer until one takes time or must wait."""
        acts = self.acts_of[self.rank_of[d]]
        p, n = self.ptr[d], len(acts)
        while p < n:
            code, u, c = acts[p]
            if code <= B or code == W:
                dur = self.dur[d][c][0 if code == F else 1 if code == B else 2][u]
                self.busy[d] += dur
                end = now + dur
                self.raw.append((d, code, u, now, end, -1, c))
                self.ptr[d] = p + 1
                self._push(end, Free(d))
                return
            if code < RF:  # a send (codes are ordered F, B, SF, SB, RF, RB)
                g = self.gsamples[u]
                dst_chunk = c + 1 if code == SF else c - 1
                for peer in (self.out_f if code == SF else self.out_b)[d][c]:
                    self._start_flow(now, peer.bytes_per_sample * g, peer.gbps,
                                     peer.latency_ms, peer.resources,
                                     Message(d, peer.dst, code, u, c, dst_chunk))
            else:  # a receive
                slot = self._slot(c, code, u)
                if self.left[d][slot] > 0:
                    self.ptr[d] = p
                    self.waiting[d] = slot
                    return
            p += 1
        self.ptr[d] = n
        self._finish_device(d, now)

    # ------------------------------------------------------------------ events
    def _on_flow_done(self, t: float, ev: FlowDone) -> bool:
        """False for a stale completion (the flow's rate changed since it was scheduled)."""
        if not self.links.finish(ev.flow, ev.version):
            return False
        lat, what, sent = ev.flow.payload
        self._push(t + lat, Arrived(what, sent))
        return True

    def _on_arrived(self, t: float, ev: Arrived) -> None:
        what = ev.what
        if isinstance(what, Message):
            self.raw.append((what.src, what.code, what.unit, ev.sent, t, what.dst, what.chunk))
            slot = self._slot(what.dst_chunk, RF if what.code == SF else RB, what.unit)
            dst = what.dst
            self.left[dst][slot] -= 1
            if self.left[dst][slot] == 0 and self.waiting[dst] == slot:
                self.waiting[dst] = -1
                self.ptr[dst] += 1
                self._advance(dst, t)
        else:
            ring = self.rings[what.stage]
            ring[0] -= 1
            if ring[0] == 0:
                self._push(t + ring[2], RingDone(what.stage))

    def _on_ring_done(self, t: float, ev: RingDone) -> None:
        s = ev.stage
        start = self.rings[s][1]
        self.ar_ms[s] = t - start
        for d in self.rank_devs[s]:
            self.finish[d] = t
            self.raw.append((d, AR, -1, start, t, -1, self.chunks[s][0]))

    def run(self) -> SimResult:
        """Replay the step and collect the predictions."""
        for d in range(len(self.names)):
            self._advance(d, 0.0)
        links, heap = self.links, self.heap
        links.settle(0.0)
        while heap:
            t, _, ev = heapq.heappop(heap)
            if type(ev) is Free:
                self._advance(ev.device, t)
            elif type(ev) is FlowDone:
                if not self._on_flow_done(t, ev):
                    continue  # nothing changed: the links settle after the next event
            elif type(ev) is Arrived:
                self._on_arrived(t, ev)
            else:
                self._on_ring_done(t, ev)
            if links.pending and (not heap or heap[0][0] > t):
                links.settle(t)
        stuck = [self.names[d] for d in range(len(self.names))
                 if self.ptr[d] < len(self.acts_of[self.rank_of[d]])]
        if stuck:
            raise ScheduleError(f"schedule deadlocks in simulation; devices {stuck} never finish")
        return self._result()

    def _result(self) -> SimResult:
        plan, names, nd = self.plan, self.names, len(self.names)
        iteration = max(self.finish) if self.finish else 0.0
        bubble = 1.0 - (sum(self.busy) / nd) / iteration if iteration > 0 else 0.0
        # one whole micro-batch (a slice of the first or last is not)
        whole = sum(self.gsamples) / plan.num_microbatches
        stage_ms = []
        for s in range(plan.num_stages):  # one whole micro-batch, priced as units are
            ms = []
            for d in self.stage_devs[s]:
                prof, speed = device_profile(self.specs[d], self.profile)
                per = whole / self.reps[s] / prof.micro_batch_size * self.rel[d]
                ovh = self.specs[d].overhead_ms
                f, *back = [unit_ms(x, fx, per, speed, ovh)
                            for x, fx in self._cost(d, s).prices(s == 0, self.split)]
                ms.append(f + (back[0] + back[1] if self.split else back[0]))
            stage_ms.append(max(ms))
        peaks = {x: stage_peaks(self.schedule, self.costs, [g * x for g in self.gsamples],
                                self.reps, self.uidx, float(self.profile.micro_batch_size),
                                self.optimizer_factor, whole * x) for x in set(self.rel)}
        return SimResult(
            iteration_ms=iteration,
            bubble_fraction=bubble,
            busy_ms={names[d]: self.busy[d] for d in range(nd)},
            peak_memory_bytes={names[d]: peaks[self.rel[d]][self.rank_of[d]] for d in range(nd)},
            stage_ms=stage_ms,
            allreduce_ms=self.ar_ms,
            devices=list(names),
            _raw=self.raw,
            _units=self.units,
        )


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
    stage_costs(plan, profile)  # PlanError first when the plan does not fit the profile
    if schedule is None:
        check_schedule(plan.schedule, plan.chunks_per_rank, plan.placement)
        schedule, lowered = _own_schedule(plan.schedule, plan.num_ranks, plan.num_microbatches,
                                          plan.startup_slices, plan.drain_slices,
                                          plan.chunks_per_rank)
    elif sorted(schedule) != list(range(plan.num_ranks)):
        raise ScheduleError(
            f"schedule has stages {sorted(schedule)} but the plan has {plan.num_ranks} "
            f"{'stages' if plan.chunks_per_rank == 1 else 'ranks'}"
        )
    elif all(a.kind.is_compute for acts in schedule.values() for a in acts):
        lowered = lower_communication(schedule)
    else:
        lowered = schedule
    return _Simulator(plan, profile, cluster, schedule, lowered,
                      optimizer_bytes_per_param_byte).run()


@functools.lru_cache(maxsize=32)
def _own_schedule(name: str, ranks: int, m: int, k: int, j: int, v: int
                  ) -> tuple[Schedule, Schedule]:
    """A plan's own schedule and its lowered form, built once per shape: a search or a check
    replays many plans of one shape (other cuts, other devices), and generating and lowering
    the schedule took nearly half of each replay. Shared, so read-only (the simulator only
    reads a schedule)."""
    schedule = generate(name, ranks, m, k, j, v)
    return schedule, lower_communication(schedule)
