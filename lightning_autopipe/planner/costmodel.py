"""The planner's fast cost model: per-stage costs in O(1) and a contention-free 1F1B replay.

The search evaluates thousands of candidate partitions; :func:`simulate` (links with contention,
Chrome traces) is too slow for that, so candidates are scored here and only the best few are
simulated. The model is the simulator's, minus link contention:

* a stage's forward/backward time for one micro-batch is its blocks' profiled time, scaled
  from ``Profile.micro_batch_size`` to the stage's per-replica micro-batch by
  :func:`~lightning_autopipe.profile.affine_ms` (linear unless the profile has fixed parts),
  divided by the slowest replica's speed, plus the device's fixed ``overhead_ms`` per compute
  action;
* a transfer between stages costs the link latency plus bytes over the bandwidth of the slowest
  replica pair (a pure delay: sends do not block the sender);
* each stage all-reduces its gradients (ring, :meth:`Cluster.allreduce_ms`) after its last
  backward; the step ends when the last all-reduce does;
* peak memory = parameters x (weights + gradients + ``optimizer_factor``) + the most activation
  memory in flight under the schedule.

The replay walks the same compute-only schedule the runtime executes (``one_f_one_b``), compiled
once per (stages, micro-batches, slices) into a flat dependency list, and records which
predecessor set each action's start: backtracking from the end gives the critical path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner._links import (
    _allreduce_costs,
    _allreduce_finish,
    _contended_gbps,
    _pairs,
    _reduce_costs,
    _ring_resources,
)
from lightning_autopipe.planner.schedule import Kind, Schedule, spans, unit_sizes
from lightning_autopipe.profile import Profile, affine_ms

__all__ = ["BlockCosts", "Layout", "Estimate", "compile_schedule", "evaluate", "stage_times"]


@dataclass(frozen=True)
class BlockCosts:
    """Prefix sums of a Profile's per-block costs: any stage's cost is two lookups."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    params: tuple[int, ...]
    mem: tuple[int, ...]
    act: tuple[int, ...]  # activation_bytes of each block (what crosses a cut after it)
    micro_batch_size: int
    ffix: tuple[float, ...] = ()  # prefix sums of forward_fixed_ms (empty: all zero)
    bfix: tuple[float, ...] = ()  # prefix sums of backward_fixed_ms

    @classmethod
    def from_profile(cls, profile: Profile) -> BlockCosts:
        b = profile.blocks
        return cls(
            fwd=tuple(accumulate((x.forward_ms for x in b), initial=0.0)),
            bwd=tuple(accumulate((x.backward_ms for x in b), initial=0.0)),
            params=tuple(accumulate((x.param_bytes for x in b), initial=0)),
            mem=tuple(accumulate((x.memory_bytes for x in b), initial=0)),
            act=tuple(x.activation_bytes for x in b),
            micro_batch_size=profile.micro_batch_size,
            ffix=tuple(accumulate((x.forward_fixed_ms for x in b), initial=0.0)),
            bfix=tuple(accumulate((x.backward_fixed_ms for x in b), initial=0.0)),
        )

    def fixed(self, i: int, j: int) -> tuple[float, float]:
        """Forward and backward ms of blocks ``[i, j)`` that do not scale with samples."""
        if not self.ffix:
            return 0.0, 0.0
        return self.ffix[j] - self.ffix[i], self.bfix[j] - self.bfix[i]

    @property
    def num_blocks(self) -> int:
        return len(self.act)

    @property
    def compute(self) -> list[float]:
        """Prefix sums of forward + backward time."""
        return [f + b for f, b in zip(self.fwd, self.bwd)]


