"""AutoPipe's search for one planner call: shapes, placements, partitions and slices.

Levels 1-3 of :func:`~.search.make_plan` for ``planner="autopipe"``, each more exact and
applied to fewer candidates:

1. every (stages ``S``, replicas ``R``, micro-batches ``m``) allowed by the pins, the devices and
   the batch is scored by a closed form on the fastest ``S x R`` devices
   (:func:`~.shapes.score_shapes`); a rough memory check marks shapes that cannot fit;
2. the best eight (at most two micro-batch counts per ``S x R``) are placed: every candidate
   layout of :func:`~.mapping.rank_layouts` is scored by the fast model's replay with its
   balanced partition;
3. the best (shape, layout) pairs, three or more while the replay budget lasts, get the AutoPipe
   partitioner and the startup slicer (:func:`~.partition.partition_and_slice`), and the
   finalists the drain slicer.

The result is a ranked list of :class:`~.plan.Proposal` for the simulator to judge (level 4,
in :mod:`~.search`). The yardstick planners borrow the shape of the first one.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.mapping import rank_layouts
from lightning_autopipe.planner.partition import (
    autopipe_partition,
    choose_drain_slices,
    choose_startup_slices,
    partition_and_slice,
)
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.shapes import Shape, microbatch_choices, score_shapes
from lightning_autopipe.planner.step import StepShape

__all__ = ["autopipe_proposals", "microbatch_choices"]  # the latter from .shapes

_REPLAY_BUDGET = 100_000  # replayed actions per shape the AutoPipe partitioner may spend
_LEVEL2, _LEVEL3 = 8, 3  # shapes placed by the mapper / refined by the partitioner
_LEVEL3_BUDGET = 400_000  # replayed actions (upper bound) for refining more than three
_FINALISTS = 8  # proposals the simulator may choose among
_RESCHEDULED = 3  # finalists (the best first) also partitioned for each other schedule
_RESCHEDULE_EVALUATIONS = (60, 20, 20)  # evaluations re-partitioning each of them per schedule


def _replay_cost(stages: int, m: int, k: int) -> int:
    """Actions one fast-model evaluation replays (long steps are extrapolated, two replays)."""
    m0 = 2 * stages + 6
    return 2 * stages * (m + k) if m <= m0 else 4 * stages * (m0 + stages + k)


def autopipe_proposals(
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    pins: dict,
    use_all: bool,
    max_slices: int,
    optimizer_factor: float,
    schedules: tuple[str, ...] = ("1f1b",),
) -> list[Proposal]:
    """Levels 1-3 (module docstring): the ranked proposals, the favourite first.

    Shapes, placements and partitions are searched under 1F1B; the best finalists are then also
    partitioned again and sliced under every other schedule of ``schedules`` (ZB-H1 moves the
    critical path: its input gradients cross stages sooner, its weight gradients fill idle
    slots, and it holds activations longer), starting from the 1F1B cuts, and all compete.
    Each finalist is followed by its twin without drain slices and the favourite's unsliced
    twin is appended: link contention the fast model ignores can make the extra messages cost
    more than they save, and the simulator decides.

    Raises:
        PlanError: no shape uses all devices when ``use_all`` is set.
    """
    shapes = score_shapes(costs, cluster, devs, batch, pins, use_all, optimizer_factor,
                          max_slices)
    if not shapes:
        raise PlanError(_no_shape(pins, use_all, len(devs), batch))
    if any(sh.fits for sh in shapes):
        shapes.sort(key=lambda x: (not x.fits, x.score))
    else:  # the rough check (an even split against the smallest memory) refused them all:
        # mixed memories may still fit uneven stages, so the shapes nearest to fitting go on
        shapes.sort(key=lambda x: (x.overflow, x.score))
    k_pin = pins["startup_slices"]
    picked: list[Shape] = []
    per_shape: dict[tuple[int, int], int] = {}
    for sh in shapes:  # the best few, at most two micro-batch counts per (stages, replicas)
        key = (sh.stages, sh.replicas)
        if per_shape.get(key, 0) < 2:
            per_shape[key] = per_shape.get(key, 0) + 1
            picked.append(sh)
            if len(picked) == _LEVEL2:
                break
    level2 = []
    for sh in picked:
        step = StepShape(batch, sh.microbatches, k_pin or 1, optimizer_factor=optimizer_factor)
        ranked = rank_layouts(costs, cluster, devs, sh.stages, sh.replicas, step)
        level2 += [(mr, sh, step) for mr in ranked]
    level2.sort(key=lambda x: (not x[0].estimate.fits, x[0].estimate.iteration_ms))
    level3 = []
    spent = 0
    for n, (mr, sh, step) in enumerate(level2):
        m = sh.microbatches
        cost = _replay_cost(sh.stages, m, max_slices)
        budget = max(20, min(400, _REPLAY_BUDGET // cost))
        if n >= _LEVEL3 and spent + budget * cost > _LEVEL3_BUDGET:
            break  # beyond the best three, refine more layouts only while it is cheap
        spent += budget * cost
        groups = [list(g) for g in mr.layout.groups]
        for cuts, k, est in partition_and_slice(costs, mr.layout, step, max_slices,
                                                pin_startup=bool(k_pin), max_evaluations=budget):
            level3.append((est, Proposal(groups, cuts, m, k), mr.layout))
    level3.sort(key=lambda x: (not x[0].fits, x[0].iteration_ms))
    # Drain slices for the finalists only: the tail they shorten is the same for close
    # candidates, so choosing j earlier would multiply the partitioner's work for no change.
    # Each finalist also goes to the simulator without them (right after it), since link
    # contention the fast model ignores can make the extra messages cost more than they save.
    j_pin = pins.get("drain_slices")
    scored = []
    for rank, (est, prop, layout) in enumerate(level3[:_FINALISTS]):
        for schedule in schedules:
            if schedule != "1f1b" and rank >= _RESCHEDULED:
                continue
            cand = prop
            if schedule != "1f1b":
                under = replace(prop.step_shape(batch, optimizer_factor), schedule=schedule)
                cand = _reschedule(costs, layout, prop, under, bool(k_pin), max_slices,
                                   _RESCHEDULE_EVALUATIONS[rank])
            step = cand.step_shape(batch, optimizer_factor)
            j, est_j = j_pin or 1, est
            if not j_pin:
                j, est_j = choose_drain_slices(costs, layout, cand.cuts, step, max_slices)
            elif schedule != "1f1b":
                est_j = evaluate(costs, layout, cand.cuts, replace(step, drain_slices=j),
                                 critical_path=False)
            first = replace(cand, drain_slices=j, schedule=schedule)
            twin = replace(cand, drain_slices=1, schedule=schedule)
            scored.append((est_j, [first] + ([twin] if j != 1 and not j_pin else [])))
    scored.sort(key=lambda x: (not x[0].fits, x[0].iteration_ms))
    finalists = [p for _, props in scored for p in props]
    top = finalists[0]
    plain = (k_pin or 1, j_pin or 1)  # the favourite unsliced, for the same reason
    if (top.startup_slices, top.drain_slices) != plain:
        finalists.append(replace(top, startup_slices=plain[0], drain_slices=plain[1]))
    return finalists


def _reschedule(
    costs: BlockCosts, layout: Layout, prop: Proposal, step: StepShape, pin_startup: bool,
    max_slices: int, evaluations: int,
) -> Proposal:
    """``prop`` partitioned again (from its cuts) under ``step`` (another schedule) and, unless
    ``pin_startup``, sliced again."""
    part = autopipe_partition(costs, layout, step, max_evaluations=evaluations, start=prop.cuts)
    k = step.startup_slices
    if not pin_startup:
        k, _ = choose_startup_slices(costs, layout, part.cuts, step, max_slices)
    return Proposal(prop.groups, part.cuts, step.num_microbatches, k, 1, step.schedule)


def _no_shape(pins: dict, use_all: bool, devices: int, batch: int) -> str:
    """Why no (stages, replicas, micro-batches) shape is left, naming the pins that exclude
    every one (shapes.stage_replica_pairs, shapes._terms)."""
    slices = {k: pins[k] for k in ("startup_slices", "drain_slices") if pins[k]}
    pinned = ", ".join(f"{k}={v}" for k, v in {**{k: pins[k] for k in (
        "num_stages", "replicas", "num_microbatches")}, **slices}.items() if v)
    if slices:
        return (
            f"no shape gives every micro-batch of a replica at least {max(slices.values())} "
            f"samples for {pinned} with global batch {batch} on {devices} devices: each slice "
            "needs a sample; lower the pinned slices or num_microbatches, or raise the batch"
        )
    if use_all:
        return (
            f"no (stages x replicas) shape uses all {devices} devices with global batch "
            f"{batch}{' and ' + pinned if pinned else ''}; pick a device count with more "
            "divisors, other pins, or drop use_all_devices"
        )
    return (f"no (stages x replicas) shape fits {devices} devices with global batch {batch}"
            f"{' and ' + pinned if pinned else ''}; change the pins")
