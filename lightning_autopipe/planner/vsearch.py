"""The search's choice of several stage chunks per rank: chunk partitions and proposals.

For the best few one-chunk proposals (their rank groups, micro-batches and startup slices),
every chunked schedule the caller allows (``interleaved-1f1b`` with 2 or 3 chunks per rank in
looped placement, ``zbv`` with 2 in V placement) is tried on the same ranks:

1. the model is cut into ``p v`` contiguous chunks so that each rank gets work in proportion
   to its speed, split evenly over its chunks (:func:`chunk_cuts`: the chunks of a slow rank
   get less work, wherever the placement puts them);
2. the fast model for chunks (:func:`~.vcost.evaluate_chunked`) walks those cuts to a local
   optimum (:func:`~.polish.polish`'s moves) and picks the startup and drain slices; a model
   small enough gets every (cut list, slices) choice priced instead, the exact optimum
   (:func:`_every_choice`);
3. the result competes with the one-chunk proposals: those predicted faster go before the
   one-chunk favourite, the others after it, and the simulator judges the finalists as usual
   (:func:`~.search.make_plan`), memory per rank included.

Pinned micro-batches, startup and drain slices are kept (the one-chunk proposals already have
the pinned micro-batches; the slices are not re-chosen). Chunks are not tried on one rank per
replica (no pipeline: a second chunk only adds actions) unless only chunked schedules are
allowed; then too few blocks for ``p v`` chunks is a :class:`~lightning_autopipe.errors.PlanError`.
"""

from __future__ import annotations

import functools
import itertools
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import replace

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.costmodel import Estimate, evaluate
from lightning_autopipe.planner.generators import GENERATORS, SCHEDULES
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.placement import chunk_ranks
from lightning_autopipe.planner.plan import Proposal, StagePlan
from lightning_autopipe.planner.polish import neighbours
from lightning_autopipe.planner.step import StepShape
from lightning_autopipe.planner.vcost import ChunkLayout, evaluate_chunked

__all__ = ["CHUNKED_SCHEDULES", "chunk_cuts", "chunked_proposals", "choice_note",
           "optimistic_ms", "proposal_stages", "one_chunk"]

