"""The generators' schedules compiled for the fast model: dependency order, memory in flight.

A compute-only schedule from :mod:`~.generators` becomes per-stage (kind code, unit) lists and a
flat order in which every action's dependencies come first (so the replay is one pass), cached
per (schedule, stages, micro-batches, slices).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.generators import SCHEDULES, splits_backward
from lightning_autopipe.planner.schedule import Kind, unit_sizes, units

__all__ = ["F", "B", "W", "Compiled", "compiled", "inflight", "inflight_pairs", "lists",
           "inflight_of", "pairs_of",
           "extrapolation_point", "splits_backward"]  # splits_backward: from .generators

@dataclass(frozen=True)
class Compiled:
    """A compute-only schedule flattened into dependency order (see :func:`_compile_lists`)."""

    order: tuple[tuple[int, int, int, int, int], ...]  # stage, kind code, unit, prev, cross
    last: tuple[int, ...]  # index of each stage's last action
    inflight: tuple[float, ...]  # most micro-batches (fractions) in flight per stage
    fracs: tuple[float, ...]  # size of each unit relative to a whole micro-batch
    split: bool = False  # backward split into B (input gradient) and W (weight gradient)


F, B, W = 0, 1, 2  # kind codes of the compiled lists
_CODE = {Kind.FORWARD: F, Kind.BACKWARD: B, Kind.WEIGHT: W}


def _compilelists(lists: Sequence[Sequence[tuple[int, int]]], fracs: list[float]) -> Compiled:
    """Topological order of per-stage (kind code, unit) lists (worklist, linear time).

    A forward waits for the previous stage's forward of its unit, a backward for the next
    stage's backward; a weight backward only for its own stage's order.
    """
    num = len(lists)
    nu = len(fracs)
    done_f = [[-1] * nu for _ in range(num)]
    done_b = [[-1] * nu for _ in range(num)]
    pos = [0] * num
    last = [-1] * num
    order: list[tuple[int, int, int, int, int]] = []
    work = list(range(num))
    queued = [True] * num
    while work:
        s = work.pop()
        queued[s] = False
        acts = lists[s]
        p = pos[s]
        while p < len(acts):
            code, u = acts[p]
            if u >= nu:
                raise ScheduleError(f"stage {s} runs an action of unknown unit {u}")
            cross = -1
            if code == B and s < num - 1:
                cross = done_b[s + 1][u]
                if cross < 0:
                    break
            elif code == F and s > 0:
                cross = done_f[s - 1][u]
                if cross < 0:
                    break
            n = len(order)
            order.append((s, code, u, last[s], cross))
            last[s] = n
            if code != W:
                nb = s - 1 if code == B else s + 1
                (done_b if code == B else done_f)[s][u] = n
                if 0 <= nb < num and not queued[nb]:
                    queued[nb] = True
                    work.append(nb)
            p += 1
        pos[s] = p
    stuck = [s for s in range(num) if pos[s] < len(lists[s])]
    if stuck:
        raise ScheduleError(f"schedule deadlocks: stages {stuck} wait for units never produced")
    split = any(code == W for acts in lists for code, _ in acts)
    return Compiled(tuple(order), tuple(last), inflight_of(lists, fracs), tuple(fracs), split)


@functools.lru_cache(maxsize=256)
def lists(
    schedule: str, num_stages: int, m: int, k: int, j: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The generator's schedule for this shape as per-stage (kind code, unit index) lists."""
    acts = SCHEDULES[schedule](num_stages, m, k, j)
    index = {u: i for i, u in enumerate(units(m, k, j))}
    return tuple(
        tuple((_CODE[a.kind], index[(a.microbatch, a.slice)]) for a in acts[s])
        for s in range(num_stages)
    )


@functools.lru_cache(maxsize=1024)
def compiled(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    startup_slices: int,
    mb: int,
    drain_slices: int = 1,
) -> Compiled:
    """The generator's schedule for this shape, compiled for the replay."""
    m, k, j = num_microbatches, startup_slices, drain_slices
    fracs = [sz / mb for sz in unit_sizes(mb, m, k, j)]
    return _compilelists(lists(schedule, num_stages, m, k, j), fracs)