@dataclass(frozen=True)
class Layout:
    """Where each stage runs, reduced to the numbers the cost model needs (cut-independent)."""

    groups: tuple[tuple[str, ...], ...]
    speeds: tuple[float, ...]
    capacity: tuple[int, ...]
    overhead_ms: tuple[float, ...]
    link_lat_ms: tuple[float, ...]  # cut s: stage s <-> s + 1
    link_ms_per_byte: tuple[float, ...]
    ar_lat_ms: tuple[float, ...]
    ar_ms_per_byte: tuple[float, ...]  # uncontended ring, links only
    optimistic: bool = False  # a lower bound of simulate(): no link queues, fastest replicas
    ar_rings: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per stage: resources of each edge
    ar_caps: tuple[float, ...] = ()  # bytes per ms of each resource
    ar_reduce_ms_per_byte: tuple[float, ...] = ()  # per stage: the reduction's own work

    @property
    def num_stages(self) -> int:
        return len(self.groups)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.groups)

    def signature(self) -> tuple:
        """Everything but the device names: layouts with equal signatures cost the same."""
        return (self.replicas, self.speeds, self.capacity, self.overhead_ms, self.link_lat_ms,
                self.link_ms_per_byte, self.ar_lat_ms, self.ar_ms_per_byte,
                self.ar_reduce_ms_per_byte)

    @classmethod
    def from_cluster(
        cls, cluster: Cluster, groups: list[list[str]], *, optimistic: bool = False
    ) -> Layout:
        """Reduce ``groups`` (devices of each stage, in pipeline order) to cost-model numbers.

        With ``optimistic=True`` every stage runs at its fastest replica's speed over its fastest
        links without contention: the result is a lower bound of :func:`simulate` (all event
        times of a replay are monotone in the durations), which the exact search prunes with.
        """
        devs = [[cluster.device(n) for n in g] for g in groups]
        lat, per_byte = [], []
        for a, b in zip(groups, groups[1:]):
            pairs = _pairs(list(a), list(b))
            if optimistic:
                lat.append(min(cluster.latency_us(x, y) for x, y in pairs) / 1e3)
                bw = max(cluster.bandwidth_gbps(x, y) for x, y in pairs)
            else:
                lat.append(max(cluster.latency_us(x, y) for x, y in pairs) / 1e3)
                bw = _contended_gbps(cluster, pairs)
            per_byte.append(1.0 / (bw * BYTES_PER_MS_PER_GBPS))
        ar_lat, ar_pb = _allreduce_costs(cluster, [list(g) for g in groups], contended=False)
        rings, caps = _ring_resources(cluster, [list(g) for g in groups])
        pick = max if optimistic else min
        return cls(
            groups=tuple(tuple(g) for g in groups),
            speeds=tuple(pick(d.spec.speed for d in g) for g in devs),
            capacity=tuple(min(d.spec.memory_bytes for d in g) for g in devs),
            overhead_ms=tuple(
                (min if optimistic else max)(d.spec.overhead_ms for d in g) for g in devs
            ),
            link_lat_ms=tuple(lat),
            link_ms_per_byte=tuple(per_byte),
            ar_lat_ms=tuple(ar_lat),
            ar_ms_per_byte=tuple(ar_pb),
            optimistic=optimistic,
            ar_rings=rings,
            ar_caps=caps,
            ar_reduce_ms_per_byte=tuple(_reduce_costs(cluster, [list(g) for g in groups])),
        )


@dataclass(frozen=True)
class _Compiled:
    """A compute-only schedule flattened into dependency order (see :func:`compile_schedule`)."""

    order: tuple[tuple[int, bool, int, int, int], ...]  # stage, is_bwd, unit, same_prev, cross
    last: tuple[int, ...]  # index of each stage's last action
    inflight: tuple[float, ...]  # most micro-batches (fractions) in flight per stage
    fracs: tuple[float, ...]  # size of each unit relative to a whole micro-batch


def compile_schedule(schedule: Schedule, fracs: list[float]) -> _Compiled:
    """Flatten a compute-only schedule into an order where every dependency comes first.

    Raises:
        ScheduleError: the schedule deadlocks (some stage waits for a unit never produced).
    """
    ulist = sorted({a.unit for acts in schedule.values() for a in acts})
    uidx = {u: i for i, u in enumerate(ulist)}
    lists = [
        [(a.kind is Kind.BACKWARD, uidx[a.unit]) for a in schedule[s]]
        for s in range(len(schedule))
    ]
    return _compile_lists(lists, fracs)


def _one_f_one_b_lists(num: int, m: int, k: int, j: int = 1) -> list[list[tuple[bool, int]]]:
    """:func:`~.schedule.one_f_one_b` as (is_backward, unit index) lists, without Action objects.

    Same rule and the same unit positions (:func:`~.schedule.spans`) as the generator (a test
    checks they agree): stage ``s`` forwards every unit starting before ``end + (S - 1 - s)``
    micro-batches before the backward of a unit ending at ``end``.
    """
    order, scale = spans(m, k, j)
    nu = len(order)
    out = []
    for s in range(num):
        lead = (num - 1 - s) * scale
        acts: list[tuple[bool, int]] = []
        nxt = 0
        for u in range(nu):
            lim = order[u][3] + lead
            while nxt < nu and order[nxt][2] < lim:
                acts.append((False, nxt))
                nxt += 1
            acts.append((True, u))
        out.append(acts)
    return out


