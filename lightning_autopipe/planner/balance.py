"""Min-max balanced contiguous partition of a chain of blocks over stages of different speeds.

The starting point of every partitioner here: cut ``[lo, hi)`` into ``S`` non-empty contiguous
stages so that the slowest stage (its blocks' cost over its speed) is as fast as possible,
subject to each stage's memory. Pure functions over prefix sums; no cluster, no schedule.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_autopipe.planner.layout import shared_param_bytes
from lightning_autopipe.planner.pricing import (
    activation_peak,
    param_state_factor,
    peak_memory_bytes,
    stage_memory,
)

__all__ = ["StageLimits", "balanced_cuts"]

_TOL = 1e-7  # relative precision of the bottleneck search (cut positions are discrete)


@dataclass(frozen=True)
class StageLimits:
    """Memory limits of each stage: its :func:`~.pricing.peak_memory_bytes` within capacity,
    its activation memory :func:`~.pricing.stage_memory` as the fast model and the simulator
    count it."""

    params: Sequence[int]  # prefix sums
    mem: Sequence[int]  # prefix sums
    optimizer_factor: float
    act_factor: Sequence[float]  # per stage: in-flight micro-batches x samples scale
    capacity: Sequence[float]
    shared: Sequence[int] = ()  # prefix sums of shared_input_bytes (empty: none)
    once_factor: Sequence[float] = ()  # per stage: samples scale of what it holds once
    num_microbatches: int = 1
    loss: Sequence[int] = ()  # prefix sums of loss_bytes (empty: none)
    # with a loss: per stage its in-flight counts (until the release, until B) x samples scale
    # (compiled.inflight_pairs), which price the loss's bytes apart (pricing.activation_peak)
    loss_pairs: Sequence[Sequence[tuple[float, float]]] = ()
    ties: Sequence[tuple[int, int, int]] = ()  # BlockCosts.ties: shared parameters held once
    _kept: dict = field(default_factory=dict, compare=False, repr=False)  # tables, reaches

    def need(self, s: int, i: int, j: int) -> float:
        """Peak bytes of blocks ``[i, j)`` as stage ``s``."""
        held, once = stage_memory(self.mem, self.shared, i, j, self.num_microbatches)
        once = once * self.once_factor[s] if self.once_factor else 0.0
        params = self.params[j] - self.params[i] - shared_param_bytes(self.ties, ((i, j),))
        if not self.loss_pairs:
            return peak_memory_bytes(params, held, self.act_factor[s], self.optimizer_factor,
                                     once)
        return peak_memory_bytes(params, activation_peak(held, self.loss[j] - self.loss[i],
                                                         self.loss_pairs[s]),
                                 1.0, self.optimizer_factor, once)

    def ok(self, s: int, i: int, j: int) -> bool:
        return self.need(s, i, j) <= self.capacity[s]

    def reach(self, s: int, i: int, j: int) -> int:
        """The furthest end ``<= j`` that stage ``s`` starting at block ``i`` can hold (memory
        grows with the end): :meth:`ok` on tables made once (:meth:`_tables`), written out on
        locals for the partitioner's innermost loop. What each (stage, start) is known to
        hold and not to hold is kept: the bottleneck search asks again at every trial value."""
        row = self._kept.get(s)
        if row is None:
            row = self._kept[s] = {}
        lo, hi = row.get(i, (i, len(self.params)))  # lo fits (need(i, i) is the least)
        if j <= lo:
            return j
        end, start, once, factor = self._tables()
        params, act, room = self.params, self.act_factor[s], self.capacity[s]
        extra = once * self.once_factor[s] if self.once_factor and i == 0 else 0.0
        p0, h0 = params[i], start[i]
        if self.loss_pairs or self.ties:  # the loss's bytes apart, shared parameters once
            return self._reach_by_need(s, i, j, lo, hi, row)
        if j < hi:
            if (params[j] - p0) * factor + (end[j] - h0) * act + extra <= room:
                row[i] = (j, hi)
                return j
            hi = j
        while hi - lo > 1:  # the last fit lies in [lo, hi)
            mid = (lo + hi) // 2
            if (params[mid] - p0) * factor + (end[mid] - h0) * act + extra <= room:
                lo = mid
            else:
                hi = mid
        row[i] = (lo, hi)
        return lo

    def _reach_by_need(self, s: int, i: int, j: int, lo: int, hi: int, row: dict) -> int:
        """:meth:`reach` by :meth:`need` itself, for profiles whose loss's bytes count other
        units than the rest (:func:`~.pricing.activation_peak`) or whose blocks share
        parameters: the need still grows with the end."""
        room = self.capacity[s]
        if j < hi:
            if self.need(s, i, j) <= room:
                row[i] = (j, hi)
                return j
            hi = j
        while hi - lo > 1:  # the last fit lies in [lo, hi)
            mid = (lo + hi) // 2
            if self.need(s, i, mid) <= room:
                lo = mid
            else:
                hi = mid
        row[i] = (lo, hi)
        return lo

    def _tables(self) -> tuple[list[int], list[int], int, float]:
        """The held bytes of ``[i, j)`` as ``end[j] - start[i]``, the first stage's once-held
        bytes and the parameter factor, all from :func:`~.pricing.stage_memory` itself."""
        got = self._kept.get("tables")
        if got is None:
            n = len(self.mem) - 1
            mem, shared = np.asarray(self.mem), np.asarray(self.shared, dtype=np.int64)
            idx = np.arange(n + 1)
            end = stage_memory(mem, shared, np.zeros_like(idx), idx, 1)[0]  # [0, j)
            head = idx[:-1]  # a stage starts before the last block
            start = end[n] - stage_memory(mem, shared, head, np.full_like(head, n), 1)[0]
            once = int(stage_memory(mem, shared, 0, 1, self.num_microbatches)[1]) if n else 0
            got = self._kept["tables"] = (end.tolist(), [*start.tolist(), 0], once,
                                          param_state_factor(self.optimizer_factor))
        return got


def balanced_cuts(
    work: Sequence[float],
    speeds: Sequence[float],
    lo: int = 0,
    hi: int | None = None,
    *,
    limits: StageLimits | None = None,
    first_stage: int = 0,
    stage_work: Sequence[Sequence[float]] | None = None,
) -> list[int] | None:
    """Min-max partition of blocks ``[lo, hi)`` into ``len(speeds)`` non-empty contiguous stages.

    Binary search on the bottleneck with a greedy check (each stage takes the most blocks that
    fit): exact when any block fits any later stage, as with equal speeds. With very different
    speeds a slow stage can be forced to take a block only a fast stage can hold; the greedy
    answer is then only an upper bound and an exact reachable-position check (``O(S N)``)
    searches between it and the lower bound of the relaxed problem (stages may be empty).

    Args:
        work: prefix sums of per-block cost (``work[j] - work[i]`` is the cost of ``[i, j)``).
        speeds: relative speed of each stage (its cost is divided by it).
        limits: optional memory limits; ``first_stage`` is the index of ``speeds[0]`` in them.
        stage_work: per stage, its own prefix sums instead of ``work`` (a stage on a device
            type with its own profile, whose blocks are not all slower by one factor); the
            greedy and the exact check work unchanged on any per-stage costs that grow with
            the blocks, the bounds of the search are then the general ones.

    Returns:
        Cuts ``[lo, c1, ..., hi]`` (every stage non-empty), or None if no partition fits memory
        (or there are fewer blocks than stages).
    """
    hi = len(work) - 1 if hi is None else hi
    num = len(speeds)
    if hi - lo < num:
        return None
    if stage_work is None:
        ws: Sequence[Sequence[float]] = [work] * num
        total = work[hi] - work[lo]
        big = max(work[i + 1] - work[i] for i in range(lo, hi))
        lower = max(total / sum(speeds), big / max(speeds)) * (1 - 1e-12)
        upper = total / min(speeds) * (1 + 1e-9) + 1e-12
    else:
        ws = stage_work
        # every block goes to some stage at no less than its cheapest cost; a stage can hold all
        cheapest = [min((w[i + 1] - w[i]) / sp for w, sp in zip(ws, speeds))
                    for i in range(lo, hi)]
        lower = max(sum(cheapest) / num, max(cheapest)) * (1 - 1e-12)
        upper = max((w[hi] - w[lo]) / sp for w, sp in zip(ws, speeds)) * (1 + 1e-9) + 1e-12
    args = (ws, speeds, lo, hi)
    best = _greedy(*args, upper, limits, first_stage, True)
    if best is None:
        best = _exact(*args, upper, limits, first_stage)
        if best is None:
            return None
    # the relaxed problem (empty stages allowed) bounds the optimum from below
    relaxed_lo, relaxed_hi = lower, upper
    for _ in range(60):
        if relaxed_hi - relaxed_lo <= _TOL * relaxed_hi:
            break
        mid = (relaxed_lo + relaxed_hi) / 2
        if _greedy(*args, mid, limits, first_stage, False) is None:
            relaxed_lo = mid
        else:
            relaxed_hi = mid
    got = _greedy(*args, relaxed_hi, limits, first_stage, True) or _exact(
        *args, relaxed_hi, limits, first_stage
    )
    if got is not None:
        return got  # the relaxed optimum is reachable with non-empty stages: optimal
    hi_v = _cost(ws, speeds, best)
    lo_v = relaxed_hi
    for _ in range(60):
        if hi_v - lo_v <= _TOL * hi_v:
            break
        mid = (lo_v + hi_v) / 2
        cand = _exact(*args, mid, limits, first_stage)
        if cand is None:
            lo_v = mid
        else:
            hi_v, best = mid, cand
    return best


def _cost(ws: Sequence[Sequence[float]], speeds: Sequence[float], cuts: list[int]) -> float:
    return max((ws[s][cuts[s + 1]] - ws[s][cuts[s]]) / speeds[s] for s in range(len(speeds)))


def _reach(
    work: Sequence[float],
    speed: float,
    i: int,
    hi: int,
    cap: float,
    limits: StageLimits | None,
    stage: int,
) -> int:
    """The furthest ``j`` (``>= i``) a stage starting at ``i`` can reach within ``cap``."""
    j = bisect_right(work, work[i] + cap * speed + 1e-12, i + 1, hi + 1) - 1
    if limits is None or j <= i:
        return j
    return limits.reach(stage, i, j)  # memory is monotone in j: the last fit


def _greedy(
    ws: Sequence[Sequence[float]],
    speeds: Sequence[float],
    lo: int,
    hi: int,
    cap: float,
    limits: StageLimits | None,
    first: int,
    nonempty: bool,
) -> list[int] | None:
    """Each stage takes the most blocks that fit ``cap`` (and memory); None if some do not.

    ``nonempty`` leaves one block for every later stage and fails on an empty stage;
    otherwise stages may be empty (the relaxed problem, for which the greedy is exact).
    """
    cuts = [lo]
    i = lo
    num = len(speeds)
    for s in range(num):
        j = _reach(ws[s], speeds[s], i, hi, cap, limits, first + s)
        if nonempty:
            j = min(j, hi - (num - s - 1))
            if j <= i:
                return None
        cuts.append(j)
        i = j
    return cuts if i == hi else None


def _exact(
    ws: Sequence[Sequence[float]],
    speeds: Sequence[float],
    lo: int,
    hi: int,
    cap: float,
    limits: StageLimits | None,
    first: int,
) -> list[int] | None:
    """Non-empty partition within ``cap`` if one exists: reachable cut positions per stage."""
    num = len(speeds)
    reach = [lo]
    parents: list[dict[int, int]] = []
    for s in range(num):
        nxt: dict[int, int] = {}
        far: dict[int, int] = {}
        k = 0  # reach[k - 1] is the latest reachable start before j (it reaches furthest)
        for j in range(reach[0] + 1, hi - (num - s - 1) + 1):
            while k < len(reach) and reach[k] < j:
                k += 1
            i = reach[k - 1]
            if i not in far:
                far[i] = _reach(ws[s], speeds[s], i, hi, cap, limits, first + s)
            if j <= far[i]:
                nxt[j] = i
        if not nxt:
            return None
        parents.append(nxt)
        reach = sorted(nxt)
    if hi not in parents[-1]:
        return None
    cuts = [hi]
    for s in range(num - 1, -1, -1):
        cuts.append(parents[s][cuts[-1]])
    return cuts[::-1]
