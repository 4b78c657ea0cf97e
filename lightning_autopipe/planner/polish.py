"""A final local search over a plan's cuts, many candidates priced per replay pass.

The partitioner spends a bounded number of evaluations (large shapes get few), so its answer
can sit next to a better one: a boundary moved by a few blocks, or two adjacent boundaries
moved together. :func:`polish` walks from the chosen cuts to the best neighbour while one is
faster, over exactly those moves (every boundary by ±1..3 blocks, every pair of adjacent
boundaries by ±1 each), until none is.

Every neighbour of a sweep is priced at once by :func:`evaluate_many`: the fast model's replay
(:func:`~.costmodel.evaluate`) run on numpy vectors, one element per candidate, so a sweep over
about ten times the stage count of candidates costs little more than one replay. It performs
the same operations in the same order as the scalar replay (a test holds them equal), which
keeps the search's bookkeeping (critical path, start causes) out of the vector version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lightning_autopipe.planner.compiled import (
    B,
    Compiled,
    compiled,
    extrapolation_point,
    inflight,
    splits_backward,
)
from lightning_autopipe.planner.costmodel import stage_times
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.pricing import allreduce_finish, peak_memory_bytes

__all__ = ["MOVES", "evaluate_many", "neighbours", "polish", "sweep_budget"]

#: One boundary by ±1..3 blocks, or two adjacent boundaries by ±1 each.
MOVES = ("single ±1..3", "adjacent pair ±1")


def sweep_budget(num_stages: int) -> int:
    """Most sweeps :func:`polish` takes: eight. Each sweep strictly improves the step, so the
    walk ends anyway; from the partitioner's answer it takes one to three, while a long walk
    of small gains on a large pipeline (every sweep replays the step twice over) would cost
    seconds. A plan whose walk stopped here says so (``Plan.search_notes``)."""
    return 8


def neighbours(cuts: Sequence[int]) -> list[list[int]]:
    """Every valid cut list one move of :data:`MOVES` away from ``cuts``."""
    n = len(cuts) - 1
    out: list[list[int]] = []
    seen = {tuple(cuts)}

    def add(cand: list[int]) -> None:
        if all(cand[q] < cand[q + 1] for q in range(n)) and tuple(cand) not in seen:
            seen.add(tuple(cand))
            out.append(cand)

    for p in range(1, n):
        for d in (-3, -2, -1, 1, 2, 3):
            cand = list(cuts)
            cand[p] += d
            add(cand)
    for p in range(1, n - 1):
        for d1 in (-1, 1):
            for d2 in (-1, 1):
                cand = list(cuts)
                cand[p] += d1
                cand[p + 1] += d2
                add(cand)
    return out


def evaluate_many(
    costs: BlockCosts, layout: Layout, cuts_list: Sequence[Sequence[int]], batch: int,
    num_microbatches: int, startup_slices: int = 1, *, drain_slices: int = 1,
    schedule: str = "1f1b", optimizer_factor: float = 2.0,
) -> list[tuple[float, bool]]:
    """``(iteration_ms, fits)`` of :func:`~.costmodel.evaluate` for every cut list, one replay."""
    num, c = layout.num_stages, len(cuts_list)
    m, k, j = num_microbatches, startup_slices, drain_slices
    mb = max(1, batch // (m * max(layout.replicas)))
    split = splits_backward(schedule)
    rows = [stage_times(costs, layout, list(cuts), batch, m, split) for cuts in cuts_list]
    kinds = len(rows[0][0][0])
    ovh = layout.overhead_ms
    var = [[np.array([r[0][s][code][0] for r in rows]) for s in range(num)]
           for code in range(kinds)]
    per_call = [[np.array([r[0][s][code][1] + ovh[s] for r in rows]) for s in range(num)]
                for code in range(kinds)]
    cut_ms = [np.array([costs.act[cuts[s + 1] - 1] * r[1][s] * layout.link_ms_per_byte[s]
                        for cuts, r in zip(cuts_list, rows)]) for s in range(num - 1)]
    m0 = extrapolation_point(num)
    lat, queue = layout.link_lat_ms, not layout.optimistic
    if m <= m0:
        finish = _replay_many(compiled(schedule, num, m, k, mb, j), var, per_call, cut_ms, lat,
                              queue, c)
    else:
        win = min(num + 1, m - m0)
        f1 = _replay_many(compiled(schedule, num, m0, k, mb, j), var, per_call, cut_ms, lat,
                          queue, c)
        finish = _replay_many(compiled(schedule, num, m0 + win, k, mb, j), var, per_call,
                              cut_ms, lat, queue, c)
        period = np.maximum(0.0, np.max(finish, axis=0) - np.max(f1, axis=0)) / win
        finish = finish + (m - m0 - win) * period
    held = inflight(schedule, num, m, k, mb, j)
    out = []
    for i, cuts in enumerate(cuts_list):
        grads = [float(costs.params[cuts[s + 1]] - costs.params[cuts[s]]) for s in range(num)]
        ends = allreduce_finish(layout, [float(finish[s][i]) for s in range(num)], grads)
        fits = all(
            peak_memory_bytes(costs.params[cuts[s + 1]] - costs.params[cuts[s]],
                              (costs.mem[cuts[s + 1]] - costs.mem[cuts[s]]) * rows[i][1][s],
                              held[s], optimizer_factor) <= layout.capacity[s]
            for s in range(num)
        )
        out.append((max(ends), fits))
    return out


def _replay_many(
    comp: Compiled,
    var: list[list[np.ndarray]],
    per_call: list[list[np.ndarray]],
    cut_ms: list[np.ndarray],
    lat: tuple[float, ...],
    queue: bool,
    count: int,
) -> np.ndarray:
    """The scalar replay's recurrence on vectors: each stage's last end, shape (stages, C)."""
    fracs = comp.fracs
    zero = np.zeros(count)
    end: list[np.ndarray] = [zero] * len(comp.order)
    free_f = [zero] * len(cut_ms)
    free_b = [zero] * len(cut_ms)
    for n, (s, code, u, prev, cross) in enumerate(comp.order):
        t = end[prev] if prev >= 0 else zero
        if cross >= 0:
            is_b = code == B
            c = s if is_b else s - 1
            dur = cut_ms[c] * fracs[u]
            sent = end[cross]
            if queue:
                free = free_b if is_b else free_f
                sent = np.maximum(sent, free[c])
                free[c] = sent + dur
            t = np.maximum(t, sent + dur + lat[c])
        end[n] = t + var[code][s] * fracs[u] + per_call[code][s]
    return np.stack([end[comp.last[s]] for s in range(len(comp.last))])


def polish(
    cuts: Sequence[int], price: Callable[[list[list[int]]], list[tuple[float, bool]]]
) -> tuple[list[int], int]:
    """The best cuts a walk over :func:`neighbours` reaches from ``cuts``, and the sweeps taken.

    ``price`` gives ``(iteration_ms, fits)`` of each cut list (:func:`evaluate_many` with the
    plan's layout and shape bound). Each sweep moves to the fastest neighbour (plans that fit
    memory first) while it beats the current cuts by more than rounding; it stops at a local
    optimum of these moves or after :func:`sweep_budget` sweeps.
    """
    cur = list(cuts)
    (best_ms, best_fit), = price([cur])
    sweeps = 0
    while sweeps < sweep_budget(len(cur) - 1):
        cands = neighbours(cur)
        if not cands:
            break
        sweeps += 1
        scores = price(cands)
        i = min(range(len(cands)), key=lambda x: (not scores[x][1], scores[x][0]))
        ms, fit = scores[i]
        if (fit, -ms) <= (best_fit, -best_ms * (1 - 1e-9)):
            break
        cur, best_ms, best_fit = cands[i], ms, fit
    return cur, sweeps