def inflight_of(lists: Sequence[Sequence[tuple[int, int]]], fracs: list[float]) -> tuple:
    """Per stage, the most micro-batches held at once: from a unit's forward until its
    backward, or until its weight backward when the backward is split (W still reads the
    activations the forward saved)."""
    split = any(code == W for acts in lists for code, _ in acts)
    release = W if split else B
    out = []
    for acts in lists:
        cur = peak = 0.0
        for code, u in acts:
            if code == F:
                cur += fracs[u]
                peak = max(peak, cur)
            elif code == release:
                cur -= fracs[u]
        out.append(peak)
    return tuple(out)


def pairs_of(lists: Sequence[Sequence[tuple[int, int]]], fracs: list[float]) -> tuple:
    """Per stage, the micro-batches (fractions for slices) it holds right after each forward,
    as pairs (held until their release, held until their backward): a split backward's B
    frees what the loss saved (``BlockProfile.loss_bytes``), its W the rest; without a split
    the two counts are one. Kept: the pairs no other pair exceeds in both counts, among which
    a stage holding ``x`` bytes per unit until the release and ``y`` more until the backward
    peaks (:func:`~.pricing.activation_peak`)."""
    split = any(code == W for acts in lists for code, _ in acts)
    release = W if split else B
    out = []
    for acts in lists:
        a = b = 0.0
        seen = [(0.0, 0.0)]
        for code, u in acts:
            if code == F:
                a, b = a + fracs[u], b + fracs[u]
                seen.append((a, b))
                continue
            if code == release:
                a -= fracs[u]
            if code == B:
                b -= fracs[u]
        frontier: list[tuple[float, float]] = []
        for pa, pb in sorted(set(seen), key=lambda p: (-p[0], -p[1])):
            if not frontier or pb > frontier[-1][1]:
                frontier.append((pa, pb))
        out.append(tuple(frontier))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def inflight_pairs(schedule: str, num_stages: int, num_microbatches: int, startup_slices: int,
                   mb: int, drain_slices: int = 1) -> tuple:
    """:func:`pairs_of` of ``schedule``'s lists; a step longer than the extrapolation point is
    extended linearly from two shorter ones as :func:`inflight` is (pair by pair where both
    have as many, else their largest counts, which bound the peak from above)."""
    m, k, j = num_microbatches, startup_slices, drain_slices
    m0 = extrapolation_point(num_stages)
    if m <= m0 + num_stages + 1:
        fracs = [sz / mb for sz in unit_sizes(mb, m, k, j)]
        return pairs_of(lists(schedule, num_stages, m, k, j), fracs)
    win = num_stages + 1
    short = inflight_pairs(schedule, num_stages, m0, k, mb, j)
    longer = inflight_pairs(schedule, num_stages, m0 + win, k, mb, j)
    out = []
    for x, y in zip(short, longer):
        if len(x) != len(y):
            x, y = ((max(p[0] for p in x), max(p[1] for p in x)),), (
                (max(p[0] for p in y), max(p[1] for p in y)),)
        out.append(tuple((a + (c - a) / win * (m - m0), b + (d - b) / win * (m - m0))
                         for (a, b), (c, d) in zip(x, y)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def inflight(schedule: str, num_stages: int, num_microbatches: int, startup_slices: int, mb: int,
             drain_slices: int = 1) -> tuple[float, ...]:
    """Most micro-batches (slices as fractions) each stage holds in flight under ``schedule``:
    the largest first count of its :func:`inflight_pairs`.

    A step longer than the extrapolation point is not generated whole: as with the replay
    (:func:`evaluate`), the counts of two shorter steps past the warm-up are extended
    linearly, which is exact for schedules whose in-flight count is constant (1F1B) or grows
    by a fixed amount per micro-batch (GPipe) once they are in their steady phase.
    """
    return tuple(pairs[0][0] for pairs in inflight_pairs(
        schedule, num_stages, num_microbatches, startup_slices, mb, drain_slices))


def extrapolation_point(num_stages: int) -> int:
    """Micro-batch count beyond which a schedule is in its periodic steady phase (with margin)."""
    return 2 * num_stages + 6