#: the chunked (schedule, chunks per rank) pairs the search tries when the schedule is allowed
CHUNKED_SCHEDULES = (("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2))
_BASES = 2  # one-chunk proposals (the best first) whose ranks also try chunks
_BUDGET = 600_000  # replayed actions one chunked try may spend walking its cuts
#: replayed actions within which a chunked try prices every (cut list, slices) choice instead
#: of walking (2 ranks x 2 chunks of 19 blocks, 4 micro-batches: 816 cut lists x 4 slice
#: choices, 274 000 actions, about 0.2 s)
_EVERY_BUDGET = 300_000


def one_chunk(schedules: Sequence[str]) -> tuple[str, ...]:
    """The schedules of ``schedules`` that run one chunk per rank (the one-chunk search's;
    1F1B when there are none: the chunked proposals start from its ranks and shapes)."""
    return tuple(s for s in schedules if s in SCHEDULES) or ("1f1b",)


def chunk_cuts(costs: BlockCosts, layout: ChunkLayout) -> list[int]:
    """Contiguous cuts of the model into ``p v`` chunks giving rank ``r`` the share
    ``speed_r / sum(speeds)`` of the compute, split evenly over its chunks (every chunk at
    least one block)."""
    owner, speeds = layout.owner, layout.ranks.speeds
    p, v = layout.ranks.num_stages, layout.chunks_per_rank
    work = costs.compute
    n = costs.num_blocks
    total = sum(speeds)
    targets = [work[-1] * speeds[owner[c]] / (total * v) for c in range(p * v)]
    cuts, acc = [0], 0.0
    for c in range(p * v - 1):
        acc += targets[c]
        lo, hi = cuts[-1] + 1, n - (p * v - 1 - c)  # every chunk keeps at least one block
        near = bisect_left(work, acc)
        cands = [min(max(i, lo), hi) for i in (near - 1, near)]
        cuts.append(min(cands, key=lambda i: abs(work[i] - acc)))
    return [*cuts, n]


def _price(costs, layout, step, cuts_list):
    return [(e.iteration_ms, e.fits)
            for e in (evaluate_chunked(costs, layout, c, step, critical_path=False)
                      for c in cuts_list)]


def _chunked(costs: BlockCosts, cluster: Cluster, base: Proposal, batch: int,
             optimizer_factor: float, schedule: str, v: int,
             pins: Mapping[str, int | None] | None = None) -> tuple[Estimate, Proposal] | None:
    """``base``'s ranks with ``v`` chunks each under ``schedule`` (module docstring); the
    pinned ``startup_slices`` / ``drain_slices`` of ``pins`` are kept."""
    p, m = len(base.groups), base.num_microbatches
    if p * v > costs.num_blocks:
        return None
    pins = pins or {}
    placement = GENERATORS[schedule].placement
    layout = ChunkLayout.from_cluster(cluster, base.groups, v, placement)
    step = replace(base.step_shape(batch, optimizer_factor), schedule=schedule)
    k = step.startup_slices
    size = step.microbatch_size(len(base.groups[0]))
    ks = {pins["startup_slices"]} if pins.get("startup_slices") else {1, k, min(2, size)}
    js = ({pins["drain_slices"]} if pins.get("drain_slices")
          else {1, min(2, size)} if m > 1 else {1})
    steps = [replace(step, startup_slices=kk, drain_slices=j)
             for kk in sorted(ks) for j in sorted(js)]
    actions = 3 * p * v * (m + k + 1)
    every = _every_choice(costs, layout, steps, _EVERY_BUDGET // actions)
    if every is not None:
        cuts, steps = every
    else:
        cuts = _walk(chunk_cuts(costs, layout), functools.partial(
            _price, costs, layout, replace(step, drain_slices=min(js))), _BUDGET // actions)
    best = None
    for st in steps:
        est = evaluate_chunked(costs, layout, cuts, st)
        if best is None or (not est.fits, est.iteration_ms) < (not best[0].fits,
                                                              best[0].iteration_ms):
            best = (est, Proposal([list(g) for g in base.groups], cuts, m, st.startup_slices,
                                  st.drain_slices, schedule, v, placement))
    return best


def _every_choice(costs: BlockCosts, layout: ChunkLayout, steps: list[StepShape],
                  evaluations: int) -> tuple[list[int], list[StepShape]] | None:
    """The fast model's best (cuts, step) over every contiguous cut into the layout's chunks
    and every step of ``steps`` (its exact optimum over them) where that is at most
    ``evaluations`` replays; None where it is more (the walk's turn). The walk from the
    speed-proportional cuts of :func:`chunk_cuts`, with the slices chosen after it, stopped
    up to 18% above this optimum on small models on ranks of two speeds: a better choice
    there moves two or three cuts together, and the best cuts depend on the slices."""
    n, chunks = costs.num_blocks, len(layout.owner)
    if math.comb(n - 1, chunks - 1) * len(steps) > evaluations:
        return None
    cands = [[0, *inner, n] for inner in itertools.combinations(range(1, n), chunks - 1)]
    best: tuple[tuple[bool, float], list[int], StepShape] | None = None
    for st in steps:
        for cuts, (ms, fits) in zip(cands, _price(costs, layout, st, cands)):
            if best is None or (not fits, ms) < best[0]:
                best = ((not fits, ms), cuts, st)
    assert best is not None
    return best[1], [best[2]]


def _walk(cuts: list[int], price, evaluations: int) -> list[int]:
    """:func:`~.polish.polish`'s walk (to the best neighbour while one is faster) within
    ``evaluations`` priced candidates: chunked steps are replayed whole, so long ones get
    few (a sweep that would overrun the budget is not started)."""
    cur = list(cuts)
    (best,) = price([cur])
    left = evaluations
    while True:
        cands = neighbours(cur)
        if not cands or len(cands) > left:
            return cur
        left -= len(cands)
        scores = price(cands)
        i = min(range(len(cands)), key=lambda x: (not scores[x][1], scores[x][0]))
        if (scores[i][1], -scores[i][0]) <= (best[1], -best[0] * (1 - 1e-9)):
            return cur
        cur, best = cands[i], scores[i]


def chunked_proposals(
    props: list[Proposal], costs: BlockCosts, cluster: Cluster, batch: int,
    optimizer_factor: float, schedules: Sequence[str],
    pins: Mapping[str, int | None] | None = None,
) -> list[Proposal]:
    """``props`` (one chunk per rank, the favourite first) with the chunked proposals of the
    module docstring merged in: those the fast model predicts faster than the favourite
    first (fastest first), the rest right after the favourite.

    Raises:
        PlanError: only chunked schedules are allowed and the model has too few blocks for
            their chunks on these ranks.
    """
    tries = [(s, v) for s, v in CHUNKED_SCHEDULES if s in schedules]
    if not tries or not props:
        return props
    only_chunked = not any(s in SCHEDULES for s in schedules)
    top = props[0]
    ref = evaluate(costs, Layout.from_cluster(cluster, top.groups), top.cuts,
                   top.step_shape(batch, optimizer_factor), critical_path=False)
    found = []
    seen = set()
    for base in props[:_BASES]:
        key = (tuple(map(tuple, base.groups)), base.num_microbatches, base.startup_slices)
        if key in seen:
            continue
        seen.add(key)
        if len(base.groups) == 1 and not only_chunked:
            continue  # no pipeline to fill: more chunks would only add actions
        for schedule, v in tries:
            got = _chunked(costs, cluster, base, batch, optimizer_factor, schedule, v, pins)
            if got is not None:
                found.append(got)
    if only_chunked and not found:
        raise _too_few_blocks(tries, min(len(b.groups) for b in props[:_BASES]),
                              costs.num_blocks)
    found.sort(key=lambda x: (not x[0].fits, x[0].iteration_ms))
    better = [p for e, p in found if (not e.fits, e.iteration_ms) < (not ref.fits,
                                                                     ref.iteration_ms)]
    worse = [p for e, p in found if p not in better]
    out = better + props[:1] + worse + props[1:]
    return [p for p in out if p.schedule in schedules] or out


def _too_few_blocks(tries: Sequence[tuple[str, int]], p: int, n: int) -> PlanError:
    names = sorted({s for s, _ in tries})
    v = min(v for _, v in tries)
    return PlanError(
        f"schedule {' / '.join(names)} runs at least {v} stage chunks on each of the {p} "
        f"pipeline ranks ({p * v} chunks), but the model has only {n} blocks; use fewer "
        f"pipeline stages (num_stages <= {max(n // v, 1)}), a model traced at a finer block "
        "granularity (granularity='sub-block'), or a schedule of one stage per rank "
        "('1f1b', 'zb-h1', or 'auto')"
    )


def proposal_stages(prop: Proposal) -> list[StagePlan]:
    """The plan's stages of ``prop``: one per chunk, on the devices of the rank holding it."""
    owner = chunk_ranks(len(prop.groups), prop.chunks_per_rank, prop.placement)
    return [StagePlan((prop.cuts[c], prop.cuts[c + 1]), list(prop.groups[owner[c]]))
            for c in range(len(prop.cuts) - 1)]


def optimistic_ms(prop: Proposal, costs: BlockCosts, cluster: Cluster, batch: int,
                  optimizer_factor: float) -> float:
    """A lower bound of the simulator's step for ``prop`` (fastest replicas, free queues)."""
    step = prop.step_shape(batch, optimizer_factor)
    if prop.chunks_per_rank == 1:
        return evaluate(costs, Layout.from_cluster(cluster, prop.groups, optimistic=True),
                        prop.cuts, step, critical_path=False, exact=True).iteration_ms
    layout = ChunkLayout.from_cluster(cluster, prop.groups, prop.chunks_per_rank,
                                      prop.placement, optimistic=True)
    return evaluate_chunked(costs, layout, prop.cuts, step, critical_path=False).iteration_ms



def choice_note(best, plans: Sequence, props: Sequence[Proposal], bound,
                simulated: Sequence = ()) -> list[str]:
    """Why the chosen plan has the chunks it has: its predicted step against the best
    simulated plan of the other kind (one chunk per rank, or several). When the search
    simulated none (no such proposal's lower bound could win), the note gives the best lower
    bound of that kind (``bound``: :func:`optimistic_ms` of a proposal) rather than simulating
    one: at scale a simulation takes seconds, several times the search, for a note; when
    that kind was simulated (``simulated``) but does not fit memory, the note says so. Nothing
    when no proposal of the other kind exists."""
    def other(p) -> bool:
        return (p.chunks_per_rank > 1) != (best.chunks_per_rank > 1)

    def name(p) -> str:
        return (f"{p.schedule} with {p.chunks_per_rank} chunks per rank" if p.chunks_per_rank
                > 1 else f"{p.schedule} with one stage per rank")

    kind = "one stage per rank" if best.chunks_per_rank > 1 else "several chunks per rank"
    others = [p for p in plans if other(p)]
    if others:
        alt = min(others, key=lambda p: p.iteration_ms)
        return [f"chose {name(best)}: predicted {best.iteration_ms:.1f} ms against "
                f"{alt.iteration_ms:.1f} ms for the best {name(alt)}"]
    if any(other(p) for p in simulated):  # simulated, but none fits device memory
        return [f"chose {name(best)}: predicted {best.iteration_ms:.1f} ms; no plan with {kind} "
                "that the search simulated fits device memory"]
    rest = [bound(p) for p in props if other(p)]
    if not rest:
        return []
    return [f"chose {name(best)}: predicted {best.iteration_ms:.1f} ms; no plan with {kind} "
            f"can beat {min(rest):.1f} ms (the fast model's lower bound, not simulated)"]
