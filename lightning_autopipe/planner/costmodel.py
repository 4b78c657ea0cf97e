"""The planner's fast cost model: per-stage costs in O(1) and a contention-free 1F1B replay.

The search evaluates thousands of candidate partitions; :func:`simulate` (links with contention,
Chrome traces) is too slow for that, so candidates are scored here and only the best few are
simulated. The model is the simulator's, minus link contention:

* a stage's forward/backward time for one micro-batch is its blocks' profiled time, scaled
  linearly from ``Profile.micro_batch_size`` to the stage's per-replica micro-batch, divided by the
  slowest replica's speed, plus the device's fixed ``overhead_ms`` per compute action;
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
from lightning_autopipe.planner.schedule import Kind, Schedule, slice_sizes
from lightning_autopipe.profile import Profile

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
        )

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
    ar_ms_per_byte: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.groups)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.groups)

    @classmethod
    def from_cluster(cls, cluster: Cluster, groups: list[list[str]]) -> Layout:
        devs = [[cluster.device(n) for n in g] for g in groups]
        lat, per_byte = [], []
        for a, b in zip(groups, groups[1:]):
            pairs = _pairs(list(a), list(b))
            lat.append(max(cluster.latency_us(x, y) for x, y in pairs) / 1e3)
            bw = _contended_gbps(cluster, pairs)
            per_byte.append(1.0 / (bw * BYTES_PER_MS_PER_GBPS))
        ar_lat, ar_pb = [], []
        for g in groups:
            base = cluster.allreduce_ms(list(g), 1) if len(g) > 1 else 0.0
            big = cluster.allreduce_ms(list(g), 1 << 30) if len(g) > 1 else 0.0
            slope = (big - base) / ((1 << 30) - 1)
            ar_pb.append(slope)
            ar_lat.append(max(base - slope, 0.0))
        return cls(
            groups=tuple(tuple(g) for g in groups),
            speeds=tuple(min(d.spec.speed for d in g) for g in devs),
            capacity=tuple(min(d.spec.memory_bytes for d in g) for g in devs),
            overhead_ms=tuple(max(d.spec.overhead_ms for d in g) for g in devs),
            link_lat_ms=tuple(lat),
            link_ms_per_byte=tuple(per_byte),
            ar_lat_ms=tuple(ar_lat),
            ar_ms_per_byte=tuple(ar_pb),
        )


def _pairs(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    """Which replica of stage ``s`` talks to which of ``s + 1``: by index, wrapping around."""
    n = max(len(a), len(b))
    return [(a[i * len(a) // n], b[i * len(b) // n]) for i in range(n)]


def _contended_gbps(cluster: Cluster, pairs: list[tuple[str, str]]) -> float:
    """Bandwidth of the slowest of ``pairs`` when all transfer at once over shared links."""
    use: dict[tuple, int] = {}
    res = [cluster.link_resources(x, y) for x, y in pairs]
    for rs in res:
        for r in rs:
            use[r] = use.get(r, 0) + 1
    worst = float("inf")
    for (x, y), rs in zip(pairs, res):
        bw = cluster.bandwidth_gbps(x, y)
        for r in rs:
            bw = min(bw, cluster.resource_gbps(r) / use[r])
        worst = min(worst, bw)
    return worst


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
    num = len(schedule)
    ulist = sorted({a.unit for acts in schedule.values() for a in acts})
    uidx = {u: i for i, u in enumerate(ulist)}
    pos = [0] * num
    done: dict[tuple[int, bool, int], int] = {}
    last = [-1] * num
    order: list[tuple[int, bool, int, int, int]] = []
    progress = True
    while progress:
        progress = False
        for s in range(num):
            acts = schedule[s]
            while pos[s] < len(acts):
                a = acts[pos[s]]
                is_b = a.kind is Kind.BACKWARD
                u = uidx[a.unit]
                dep = None
                if not is_b and s > 0:
                    dep = (s - 1, False, u)
                elif is_b and s < num - 1:
                    dep = (s + 1, True, u)
                if dep is not None and dep not in done:
                    break
                done[(s, is_b, u)] = len(order)
                order.append((s, is_b, u, last[s], done[dep] if dep else -1))
                last[s] = len(order) - 1
                pos[s] += 1
                progress = True
    stuck = [s for s in range(num) if pos[s] < len(schedule[s])]
    if stuck:
        raise ScheduleError(f"schedule deadlocks: stages {stuck} wait for units never produced")
    inflight = []
    for s in range(num):
        cur = peak = 0.0
        for a in schedule[s]:
            cur += (-1 if a.kind is Kind.BACKWARD else 1) * fracs[uidx[a.unit]]
            peak = max(peak, cur)
        inflight.append(peak)
    return _Compiled(tuple(order), tuple(last), tuple(inflight), tuple(fracs))


@functools.lru_cache(maxsize=512)
def _compiled(num_stages: int, num_microbatches: int, startup_slices: int, mb: int) -> _Compiled:
    from lightning_autopipe.planner.schedule import one_f_one_b

    fracs = [sz / mb for sz in slice_sizes(mb, startup_slices)] + [1.0] * (num_microbatches - 1)
    return compile_schedule(one_f_one_b(num_stages, num_microbatches, startup_slices), fracs)


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
        fw.append((costs.fwd[j] - costs.fwd[i]) * sc / sp)
        bw.append((costs.bwd[j] - costs.bwd[i]) * sc / sp)
        scale.append(sc)
    return fw, bw, scale


def evaluate(
    costs: BlockCosts,
    layout: Layout,
    cuts: list[int],
    batch: int,
    num_microbatches: int,
    startup_slices: int = 1,
    *,
    optimizer_factor: float = 2.0,
    critical_path: bool = True,
) -> Estimate:
    """Replay 1F1B for the stage boundaries ``cuts`` (``[0, c1, ..., N]``) on ``layout``."""
    num = layout.num_stages
    m, k = num_microbatches, startup_slices
    mb = max(1, batch // (m * max(layout.replicas)))
    comp = _compiled(num, m, k, mb)
    fw, bw, scale = stage_times(costs, layout, cuts, batch, m)
    ovh = layout.overhead_ms
    cut_ms = [
        costs.act[cuts[s + 1] - 1] * scale[s] * layout.link_ms_per_byte[s] for s in range(num - 1)
    ]
    lat = layout.link_lat_ms
    fracs = comp.fracs
    order = comp.order
    end = [0.0] * len(order)
    via = [False] * len(order)  # True: started by the cross-stage message
    for n, (s, is_b, u, prev, cross) in enumerate(order):
        t = end[prev] if prev >= 0 else 0.0
        if cross >= 0:
            c = s if is_b else s - 1
            tc = end[cross] + lat[c] + cut_ms[c] * fracs[u]
            if tc > t:
                t = tc
                via[n] = True
        end[n] = t + (bw[s] if is_b else fw[s]) * fracs[u] + ovh[s]
    finish = []
    for s in range(num):
        pb = costs.params[cuts[s + 1]] - costs.params[cuts[s]]
        ar = layout.ar_lat_ms[s] + pb * layout.ar_ms_per_byte[s] if len(layout.groups[s]) > 1 else 0
        finish.append(end[comp.last[s]] + ar)
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
        n = comp.last[max(range(num), key=finish.__getitem__)]
        while n >= 0:
            s, is_b, u, prev, cross = order[n]
            share[s] += (bw[s] if is_b else fw[s]) * fracs[u] + ovh[s]
            n = cross if via[n] else prev
        crit = max(range(num), key=share.__getitem__)
    stage_ms = [fw[s] + bw[s] + 2 * ovh[s] for s in range(num)]
    return Estimate(total, crit, stage_ms, peaks, fits, share)
