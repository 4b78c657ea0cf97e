"""The startup and drain slicers: how many slices the first and last micro-batch get.

Steps 3 and 4 of the AutoPipe partitioner (:mod:`~.partition`): given the cuts, the ``k`` in
``1..max_slices`` (then the ``j``) with the shortest predicted step that fits memory, the
smallest one that no larger count clearly beats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lightning_autopipe.planner.bound import bound_batch
from lightning_autopipe.planner.costmodel import Estimate, evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.step import StepShape

__all__ = ["better", "cannot_beat", "choose_drain_slices", "choose_startup_slices"]


def better(a: Estimate, b: Estimate | None, rel: float = 1e-9) -> bool:
    """Plans that fit memory beat plans that do not; then the clearly shorter step wins
    (shorter by more than ``rel``); the partitioner compares its candidates so too."""
    if b is None:
        return True
    if a.fits != b.fits:
        return a.fits
    return a.iteration_ms < b.iteration_ms * (1 - rel)


def cannot_beat(low: float, fits: bool, b: Estimate | None, rel: float = 1e-9) -> bool:
    """Whether no estimate with this lower bound of its step and this ``fits`` can be
    :func:`better` than ``b`` (then it need not be replayed, :func:`~.bound.bound_batch`)."""
    if b is None:
        return False
    if fits != b.fits:
        return not fits
    return low >= b.iteration_ms * (1 - rel)


def choose_startup_slices(
    costs: BlockCosts, layout: Layout, cuts: list[int], step: StepShape, max_slices: int = 8,
) -> tuple[int, Estimate]:
    """The number of startup slices (1 = off) with the shortest predicted step that fits memory
    (``step`` cut otherwise as it says; its own ``startup_slices`` is what is chosen).

    ``k`` is limited by the per-replica micro-batch size (a slice holds at least one sample).
    """
    mb = step.microbatch_size(max(layout.replicas))
    return _fewest_best(
        max(1, min(max_slices, mb)),
        lambda k: evaluate(costs, layout, cuts, replace(step, startup_slices=k),
                           critical_path=False),
        lambda k: bound_batch(costs, layout, [cuts], replace(step, startup_slices=k))[0],
    )


def choose_drain_slices(
    costs: BlockCosts, layout: Layout, cuts: list[int], step: StepShape, max_slices: int = 8,
) -> tuple[int, Estimate]:
    """Slices ``j`` of the last micro-batch (1 = off) with the shortest predicted step (``step``
    cut otherwise as it says; its own ``drain_slices`` is what is chosen).

    Chosen after ``k`` (coordinate descent): the drain tail and the fill head are at opposite
    ends of the step and barely interact. Only with two or more micro-batches.
    """
    mb = step.microbatch_size(max(layout.replicas))
    return _fewest_best(
        max(1, min(max_slices, mb)) if step.num_microbatches >= 2 else 1,
        lambda j: evaluate(costs, layout, cuts, replace(step, drain_slices=j),
                           critical_path=False),
        lambda j: bound_batch(costs, layout, [cuts], replace(step, drain_slices=j))[0],
    )


def _fewest_best(
    top: int, estimate: Callable[[int], Estimate],
    bound: Callable[[int], tuple[float, bool]] | None = None,
) -> tuple[int, Estimate]:
    """The smallest slice count in ``1..top`` whose estimate no larger count clearly beats
    (a count whose ``bound`` cannot beat the best so far is not replayed)."""
    best_n, best = 1, estimate(1)
    for n in range(2, top + 1):
        if bound is not None and cannot_beat(*bound(n), best, 1e-6):
            continue
        e = estimate(n)
        if better(e, best, 1e-6):
            best_n, best = n, e
    return best_n, best
