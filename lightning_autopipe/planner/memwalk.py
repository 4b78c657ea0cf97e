"""Cuts that fit device memory with recomputation, when the time-favourite cuts do not.

Recomputation is the planner's last resort (:mod:`~.search`): the stages of a finalist that
do not fit recompute their activations. But the finalists' cuts were chosen for time alone,
and a stage that holds most of the model (a split timed as balanced, or timings taken on a
busy machine) can stay over its device's memory even when recomputing, while other cuts of
the same shape would fit. :func:`fitting_cuts` walks the cuts (:func:`~.polish.polish`'s
moves) with every stage recomputing: first towards the least overflow (the worst stage's
peak over its devices' memory), then, once every stage fits, towards the fastest step.
The plan made from the cuts it returns recomputes only the stages that need it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.costmodel import evaluate_batch
from lightning_autopipe.planner.generators import splits_backward
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.polish import polish

__all__ = ["fitting_cuts"]


def fitting_cuts(prop: Proposal, costs: BlockCosts, cluster: Cluster, batch: int,
                 optimizer_factor: float) -> list[int] | None:
    """Cuts for ``prop``'s devices and step under which every stage fits its devices' memory
    with every stage recomputing (under 1F1B when ``prop``'s schedule splits the backward, as
    a recomputing plan runs), the fastest such cuts the walk reaches; None when the walk ends
    without any (or the proposal has several chunks per rank, which do not recompute)."""
    if prop.chunks_per_rank > 1:
        return None
    layout = Layout.from_cluster(cluster, prop.groups)
    schedule = "1f1b" if splits_backward(prop.schedule) else prop.schedule
    step = replace(prop, schedule=schedule).step_shape(batch, optimizer_factor)
    everywhere = [True] * layout.num_stages

    def price(cuts_list: list[list[int]]) -> list[tuple[float, bool]]:
        """(step ms, True) for cuts that fit, (worst overflow ratio, False) for the others:
        :func:`~.polish.polish` prefers fitting cuts, then the lower figure."""
        out = []
        for e in evaluate_batch(costs, layout, cuts_list, step, critical_path=False,
                                recompute=everywhere):
            over = max(p / c if c > 0 else math.inf for p, c in zip(e.peak_bytes, layout.capacity))
            out.append((e.iteration_ms, True) if e.fits else (over, False))
        return out

    walk = polish(prop.cuts, price)
    (_, fits), = price([walk.cuts])
    return walk.cuts if fits else None
