"""A lower bound of the fast model's replay from two units per stage, for pruning candidates.

The replay (:func:`~.scalar.replay`) is a longest path over every action of a step. Keep
only the actions on two *anchor* units, the first (the fill: its forwards cross every stage
first, its backwards come back first) and the last (the drain), and let every other action
of a stage only add its duration to the gap between the stage's anchors: that drops edges of
the longest-path problem (the other actions' incoming transfers, the link queues), so every
end it computes is at most the replay's. The result is about ``6 S`` operations instead of
``3 S m``, and within a fraction of a percent of the replay when one stage bounds the step.

A step past the extrapolation point (:func:`~.costmodel.evaluate`) is bounded as the whole
step, not the two shorter replays: its anchors are the same actions at every micro-batch
count, and the gaps between them grow linearly with it, which the shorter and the longer
step's gaps give exactly (a test holds the extension equal to contracting the whole step, for
every generator).

:func:`bound_batch` gives the searches (:mod:`~.scorer`, :mod:`~.polish`, :mod:`~.slicer`)
this bound with the exact memory verdict, so that a candidate which cannot beat the best one
seen is not replayed. For a step the fast model replays whole (``m <= m0``, or ``exact``) the
search is then the same as with every candidate replayed. Past the extrapolation point the
estimate is the extrapolation, which can fall below the whole step's bound when the steady
phase has not settled by ``m0`` (by up to a few percent, measured on the shipped profiles):
such a candidate, whose whole step provably is not faster, is not followed either.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_autopipe.planner.allreduce import allreduce_lower
from lightning_autopipe.planner.compiled import (
    B,
    Compiled,
    compiled,
    extrapolation_point,
    inflight_pairs,
)
from lightning_autopipe.planner.costmodel import (
    Inputs,
    candidate_inputs,
    grad_bytes,
    memory_of,
    per_candidate,
)
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.step import StepShape

__all__ = ["Contracted", "contracted", "bound_batch", "bound_ends", "SLACK"]

#: the bound and the replay add the same durations in other orders, and the all-reduce model ends
#: a ring within 1e-9 of its remaining time: the bound is used lowered by this relative margin
SLACK = 1e-8


@dataclass(frozen=True)
class Contracted:
    """A step reduced to its anchor actions (dependency order)."""

    stage: tuple[int, ...]  # per anchor
    code: tuple[int, ...]
    frac: tuple[float, ...]
    prev: tuple[int, ...]  # the stage's previous anchor (-1: none)
    cross: tuple[int, ...]  # the anchor that sends this one its input (-1: none)
    cut: tuple[int, ...]  # the cut that input crosses (-1: none)
    gap: tuple[tuple[float, ...], ...]  # per anchor, per kind code: (fractions, count) before it
    tail: tuple[tuple[float, ...], ...]  # per stage: the same after its last anchor
    last: tuple[int, ...]  # per stage: its last anchor


def _contract(comp: Compiled) -> tuple[tuple, tuple, Contracted]:
    """Anchors of ``comp`` with (structure, gaps) separated, so two micro-batch counts can be
    matched and their gaps extended."""
    num, nu = len(comp.last), len(comp.fracs)
    kinds = 3  # F, B, W: a schedule without W leaves its slots at zero
    role = {0: 0, nu - 1: 1}
    kept: dict[int, int] = {}
    rows: list[tuple] = []
    gaps: list[tuple[float, ...]] = []
    last = [-1] * num
    gap = [[0.0] * (2 * kinds) for _ in range(num)]
    for n, (s, code, u, _prev, cross) in enumerate(comp.order):
        f = comp.fracs[u]
        if u in role:
            ck = kept[cross] if cross >= 0 else -1
            cut = (s if code == B else s - 1) if cross >= 0 else -1
            kept[n] = len(rows)
            rows.append((s, code, role[u], f, last[s], ck, cut))
            gaps.append(tuple(gap[s]))
            last[s] = kept[n]
            gap[s] = [0.0] * (2 * kinds)
        else:
            gap[s][2 * code] += f
            gap[s][2 * code + 1] += 1.0
    tails = tuple(tuple(g) for g in gap)
    structure = (tuple(rows), tuple(last))
    con = Contracted(
        stage=tuple(r[0] for r in rows), code=tuple(r[1] for r in rows),
        frac=tuple(r[3] for r in rows), prev=tuple(r[4] for r in rows),
        cross=tuple(r[5] for r in rows), cut=tuple(r[6] for r in rows),
        gap=tuple(gaps), tail=tails, last=tuple(last),
    )
    return structure, (tuple(gaps), tails), con


def _contract_cached(comp: Compiled) -> tuple[tuple, tuple, Contracted]:
    cache = comp.__dict__
    got = cache.get("_contracted")
    if got is None:
        got = cache["_contracted"] = _contract(comp)
    return got


@functools.lru_cache(maxsize=512)
def contracted(
    schedule: str, num: int, m: int, k: int, mb: int, j: int, exact: bool = False
) -> Contracted | None:
    """The anchors of the whole step of ``m`` micro-batches, or None when its gaps do not
    grow linearly with the micro-batch count (then nothing is bounded).

    Past the extrapolation point (unless ``exact``) the whole step is not compiled: the step
    of ``m0`` and of ``m0 + win`` micro-batches are (the replay uses them), and the gaps of
    ``m`` are extended from theirs.
    """
    m0 = extrapolation_point(num)
    if exact or m <= m0:
        return _contract_cached(compiled(schedule, num, m, k, mb, j))[2]
    win = min(num + 1, m - m0)
    s_struct, (s_gap, s_tail), _ = _contract_cached(compiled(schedule, num, m0, k, mb, j))
    l_struct, (l_gap, l_tail), con = _contract_cached(
        compiled(schedule, num, m0 + win, k, mb, j))
    if s_struct != l_struct:
        return None
    r = (m - m0 - win) / win

    def grow(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(y + (y - x) * r for x, y in zip(a, b))

    if any(y < x for a, b in zip(s_gap + s_tail, l_gap + l_tail) for x, y in zip(a, b)):
        return None
    return Contracted(con.stage, con.code, con.frac, con.prev, con.cross, con.cut,
                      tuple(grow(a, b) for a, b in zip(s_gap, l_gap)),
                      tuple(grow(a, b) for a, b in zip(s_tail, l_tail)), con.last)


def bound_ends(
    con: Contracted, var: list[list[float]], per_call: list[list[float]], cut_ms: list[float],
    lat: tuple[float, ...],
) -> list[float]:
    """A lower bound of each stage's last end in the replay of the whole step (same inputs as
    :func:`~.scalar.replay`, no all-reduce)."""
    kinds = len(var)
    codes = range(kinds)
    end = [0.0] * (len(con.stage) + 1)  # the last slot: 0.0 for "no previous anchor"

    def spent(s: int, g: tuple[float, ...]) -> float:
        t = 0.0
        for c in codes:
            if g[2 * c + 1]:
                t += var[c][s] * g[2 * c] + per_call[c][s] * g[2 * c + 1]
        return t

    for a, (s, code, f, prev, cross, cut, g) in enumerate(zip(
            con.stage, con.code, con.frac, con.prev, con.cross, con.cut, con.gap)):
        t = end[prev] + spent(s, g)
        if cross >= 0:
            tc = end[cross] + cut_ms[cut] * f + lat[cut]
            if tc > t:
                t = tc
        end[a] = t + var[code][s] * f + per_call[code][s]
    return [end[con.last[s]] + spent(s, con.tail[s]) for s in range(len(con.last))]


def bound_batch(
    costs: BlockCosts,
    layouts: Layout | Sequence[Layout],
    cuts_list: Sequence[Sequence[int]],
    step: StepShape,
    *,
    exact: bool = False,
    recompute: Sequence[bool] = (),
) -> list[tuple[float, bool]]:
    """Per cut list, a lower bound of the whole step (the arguments of
    :func:`~.costmodel.evaluate_batch`; 0 where none is known) and the estimate's exact
    ``fits``, without a replay."""
    lays = per_candidate(layouts, len(cuts_list))
    schedule, m = step.schedule, step.num_microbatches
    k, j = step.startup_slices, step.drain_slices
    out = []
    for x in candidate_inputs(costs, lays, cuts_list, step, recompute):
        num = x.layout.num_stages
        con = contracted(schedule, num, m, k, x.mb, j, exact)
        fits = memory_of(costs, x, inflight_pairs(schedule, num, m, k, x.mb, j),
                         step.optimizer_factor, recompute)[1]
        low = _lower(x, con, grad_bytes(costs, x.cuts)) * (1 - SLACK) if con else 0.0
        out.append((low, fits))
    return out


def _lower(x: Inputs, con: Contracted, grads: list[float]) -> float:
    """The bound of the whole step, all-reduces included (the layout's rings each alone)."""
    ends = bound_ends(con, x.var, x.per_call, x.cut_ms, x.layout.link_lat_ms)
    return max(allreduce_lower(x.layout, ends, grads))