def _compile_lists(lists: list[list[tuple[bool, int]]], fracs: list[float]) -> _Compiled:
    """Topological order of per-stage (is_backward, unit) lists (worklist, linear time)."""
    num = len(lists)
    nu = len(fracs)
    done_f = [[-1] * nu for _ in range(num)]
    done_b = [[-1] * nu for _ in range(num)]
    pos = [0] * num
    last = [-1] * num
    order: list[tuple[int, bool, int, int, int]] = []
    work = list(range(num))
    queued = [True] * num
    while work:
        s = work.pop()
        queued[s] = False
        acts = lists[s]
        p = pos[s]
        while p < len(acts):
            is_b, u = acts[p]
            if is_b:
                if u >= nu:
                    raise ScheduleError(f"stage {s} runs the backward of unknown unit {u}")
                cross = done_b[s + 1][u] if s < num - 1 else -1
                if s < num - 1 and cross < 0:
                    break
            else:
                cross = done_f[s - 1][u] if s > 0 else -1
                if s > 0 and cross < 0:
                    break
            n = len(order)
            order.append((s, is_b, u, last[s], cross))
            last[s] = n
            nb = s - 1 if is_b else s + 1
            (done_b if is_b else done_f)[s][u] = n
            if 0 <= nb < num and not queued[nb]:
                queued[nb] = True
                work.append(nb)
            p += 1
        pos[s] = p
    stuck = [s for s in range(num) if pos[s] < len(lists[s])]
    if stuck:
        raise ScheduleError(f"schedule deadlocks: stages {stuck} wait for units never produced")
    inflight = []
    for acts in lists:
        cur = peak = 0.0
        for is_b, u in acts:
            cur += -fracs[u] if is_b else fracs[u]
            peak = max(peak, cur)
        inflight.append(peak)
    return _Compiled(tuple(order), tuple(last), tuple(inflight), tuple(fracs))


@functools.lru_cache(maxsize=1024)
def _compiled(
    num_stages: int, num_microbatches: int, startup_slices: int, mb: int, drain_slices: int = 1
) -> _Compiled:
    m, k, j = num_microbatches, startup_slices, drain_slices
    fracs = [sz / mb for sz in unit_sizes(mb, m, k, j)]
    lists = _one_f_one_b_lists(num_stages, m, k, j)
    return _compile_lists(lists, fracs)


@dataclass
class Estimate:
    """What the fast model predicts for one candidate."""

    iteration_ms: float
    critical_stage: int
    stage_ms: list[float]  # forward + backward of one whole micro-batch per stage
    peak_bytes: list[float]  # per stage (every replica of a stage holds the same)
    fits: bool
    critical_share: list[float]  # compute time each stage contributes to the critical path


def stage_times(
    costs: BlockCosts, layout: Layout, cuts: list[int], batch: int, num_microbatches: int
) -> tuple[list[float], list[float], list[float]]:
    """Per-stage (forward ms, backward ms, samples per replica micro-batch scale)."""
    fw, bw, scale = [], [], []
    for s in range(layout.num_stages):
        i, j = cuts[s], cuts[s + 1]
        sc = batch / (num_microbatches * len(layout.groups[s]) * costs.micro_batch_size)
        sp = layout.speeds[s]
        ff, bf = costs.fixed(i, j)
        fw.append(affine_ms(costs.fwd[j] - costs.fwd[i], ff, sc) / sp)
        bw.append(affine_ms(costs.bwd[j] - costs.bwd[i], bf, sc) / sp)
        scale.append(sc)
    return fw, bw, scale


def _extrapolation_point(num_stages: int) -> int:
    """Micro-batch count beyond which 1F1B is in its periodic steady phase (with margin)."""
    return 2 * num_stages + 6


