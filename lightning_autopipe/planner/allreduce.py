"""The fast model's gradient all-reduces at the end of a step, rings sharing links.

:func:`allreduce_finish` is a small fluid model over the rings a :class:`~.layout.Layout`
describes (the simulator has its own, per flow, in :mod:`~.fluid`); the ring volume comes from
:func:`~.pricing.ring_volume`.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_autopipe.planner.pricing import ring_volume

__all__ = ["allreduce_finish", "allreduce_lower"]


def _reduce_of(layout: Any, s: int) -> float:
    """Stage ``s``'s reduction time per gradient byte (0 for layouts built without it)."""
    return layout.ar_reduce_ms_per_byte[s] if layout.ar_reduce_ms_per_byte else 0.0


def _uncontended_end(layout: Any, s: int, start: float, nbytes: float) -> float:
    """The end of stage ``s``'s ring alone on the optimistic layout (its own per-byte rate, its
    latency and the reduction), started at ``start``: the optimistic layout's formula, which is
    also its lower bound."""
    return start + layout.ar_lat_ms[s] + nbytes * (layout.ar_ms_per_byte[s] + _reduce_of(layout, s))


def _ring_use(layout: Any) -> tuple[tuple[float, float, tuple[tuple[int, int], ...]], ...]:
    """Per stage's all-reduce ring: its slowest resource's capacity, the slowest share it gets
    of the resources no other ring of the layout crosses (capacity over the ring's own edges
    on it, whatever else runs), and the shared resources with the ring's edge count on each.
    Computed once per layout: the fluid model below then only walks the shared resources."""
    got = layout.__dict__.get("_ring_use")
    if got is None:
        counts = []
        rings_of: dict[int, int] = {}
        for edges in layout.ar_rings:
            count: dict[int, int] = {}
            for e in edges:
                for r in e:
                    count[r] = count.get(r, 0) + 1
            counts.append(count)
            for r in count:
                rings_of[r] = rings_of.get(r, 0) + 1
        caps = layout.ar_caps
        got = tuple(
            (min((caps[r] for r in c), default=math.inf),
             min((caps[r] / n for r, n in c.items() if rings_of[r] == 1), default=math.inf),
             tuple((r, n) for r, n in c.items() if rings_of[r] > 1))
            for c in counts
        )
        object.__setattr__(layout, "_ring_use", got)  # a frozen layout: cache beside its fields
    return got


def allreduce_finish(layout: Any, stage_end: list[float], nbytes: list[float]) -> list[float]:
    """When each stage's gradient all-reduce ends, rings sharing links splitting their bandwidth.

    A small fluid model: each ring starts when its stage's last action ends and moves
    :func:`ring_volume` bytes over every edge; an edge gets an equal share of each resource it
    crosses, a ring advances at its slowest edge's rate, and rates are recomputed whenever a
    ring starts or ends; the ring's latency and the reduction's own work (no link) add to its
    end. The optimistic layout (a lower bound) uses uncontended rings instead.
    """
    num = len(stage_end)
    out = list(stage_end)
    jobs = {}
    for s in range(num):
        edges = layout.ar_rings[s] if layout.ar_rings else ()
        if len(edges) > 1 and nbytes[s] > 0:
            if layout.optimistic:
                out[s] = _uncontended_end(layout, s, stage_end[s], nbytes[s])
            else:
                reduce = nbytes[s] * _reduce_of(layout, s)
                jobs[s] = [stage_end[s], ring_volume(len(edges), nbytes[s]), reduce]
    if not jobs:
        return out
    caps = layout.ar_caps
    use = _ring_use(layout)
    users: dict[int, int] = {}
    for s in jobs:
        for r, _ in use[s][2]:
            users[r] = users.get(r, 0) + 1
    if max(users.values(), default=1) == 1:  # no two rings share a link: each at its own pace
        for s, (start, volume, reduce) in jobs.items():
            out[s] = start + volume / use[s][0] + layout.ar_lat_ms[s] + reduce
        return out
    pending = sorted(jobs, key=lambda s: jobs[s][0])
    active: dict[int, float] = {}
    t = jobs[pending[0]][0]
    # Every pass admits the next ring or ends the ring(s) that finish first, chosen by the
    # time they finish and not by what is left of their bytes: with near-free links a ring's
    # remaining time can fall below the resolution of ``t`` (a step of 0), so a test on the
    # leftover bytes would never succeed and the loop would spin. At most 2 x rings passes.
    while pending or active:
        while pending and jobs[pending[0]][0] <= t:
            s = pending.pop(0)
            active[s] = jobs[s][1]
        if not active:
            t = jobs[pending[0]][0]
            continue
        load: dict[int, int] = {}
        for s in active:
            for r, times in use[s][2]:
                load[r] = load.get(r, 0) + times
        rate = {s: min((use[s][1], *(caps[r] / load[r] for r, _ in use[s][2]))) for s in active}
        left = {s: active[s] / rate[s] for s in active}
        first = min(left.values())
        nxt = jobs[pending[0]][0] if pending else float("inf")
        if nxt < t + first:  # a ring starts before any ends: advance to it
            for s in active:
                active[s] -= rate[s] * (nxt - t)
            t = nxt
            continue
        ended = [s for s in active if left[s] <= first * (1 + 1e-9)]
        t += first
        for s in list(active):
            if s in ended:
                del active[s]
                out[s] = t + layout.ar_lat_ms[s] + jobs[s][2]
            else:
                active[s] = max(active[s] - rate[s] * first, 0.0)
    return out


def allreduce_lower(layout: Any, stage_end: list[float], nbytes: list[float]) -> list[float]:
    """A lower bound of :func:`allreduce_finish` for rings starting no earlier than
    ``stage_end``: each ring alone, at its slowest resource's whole capacity (a shared
    resource only lowers its rate), which for the optimistic layout is its own formula."""
    out = list(stage_end)
    use = _ring_use(layout) if layout.ar_rings and not layout.optimistic else ()
    for s in range(len(stage_end)):
        edges = layout.ar_rings[s] if layout.ar_rings else ()
        if len(edges) > 1 and nbytes[s] > 0:
            if layout.optimistic:
                out[s] = _uncontended_end(layout, s, stage_end[s], nbytes[s])
            else:
                out[s] = (stage_end[s] + ring_volume(len(edges), nbytes[s]) / use[s][0]
                          + layout.ar_lat_ms[s] + nbytes[s] * _reduce_of(layout, s))
    return out
