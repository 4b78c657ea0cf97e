"""The AutoPipe partitioner: balanced cuts, then moves at the critical stage, then startup slices.

1. :func:`~.balance.balanced_cuts` — the min-max contiguous partition of per-block forward +
   backward time over stages of different speeds (a stage's time is its blocks' time over its
   speed), subject to each stage's memory: binary search on the bottleneck value with a greedy
   feasibility check, ``O(S log N)`` per check (plus an exact check where speeds differ a lot).
2. :func:`autopipe_partition` — the balanced partition minimises the heaviest stage, but a 1F1B
   step is not only its heaviest stage: the warm-up forwards before the critical stage, its
   steady 1F1B phase, the cool-down backwards after it, link delays at each cut and the
   gradient all-reduce at the end all lie on the critical path. The critical stage is found by
   backtracking that path in the replayed timeline (:func:`~.costmodel.evaluate`), then its front
   boundary block moves to the previous stage (prefix re-balanced) or its back boundary block to
   the next stage (suffix re-balanced); a move is kept only if the predicted step gets shorter,
   and a visited set stops cycles. A final pass moves single cuts to nearby positions, which is
   where the activation size at each cut (communication) decides between equally balanced
   cuts, and where fill and drain (few micro-batches) favour a short first or last stage.
   Besides the balanced start, two tilted starts (early or late stages given a quarter more
   work) are descended the same way, since with few micro-batches the optimum can lie far
   from balance.
3. :func:`choose_startup_slices` — the ``k`` in ``1..max_slices`` that minimises the predicted
   step (1 = no slicing): slicing micro-batch 0 fills the pipeline sooner but adds per-action
   overhead and message latency, so on shallow pipelines it does not pay.
4. :func:`choose_drain_slices` — the same for the last micro-batch (``j``), given ``k``: the
   cool-down's tail (the first stage's last backward after the last stage is done) shrinks
   about ``j``-fold for the same per-action price.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.balance import StageLimits, balanced_cuts
from lightning_autopipe.planner.bound import bound_batch
from lightning_autopipe.planner.compiled import inflight, inflight_pairs
from lightning_autopipe.planner.costmodel import Estimate, evaluate, evaluate_batch
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.scorer import Scorer
from lightning_autopipe.planner.slicer import better, choose_drain_slices, choose_startup_slices
from lightning_autopipe.planner.step import StepShape

__all__ = [
    "balanced_cuts",
    "StageLimits",
    "stage_limits",
    "autopipe_partition",
    "choose_startup_slices",
    "choose_drain_slices",
    "partition_and_slice",
    "PartitionResult",
    "step_budget",
]

_ALTERNATIVES = 2  # runner-up cut lists handed on, for the simulator to judge
_SHIFT_BATCH = 8  # chain shifts priced together (the first better one is taken)


def stage_limits(costs: BlockCosts, layout: Layout, step: StepShape) -> StageLimits:
    """The memory limits the cost model applies to ``layout`` under ``step``."""
    num, m = layout.num_stages, step.num_microbatches
    mb = max(1, step.microbatch_size(max(layout.replicas)))
    held = inflight(step.schedule, num, m, step.startup_slices, mb, step.drain_slices)
    scale = [step.batch / (m * layout.replicas[s] * costs.micro_batch_size) for s in range(num)]
    act = [held[s] * scale[s] for s in range(num)]
    pairs = []
    if costs.loss:  # what the loss saves is held by fewer units under a split backward
        counts = inflight_pairs(step.schedule, num, m, step.startup_slices, mb,
                                step.drain_slices)
        pairs = [[(a * scale[s], b * scale[s]) for a, b in counts[s]] for s in range(num)]
    return StageLimits(costs.params, costs.mem, step.optimizer_factor, act, layout.capacity,
                       costs.shared, scale, m, costs.loss, pairs, costs.ties)


@dataclass
class PartitionResult:
    """The partitioner's answer and how it got there."""

    cuts: list[int]
    estimate: Estimate
    balanced_cuts: list[int]
    balanced_ms: float
    evaluations: int
    alternatives: list[tuple[list[int], Estimate]]  # the next best distinct cuts seen
    steps: int = 0  # descent passes and nudge sweeps taken (see :func:`step_budget`)
    replays: int = 0  # evaluations replayed; the others were bounded (:mod:`~.bound`)


