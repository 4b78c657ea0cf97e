"""The fast model's replay run level by level on numpy arrays, many candidates at once.

The scalar replay (:func:`~.scalar.replay`) walks a compiled schedule one action at a
time. Its recurrence only ever reads actions that come earlier in the dependency order (the
stage's previous action, the neighbour action that sends it its input, the previous transfer
over the same link), so the actions fall into *levels*: an action's level is one more than
the deepest of those it reads. Every action of a level can be priced at once, and with one
column per candidate cut list (or layout) a whole batch of candidates is priced by a few
numpy operations per level. A pipeline of ``S`` stages has about ``S`` to ``3 S`` actions
per level, so a deep pipeline gains even for a single candidate.

Every level performs the scalar replay's operations in the same order on the same float64
values (``max`` and ``+`` only), so the results are equal to the bit (a test holds them so).
The levels of a compiled shape are computed once and cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_autopipe.planner.compiled import B, Compiled

__all__ = ["Levels", "levels_of", "replay_levels"]


@dataclass(frozen=True)
class Levels:
    """A compiled schedule regrouped by level (positions are in level order)."""

    bounds: tuple[tuple[int, int], ...]  # [start, stop) positions of each level
    perm: np.ndarray  # action index at each position
    pos: np.ndarray  # position of each action (and of the sentinel, last)
    prev: np.ndarray  # per position: position of the stage's previous action (sentinel: none)
    cross: np.ndarray  # per position: position of the sending action (sentinel: none)
    link: np.ndarray  # per position: position of the previous transfer on the same link
    stage: np.ndarray  # per position: stage, kind code, unit, cut index, has a transfer
    code: np.ndarray
    unit: np.ndarray
    cut: np.ndarray
    has_cross: np.ndarray
    last: np.ndarray  # position of each stage's last action
    width: float  # mean actions per level


def levels_of(comp: Compiled, queue: bool) -> Levels:
    """The levels of ``comp`` (with ``queue``: each link's transfers in the sender's order),
    computed once per compiled schedule and kept beside it (hashing a compiled schedule to
    look it up would cost as much as a short replay)."""
    cache = comp.__dict__.setdefault("_levels", {})
    got = cache.get(queue)
    if got is None:
        got = cache[queue] = _levels(comp, queue)
    return got


def _levels(comp: Compiled, queue: bool) -> Levels:
    order = comp.order
    n = len(order)
    level = [0] * n
    last_on_link: dict[tuple[int, bool], int] = {}
    plink = [-1] * n
    for i, (s, code, _u, prev, cross) in enumerate(order):
        lv = level[prev] + 1 if prev >= 0 else 1
        if cross >= 0:
            lv = max(lv, level[cross] + 1)
            if queue:
                key = (s if code == B else s - 1, code == B)
                before = last_on_link.get(key, -1)
                if before >= 0:
                    lv = max(lv, level[before] + 1)
                plink[i] = before
                last_on_link[key] = i
        level[i] = lv
    lv_arr = np.asarray(level, dtype=np.int64)
    perm = np.argsort(lv_arr, kind="stable")
    pos = np.empty(n + 1, dtype=np.int64)
    pos[perm] = np.arange(n)
    pos[n] = n  # the sentinel row: 0.0 (no previous action, no sender, link free at 0)
    arr = np.asarray(order, dtype=np.int64).reshape(n, 5)
    s_a, code_a, u_a, prev_a, cross_a = (arr[perm, c] for c in range(5))
    counts = np.bincount(lv_arr)[1:]
    stops = np.cumsum(counts)
    bounds = tuple((int(a), int(b)) for a, b in zip(stops - counts, stops))
    has = cross_a >= 0
    return Levels(
        bounds=bounds, perm=perm, pos=pos,
        prev=pos[np.where(prev_a >= 0, prev_a, n)],
        cross=pos[np.where(has, cross_a, n)],
        link=pos[np.where(np.asarray(plink)[perm] >= 0, np.asarray(plink)[perm], n)],
        stage=s_a, code=code_a, unit=u_a,
        cut=np.where(has, np.where(code_a == B, s_a, s_a - 1), 0), has_cross=has,
        last=pos[np.asarray(comp.last, dtype=np.int64)],
        width=n / max(1, len(bounds)),
    )


def replay_levels(
    comp: Compiled,
    var: np.ndarray,
    per_call: np.ndarray,
    cut_ms: np.ndarray,
    lat: np.ndarray,
    queue: bool,
    via: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Each stage's last end, shape (stages, C), and optionally each action's start cause.

    Args:
        var, per_call: (kinds, stages, C) scaling and per-call parts per kind code, the
            device overhead included in ``per_call``, as the scalar replay takes them.
        cut_ms, lat: (cuts, C) transfer time of a whole micro-batch and latency per cut.
        queue: each cut's link carries one transfer per direction at a time.
        via: also return (actions, C) booleans in the compiled order: True where the action
            was started by its incoming transfer (for the critical path).
    """
    lv = levels_of(comp, queue)
    n = len(comp.order)
    count = var.shape[-1]
    fr = np.asarray(comp.fracs)[lv.unit][:, None]
    work = var[lv.code, lv.stage] * fr
    call = per_call[lv.code, lv.stage]
    if len(cut_ms):
        dur = np.where(lv.has_cross[:, None], cut_ms[lv.cut] * fr, 0.0)
        wait = np.where(lv.has_cross[:, None], lat[lv.cut], -np.inf)
    else:
        dur = np.zeros((n, count))
        wait = np.full((n, count), -np.inf)
    end = np.zeros((n + 1, count))
    free = np.zeros((n + 1, count))  # sent + duration of each transfer (0 for none)
    started = np.zeros((n, count), dtype=bool) if via else None
    prev, cross, link = lv.prev, lv.cross, lv.link
    maximum = np.maximum
    for a, b in lv.bounds:
        t = end[prev[a:b]]
        sent = end[cross[a:b]]
        if queue:
            sent = maximum(sent, free[link[a:b]])
        sent = sent + dur[a:b]
        free[a:b] = sent
        tc = sent + wait[a:b]
        if started is not None:
            started[a:b] = tc > t
        end[a:b] = maximum(t, tc) + work[a:b] + call[a:b]
    finish = end[lv.last]
    if started is None:
        return finish, None
    return finish, started[lv.pos[:n]]
