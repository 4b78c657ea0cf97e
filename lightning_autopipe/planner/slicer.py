"""The startup and drain slicers: how many slices the first and last micro-batch get.

Steps 3 and 4 of the AutoPipe partitioner (:mod:`~.partition`): given the cuts, the ``k`` in
``1..max_slices`` (then the ``j``) with the shortest predicted step that fits memory, the
smallest one that no larger count clearly beats.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_autopipe.planner.bound import bound_batch
from lightning_autopipe.planner.costmodel import Estimate, evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout

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
    :func:`better` than ``b`` (then it need not be replayed, :func:`~.costmodel.bound_batch`)."""
    if b is None:
        return False
    if fits != b.fits:
        return not fits
    return low >= b.iteration_ms * (1 - rel)


def choose_startup_slices(
    costs: BlockCosts,
    layout: Layout,
    cuts: list[int],
    batch: int,
    num_microbatches: int,
    max_slices: int = 8,
    *,
    optimizer_factor: float = 2.0,
    schedule: str = "1f1b",
) -> tuple[int, Estimate]:
    """The number of startup slices (1 = off) with the shortest predicted step that fits memory.

    ``k`` is limited by the per-replica micro-batch size (a slice holds at least one sample).
    """
    mb = batch // (num_microbatches * max(layout.replicas))
    return _fewest_best(
        max(1, min(max_slices, mb)),
        lambda k: evaluate(costs, layout, cuts, batch, num_microbatches, k,
                           optimizer_factor=optimizer_factor, schedule=schedule,
                           critical_path=False),
        lambda k: bound_batch(costs, layout, [cuts], batch, num_microbatches, k,
                              optimizer_factor=optimizer_factor, schedule=schedule)[0],
    )


def choose_drain_slices(
    costs: BlockCosts,
    layout: Layout,
    cuts: list[int],
    batch: int,
    num_microbatches: int,
    startup_slices: int,
    max_slices: int = 8,
    *,
    optimizer_factor: float = 2.0,
    schedule: str = "1f1b",
) -> tuple[int, Estimate]:
    """Slices ``j`` of the last micro-batch (1 = off) with the shortest predicted step.

    Chosen after ``k`` (coordinate descent): the drain tail and the fill head are at opposite
    ends of the step and barely interact. Only with two or more micro-batches.
    """
    mb = batch // (num_microbatches * max(layout.replicas))
    return _fewest_best(
        max(1, min(max_slices, mb)) if num_microbatches >= 2 else 1,
        lambda j: evaluate(costs, layout, cuts, batch, num_microbatches, startup_slices,
                           drain_slices=j, optimizer_factor=optimizer_factor, schedule=schedule,
                           critical_path=False),
        lambda j: bound_batch(costs, layout, [cuts], batch, num_microbatches, startup_slices,
                              drain_slices=j, optimizer_factor=optimizer_factor,
                              schedule=schedule)[0],
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