def step_budget(max_evaluations: int) -> int:
    """Most descent passes and nudge sweeps one :func:`autopipe_partition` call may take.

    Every pass either evaluates a cut list not seen before (at most ``max_evaluations`` plus the
    four a pass may add past the limit) or moves to a strictly better one already seen (a
    strictly decreasing walk over the seen lists, so at most as many moves as lists), or ends
    its descent; three descents (balanced and two tilted starts) each end once in ``descend``
    and once in ``_nudge``. The loops also stop when the count reaches this bound, so the
    partitioner ends after a number of steps fixed by its budget whatever the inputs.
    """
    return 2 * (max_evaluations + 4) + 6


def autopipe_partition(
    costs: BlockCosts,
    layout: Layout,
    step: StepShape,
    *,
    max_evaluations: int = 400,
    start: list[int] | None = None,
) -> PartitionResult:
    """Balanced cuts improved by AutoPipe's critical-stage moves (see the module docstring),
    every candidate priced under ``step``.

    Raises:
        PlanError: fewer blocks than stages.
    """
    num, n = layout.num_stages, costs.num_blocks
    if num > n:
        raise PlanError(
            f"cannot split {n} blocks into {num} stages; use at most {n} stages "
            "(or profile the model at a finer block granularity)"
        )
    work = costs.compute
    limits = stage_limits(costs, layout, step)
    speeds = layout.speeds
    typed = costs.stage_work(layout)  # None unless some stage has its own device profile
    base = start or balanced_cuts(work, speeds, limits=limits, stage_work=typed)
    if base is None:  # nothing fits memory: balance time alone and let the caller report it
        base = balanced_cuts(work, speeds, stage_work=typed)
    assert base is not None

    score = Scorer(
        lambda c: evaluate(costs, layout, c, step),
        step_budget(max_evaluations),
        lambda cs: evaluate_batch(costs, layout, cs, step),
        lambda cs: bound_batch(costs, layout, cs, step),
    )

    def rebalance(lo: int, hi: int, first: int, count: int) -> list[int] | None:
        sp = speeds[first : first + count]
        sw = typed[first : first + count] if typed is not None else None
        got = balanced_cuts(work, sp, lo, hi, limits=limits, first_stage=first, stage_work=sw)
        return got if got is not None else balanced_cuts(work, sp, lo, hi, stage_work=sw)

    def descend(cur: list[int], limit: int) -> tuple[list[int], Estimate]:
        best = score(cur)
        while len(score.cache) < limit and score.step():
            order = sorted(range(num), key=lambda s: -best.critical_share[s])
            moved = False
            for c in order[:2]:  # the critical stage, then the runner-up
                cands = []
                if cur[c + 1] - cur[c] >= 2 and c > 0:
                    pre = rebalance(0, cur[c] + 1, 0, c)
                    if pre is not None:
                        cands.append(pre + cur[c + 1 :])
                if cur[c + 1] - cur[c] >= 2 and c < num - 1:
                    suf = rebalance(cur[c + 1] - 1, n, c + 1, num - c - 1)
                    if suf is not None:
                        cands.append(cur[: c + 1] + suf)
                for cand in cands:
                    e = score.unless_worse(cand, best)  # memoised; None: bounded, not better
                    if e is not None and better(e, best):
                        cur, best, moved = cand, e, True
                if moved:
                    break
            if not moved:
                break
        return _nudge(cur, best, score, n, limit)

    base_ms = score(base).iteration_ms
    cur, best = descend(list(base), max_evaluations // 2 if start is None else max_evaluations)
    if start is None and num > 1:
        # two more starts, balanced with the early (late) stages allowed a quarter more work:
        # with few micro-batches fill and drain favour uneven stages, far from the balanced cuts
        for tilt in (0.25, -0.25):
            sp = [v * (1 + tilt * (1 - 2 * s / (num - 1))) for s, v in enumerate(speeds)]
            alt = balanced_cuts(work, sp, limits=limits, stage_work=typed) or balanced_cuts(
                work, sp, stage_work=typed)
            if alt is None or tuple(alt) in score.cache:
                continue
            limit = len(score.cache) + max(10, max_evaluations // 4)
            c2, b2 = descend(list(alt), min(limit, max_evaluations))
            if better(b2, best):
                cur, best = c2, b2
    alts = score.runners_up(cur, _ALTERNATIVES)
    return PartitionResult(cur, best, list(base), base_ms, len(score.cache), alts, score.steps,
                           score.replays)


def _nudge(
    cur: list[int], best: Estimate, score: Scorer, n: int, budget: int
) -> tuple[list[int], Estimate]:
    """Move single cuts within their neighbours' range while the step gets shorter.

    Each sweep tries, for every cut, the positions up to ``w`` blocks away (``w`` as large as
    the remaining evaluation budget allows, so small problems get every position), then
    prefix / suffix chain shifts; improvements are kept. Stops when a sweep improves nothing.
    """
    improved = True
    while improved and len(score.cache) < budget and score.step():
        improved = False
        left = budget - len(score.cache)
        w = max(1, left // max(1, 2 * (len(cur) - 2)))
        for p in range(1, len(cur) - 1):
            lo, hi = max(cur[p - 1] + 1, cur[p] - w), min(cur[p + 1] - 1, cur[p] + w)
            # every candidate of this cut differs from ``cur`` at ``p`` only, whichever is
            # taken: price them together
            cands = [cur[:p] + [c] + cur[p + 1 :]
                     for c in sorted(range(lo, hi + 1), key=lambda x: abs(x - cur[p]))
                     if c != cur[p]]
            score.prefetch(cands, budget - len(score.cache), best)
            for cand in cands:
                e = score.unless_worse(cand, best)
                if e is not None and better(e, best):
                    cur, best, improved = cand, e, True
                if len(score.cache) >= budget:
                    return cur, best
        if improved:
            continue
        shifts = _chain_shifts(cur)
        for q, cand in enumerate(shifts):
            if q % _SHIFT_BATCH == 0:  # the walk stops at the first improvement: a few at once
                score.prefetch(shifts[q : q + _SHIFT_BATCH], budget - len(score.cache), best)
            e = score.unless_worse(cand, best)
            if e is not None and better(e, best):
                cur, best, improved = cand, e, True
                break
            if len(score.cache) >= budget:
                return cur, best
    return cur, best


def _chain_shifts(cuts: list[int]) -> list[list[int]]:
    """Every prefix or suffix of the inner cuts shifted by one block, where still valid.

    One block then travels through several stages at once (e.g. every early stage gives one
    block to its successor): the move single-cut changes cannot make when each intermediate
    step is worse, as when few micro-batches make the fill and drain dominate.
    """
    n = len(cuts) - 1
    out = []
    for d in (-1, 1):
        for p in range(1, n):
            for lo, hi in ((p, n - 1), (1, p)):
                cand = list(cuts)
                for q in range(lo, hi + 1):
                    cand[q] += d
                if all(cand[q] < cand[q + 1] for q in range(n)) and cand != cuts:
                    out.append(cand)
    return out


def partition_and_slice(
    costs: BlockCosts,
    layout: Layout,
    step: StepShape,
    max_slices: int = 8,
    *,
    pin_startup: bool = False,
    max_evaluations: int = 400,
) -> list[tuple[list[int], int, Estimate]]:
    """AutoPipe's partition and slice count together under ``step`` (``pin_startup`` keeps its
    ``startup_slices``; else ``k`` is chosen).

    The best cuts depend on ``k``: slices shorten the warm-up, which moves the critical path,
    and a partition that is a local optimum for plain 1F1B can be one slicing does not help.
    So the partitioner runs under ``k = 1`` and under the powers of two up to the largest
    allowed ``k``; each result gets the slicer's ``k``, and when that differs from the one it
    was partitioned under, the partition is improved again under it.

    Returns:
        Candidates ``(cuts, k, estimate)``, best first, which the caller may score with the
        simulator (link contention the fast model ignores can reorder close ones).
    """
    if pin_startup:
        k = step.startup_slices
        part = autopipe_partition(costs, layout, step, max_evaluations=max_evaluations)
        return [(part.cuts, k, part.estimate)] + [(c, k, e) for c, e in part.alternatives]
    top = max(1, min(max_slices, step.microbatch_size(max(layout.replicas))))
    ks = sorted({1, top} | {2**i for i in range(1, 4) if 2**i < top})
    budget = max(10, max_evaluations // len(ks))
    out: dict[tuple[tuple[int, ...], int], Estimate] = {}
    for k0 in ks:
        part = autopipe_partition(costs, layout, replace(step, startup_slices=k0),
                                  max_evaluations=budget)
        out[(tuple(part.cuts), k0)] = part.estimate
        for alt, est in part.alternatives:
            out.setdefault((tuple(alt), k0), est)
        k, est = choose_startup_slices(costs, layout, part.cuts, step, max_slices)
        out[(tuple(part.cuts), k)] = est
        if k != k0:
            again = autopipe_partition(costs, layout, replace(step, startup_slices=k),
                                       max_evaluations=budget, start=part.cuts)
            out[(tuple(again.cuts), k)] = again.estimate
    ranked = sorted(out.items(), key=lambda kv: (not kv[1].fits, kv[1].iteration_ms))
    return [(list(c), k, e) for (c, k), e in ranked]
