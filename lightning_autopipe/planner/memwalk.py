"""Cuts that fit device memory with recomputation, when the time-favourite cuts do not.

Recomputation is the planner's last resort (:mod:`~.search`): the stages of a finalist that
do not fit recompute their activations. But the finalists' cuts were chosen for time alone,
and a stage that holds most of the model (a split timed as balanced, or timings taken on a
busy machine) can stay over its device's memory even when recomputing, while other cuts of
the same shape would fit. :func:`fitting_cuts` walks the cuts (:func:`~.polish.polish`'s
moves): first towards the least overflow with every stage recomputing (the worst stage's
peak over its devices' memory), then, once every stage fits, towards the fastest step of the
plan the cuts make (the stages that do not fit recomputing, the others not).

The walk moves one cut, or two adjacent ones, at a time: from the time-favourite cuts it can
stop where lowering the worst stage needs many cuts to shift together (a long model on many
stages). So it also starts from the cuts that balance memory itself (each stage's parameter
state and activations against its devices' memory, :func:`~.balance.balanced_cuts`), and
both ends are returned for the simulator to choose between, each plan recomputing only the
stages that need it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.balance import balanced_cuts
from lightning_autopipe.planner.costmodel import evaluate_batch
from lightning_autopipe.planner.generators import splits_backward
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.polish import polish
from lightning_autopipe.planner.pricing import param_state_factor

__all__ = ["fitting_cuts"]


def fitting_cuts(prop: Proposal, costs: BlockCosts, cluster: Cluster, batch: int,
                 optimizer_factor: float) -> list[list[int]]:
    """Cut lists for ``prop``'s devices and step under which every stage fits its devices'
    memory with every stage recomputing (under 1F1B when ``prop``'s schedule splits the
    backward, as a recomputing plan runs): where the walks from ``prop``'s cuts and from the
    memory-balanced cuts end, those that fit, without repeats (none for a proposal of several
    chunks per rank, which do not recompute)."""
    if prop.chunks_per_rank > 1:
        return []
    layout = Layout.from_cluster(cluster, prop.groups)
    schedule = "1f1b" if splits_backward(prop.schedule) else prop.schedule
    step = replace(prop, schedule=schedule).step_shape(batch, optimizer_factor)
    everywhere = [True] * layout.num_stages

    def price(cuts_list: list[list[int]]) -> list[tuple[float, bool]]:
        """(step ms, True) for cuts that fit with recomputation, the step of the plan they
        make (its stages that do not fit recomputing, the others not); (worst overflow ratio
        with every stage recomputing, False) for the others: :func:`~.polish.polish` prefers
        fitting cuts, then the lower figure."""
        plain = evaluate_batch(costs, layout, cuts_list, step, critical_path=False)
        full = evaluate_batch(costs, layout, cuts_list, step, critical_path=False,
                              recompute=everywhere)
        out: list[tuple[float, bool]] = []
        mixed: dict[tuple[bool, ...], list[int]] = {}  # flags -> the cuts that need them
        for k, (e, a) in enumerate(zip(plain, full)):
            over = tuple(p > c for p, c in zip(e.peak_bytes, layout.capacity))
            if not a.fits:
                out.append((max(p / c if c > 0 else math.inf
                                for p, c in zip(a.peak_bytes, layout.capacity)), False))
            elif not any(over) or all(over):
                out.append(((a if any(over) else e).iteration_ms, True))
            else:
                out.append((math.nan, True))
                mixed.setdefault(over, []).append(k)
        for over, idx in mixed.items():  # one replay pass per set of recomputing stages
            for k, e in zip(idx, evaluate_batch(costs, layout, [cuts_list[k] for k in idx], step,
                                                critical_path=False, recompute=over)):
                out[k] = (e.iteration_ms, True)
        return out

    factor = param_state_factor(optimizer_factor)
    held = [p * factor + m for p, m in zip(costs.params, costs.mem)]  # prefix sums
    starts = [prop.cuts]
    if all(c > 0 for c in layout.capacity):
        balanced = balanced_cuts(held, [float(c) for c in layout.capacity])
        if balanced is not None and balanced != prop.cuts:
            starts.append(balanced)
    out: list[list[int]] = []
    for start in starts:
        cuts = polish(start, price).cuts
        (_, fits), = price([cuts])
        if fits and cuts not in out:
            out.append(cuts)
    return out