def evaluate(
    costs: BlockCosts,
    layout: Layout,
    cuts: list[int],
    batch: int,
    num_microbatches: int,
    startup_slices: int = 1,
    *,
    drain_slices: int = 1,
    optimizer_factor: float = 2.0,
    critical_path: bool = True,
    exact: bool = False,
) -> Estimate:
    """Replay 1F1B for the stage boundaries ``cuts`` (``[0, c1, ..., N]``) on ``layout``.

    Many micro-batches make the replay long but add nothing new: after the warm-up, 1F1B
    repeats one period per micro-batch. Unless ``exact``, a step with ``m > 2 S + 6``
    micro-batches is replayed with ``m0 = 2 S + 6`` and ``m0 + S + 1`` micro-batches (at the
    real per-micro-batch durations) and extended linearly by the mean period between them
    (within about 1% of the full replay; the steady phase can cycle over several micro-batches).
    """
    num = layout.num_stages
    m, k, j = num_microbatches, startup_slices, drain_slices
    mb = max(1, batch // (m * max(layout.replicas)))
    fw, bw, scale = stage_times(costs, layout, cuts, batch, m)
    ovh = layout.overhead_ms
    # the replay scales fw / bw by each unit's fraction of a micro-batch; fixed parts are paid
    # once per action, like the device overhead
    fix = [costs.fixed(cuts[s], cuts[s + 1]) for s in range(num)]
    ovf = [ovh[s] + fix[s][0] / layout.speeds[s] for s in range(num)]
    ovb = [ovh[s] + fix[s][1] / layout.speeds[s] for s in range(num)]
    vfw = [fw[s] - fix[s][0] / layout.speeds[s] for s in range(num)]
    vbw = [bw[s] - fix[s][1] / layout.speeds[s] for s in range(num)]
    cut_ms = [
        costs.act[cuts[s + 1] - 1] * scale[s] * layout.link_ms_per_byte[s] for s in range(num - 1)
    ]
    grads = [float(costs.params[cuts[s + 1]] - costs.params[cuts[s]]) for s in range(num)]
    ar = [0.0] * num  # all-reduces are added after the replay, contending with each other
    m0 = _extrapolation_point(num)
    lat, queue = layout.link_lat_ms, not layout.optimistic
    if exact or m <= m0:
        comp = _compiled(num, m, k, mb, j)
        finish, end, via = _replay(comp, vfw, vbw, ovf, ovb, cut_ms, lat, ar, queue)
        finish = _allreduce_finish(layout, finish, grads)
        total = max(finish)
    else:
        win = min(num + 1, m - m0)  # average the period over a window (cycles can be > 1 long)
        first = _compiled(num, m0, k, mb, j)
        f1, _, _ = _replay(first, vfw, vbw, ovf, ovb, cut_ms, lat, ar, queue)
        comp = _compiled(num, m0 + win, k, mb, j)
        finish, end, via = _replay(comp, vfw, vbw, ovf, ovb, cut_ms, lat, ar, queue)
        period = max(0.0, max(finish) - max(f1)) / win
        shift = (m - m0 - win) * period
        finish = _allreduce_finish(layout, [f + shift for f in finish], grads)
        total = max(finish)
    peaks, fits = [], True
    for s in range(num):
        i, j = cuts[s], cuts[s + 1]
        peak = (costs.params[j] - costs.params[i]) * (2.0 + optimizer_factor) + (
            costs.mem[j] - costs.mem[i]
        ) * scale[s] * comp.inflight[s]
        peaks.append(peak)
        fits = fits and peak <= layout.capacity[s]
    share = [0.0] * num
    crit = 0
    if critical_path:
        order, fracs = comp.order, comp.fracs
        n = comp.last[max(range(num), key=finish.__getitem__)]
        while n >= 0:
            s, is_b, u, prev, cross = order[n]
            share[s] += vbw[s] * fracs[u] + ovb[s] if is_b else vfw[s] * fracs[u] + ovf[s]
            n = cross if via[n] else prev
        crit = max(range(num), key=share.__getitem__)
    stage_ms = [fw[s] + bw[s] + 2 * ovh[s] for s in range(num)]
    return Estimate(total, crit, stage_ms, peaks, fits, share)


def _replay(
    comp: _Compiled,
    fw: list[float],
    bw: list[float],
    ovf: list[float],
    ovb: list[float],
    cut_ms: list[float],
    lat: tuple[float, ...],
    ar: list[float],
    queue: bool = True,
) -> tuple[list[float], list[float], list[bool]]:
    """Finish time per stage (all-reduce included), end time and start cause per action.

    With ``queue`` each cut's link carries one transfer per direction at a time, in the
    sender's order (startup slices leave back to back and would otherwise overtake each
    other's bandwidth); without it transfers are independent delays (a lower bound). Not
    modelled (the simulator has them): a stage's activations and gradients sharing one NIC,
    and fair sharing instead of first come first served.
    """
    fracs = comp.fracs
    order = comp.order
    end = [0.0] * len(order)
    via = [False] * len(order)  # True: started by the cross-stage message
    free_f = [0.0] * len(cut_ms)  # when each cut's link is next free, per direction
    free_b = [0.0] * len(cut_ms)
    for n, (s, is_b, u, prev, cross) in enumerate(order):
        t = end[prev] if prev >= 0 else 0.0
        if cross >= 0:
            c = s if is_b else s - 1
            dur = cut_ms[c] * fracs[u]
            sent = end[cross]
            if queue:
                free = free_b if is_b else free_f
                if free[c] > sent:
                    sent = free[c]
                free[c] = sent + dur
            tc = sent + dur + lat[c]
            if tc > t:
                t = tc
                via[n] = True
        end[n] = t + (bw[s] * fracs[u] + ovb[s] if is_b else fw[s] * fracs[u] + ovf[s])
    finish = [end[comp.last[s]] + ar[s] for s in range(len(ar))]
    return finish, end, via
