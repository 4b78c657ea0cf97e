"""A final local search over a plan's cuts, many candidates priced per replay pass.

The partitioner spends a bounded number of evaluations (large shapes get few), so its answer
can sit next to a better one: a boundary moved by a few blocks, or two adjacent boundaries
moved together. :func:`polish` walks from the chosen cuts to the best neighbour while one is
faster, over exactly those moves (every boundary by ±1..3 blocks, every pair of adjacent
boundaries by ±1 each), until none is.

Every neighbour of a sweep is priced at once by :func:`evaluate_many`: the fast model's replay
run level by level on numpy arrays with one column per candidate
(:func:`~.costmodel.evaluate_batch`), so a sweep over about ten times the stage count of
candidates costs a few replays. It performs the same operations in the same order as the
scalar replay (a test holds them equal).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_autopipe.planner.bound import bound_batch
from lightning_autopipe.planner.costmodel import evaluate_batch
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.step import StepShape

__all__ = ["MOVES", "Polished", "bound_many", "evaluate_many", "neighbours", "polish",
           "sweep_budget"]

#: One boundary by ±1..3 blocks, or two adjacent boundaries by ±1 each.
MOVES = ("single ±1..3", "adjacent pair ±1")


def sweep_budget(num_stages: int) -> int:
    """Most sweeps :func:`polish` takes: 24. Each sweep strictly improves the step, so the
    walk ends anyway; from the partitioner's answer it takes one to three, and a sweep is one
    batched replay (:func:`evaluate_many`), so the budget only bounds a long walk of small
    gains. A plan whose walk stopped here says so, with the last sweep's gain
    (``Plan.search_notes``)."""
    return 24


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
    costs: BlockCosts, layout: Layout, cuts_list: Sequence[Sequence[int]], step: StepShape,
) -> list[tuple[float, bool]]:
    """``(iteration_ms, fits)`` of :func:`~.costmodel.evaluate` for every cut list, replayed
    together (:func:`~.costmodel.evaluate_batch`)."""
    return [(e.iteration_ms, e.fits)
            for e in evaluate_batch(costs, layout, cuts_list, step, critical_path=False)]


def bound_many(
    costs: BlockCosts, layout: Layout, cuts_list: Sequence[Sequence[int]], step: StepShape,
) -> list[tuple[float, bool]]:
    """``(lower bound of iteration_ms, fits)`` for every cut list, without replays
    (:func:`~.bound.bound_batch`), the same arguments as :func:`evaluate_many`."""
    return bound_batch(costs, layout, cuts_list, step)


@dataclass
class Polished:
    """Where :func:`polish` walked to: the cuts, the sweeps taken and, when the walk stopped
    at its budget, the relative gain of its last sweep (0 otherwise)."""

    cuts: list[int]
    sweeps: int
    last_gain: float = 0.0

    @property
    def at_budget(self) -> bool:
        return self.sweeps >= sweep_budget(len(self.cuts) - 1) and self.last_gain > 0


def polish(
    cuts: Sequence[int], price: Callable[[list[list[int]]], list[tuple[float, bool]]],
    bound: Callable[[list[list[int]]], list[tuple[float, bool]]] | None = None,
) -> Polished:
    """The best cuts a walk over :func:`neighbours` reaches from ``cuts``, and the sweeps taken.

    ``price`` gives ``(figure, fits)`` of each cut list, the figure being what the walk lowers:
    the step's ms (:func:`evaluate_many` with the plan's layout and step bound), or any figure
    of the caller's (:mod:`~.memwalk` gives cuts that do not fit their worst overflow). Each
    sweep moves to the fastest neighbour (plans that fit memory first) while it beats the
    current cuts by more than rounding; it stops at a local
    optimum of these moves or after :func:`sweep_budget` sweeps. ``bound`` (a lower bound of
    the step and the exact ``fits``, :func:`~.bound.bound_batch`) spares the replay of
    the neighbours that cannot beat the current cuts: the fastest neighbour, when it beats
    them, is among the others, so the walk is the same.
    """
    cur = list(cuts)
    (best_ms, best_fit), = price([cur])
    sweeps, gain = 0, 0.0
    while sweeps < sweep_budget(len(cur) - 1):
        cands = neighbours(cur)
        if not cands:
            break
        sweeps += 1
        if bound is not None:
            low = bound(cands)
            cands = [c for c, (ms, fit) in zip(cands, low)
                     if fit > best_fit or (fit == best_fit and ms < best_ms * (1 - 1e-9))]
            if not cands:
                return Polished(cur, sweeps)
        scores = price(cands)
        i = min(range(len(cands)), key=lambda x: (not scores[x][1], scores[x][0]))
        ms, fit = scores[i]
        if (fit, -ms) <= (best_fit, -best_ms * (1 - 1e-9)):
            return Polished(cur, sweeps)
        gain = 1 - ms / best_ms if best_ms > 0 and fit == best_fit else 1.0
        cur, best_ms, best_fit = cands[i], ms, fit
    return Polished(cur, sweeps, gain)
