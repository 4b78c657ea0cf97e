"""Zero-bubble ZB-H1 with split startup and drain micro-batches: backward split into B and W.

Zero-bubble pipelining (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) splits each
backward into ``B``, the gradient with respect to the stage's inputs, which the previous stage
waits for, and ``W``, the gradient with respect to the stage's weights, which nobody waits for.
A stage sends its input gradient as soon as ``B`` is done, so gradients cross the pipeline at
``B`` speed, and each ``W`` moves into a slot where the stage would otherwise wait.

:func:`zb_h1` keeps 1F1B's order of forwards and input backwards, with the same warm-up depth
counted in samples (:func:`~.schedule.one_f_one_b`: micro-batch 0 in ``k`` startup slices and
the last one in ``j`` drain slices), and places the weight backwards by replaying the step on a
balanced pipeline with free transfers, every unit taking its share of one tick per sample
position for F, B and W alike (the paper's analysis, in which ZB-H1 removes two thirds of
1F1B's bubble):

* a stage whose next F or B cannot start yet (its input or gradient has not arrived) runs its
  oldest pending W instead;
* before a forward that would hold more activation memory than 1F1B holds at that point of the
  step, pending W's run first (a unit's activations are held until its W, not its B), so the
  memory in flight never exceeds 1F1B's;
* after the last B, the remaining W's run in order.

Every W follows its own B on the same stage. The result depends only on the shape (stages,
micro-batches, slices), so the simulator and the runtime replay the same lists.

4 stages, m = 4, one tick per F, B and W of a micro-batch (``ascii_timeline``: digits forward,
lower-case letters B, upper-case W; ``.`` idle), 1F1B with its backward taking B + W for
comparison::

    ZB-H1   stage 0 |0123...a.Ab.BcCdD
            stage 1 |.012..aAb.BcCdD
            stage 2 |..01.aA2bB3cCdD
            stage 3 |...0aA1bB2cC3dD

    1F1B    stage 0 |0123......a=.b=.c=d=
            stage 1 |.012....a=3b=.c=d=
            stage 2 |..01..a=2b=3c=d=
            stage 3 |...0a=1b=2c=3d=
"""

from __future__ import annotations

import heapq

from lightning_autopipe.planner.schedule import (
    Action,
    Kind,
    Schedule,
    check_shape,
    one_f_one_b,
    spans,
)

__all__ = ["zb_h1"]


def zb_h1(
    num_stages: int, num_microbatches: int, startup_slices: int = 1, drain_slices: int = 1
) -> Schedule:
    """ZB-H1 (module docstring): 1F1B's F/B order, each W where the stage would wait.

    Args:
        num_stages: pipeline depth ``S``.
        num_microbatches: micro-batches ``m`` per replica and step.
        startup_slices: slices ``k`` of micro-batch 0 (1 = off).
        drain_slices: slices ``j`` of the last micro-batch when ``m >= 2`` (1 = off).

    Returns:
        A compute-only schedule with ``F``, ``B`` (input gradient) and ``W`` (weight gradient)
        of every unit on every stage.
    """
    check_shape(num_stages, num_microbatches, startup_slices, drain_slices)
    order, _ = spans(num_microbatches, startup_slices, drain_slices)
    width = {(mb, sl): end - start for mb, sl, start, end in order}  # ticks of each unit
    base = one_f_one_b(num_stages, num_microbatches, startup_slices, drain_slices)
    # 1F1B's deepest stage (the first) holds S micro-batches; every stage may hold as many
    bound = [max(_peak(base[s], width) for s in range(num_stages))] * num_stages
    out: Schedule = {s: [] for s in range(num_stages)}
    ptr = [0] * num_stages
    pending: list[list[tuple[int, int]]] = [[] for _ in range(num_stages)]
    held = [0] * num_stages
    free = [0] * num_stages
    done: dict[tuple[int, Kind, tuple[int, int]], int] = {}
    ready = [(0, s) for s in range(num_stages)]  # (time the stage is free, stage)
    waiting: dict[tuple[int, Kind, tuple[int, int]], list[int]] = {}
    while ready:
        t, s = heapq.heappop(ready)
        acts = base[s]
        nxt = acts[ptr[s]] if ptr[s] < len(acts) else None
        if nxt is None and not pending[s]:
            continue
        step: tuple[Kind, tuple[int, int]] | None = None
        if nxt is not None:
            dep = _dependency(nxt, num_stages)
            arrived = dep is None or done.get(dep, -1) >= 0
            start = max(t, done[dep]) if dep is not None and arrived else t
            over = nxt.kind is Kind.FORWARD and held[s] + width[nxt.unit] > bound[s]
            if over and pending[s]:  # keep 1F1B's memory: finish a unit before taking one
                step = (Kind.WEIGHT, pending[s].pop(0))
            elif arrived and start <= t:
                step = (nxt.kind, nxt.unit)
                ptr[s] += 1
            elif pending[s]:  # it would wait: do a deferred W instead
                step = (Kind.WEIGHT, pending[s].pop(0))
            elif arrived:  # nothing to fill the wait with: idle until the input arrives
                heapq.heappush(ready, (start, s))
                continue
            else:  # its input is not even started: wake up when it is done
                waiting.setdefault(dep, []).append(s)
                continue
        else:
            step = (Kind.WEIGHT, pending[s].pop(0))
        kind, unit = step
        end = t + width[unit]
        out[s].append(Action(s, kind, unit[0], unit[1]))
        if kind is Kind.FORWARD:
            held[s] += width[unit]
        elif kind is Kind.BACKWARD:
            pending[s].append(unit)
        else:
            held[s] -= width[unit]
        key = (s, kind, unit)
        done[key] = end
        free[s] = end
        for other in waiting.pop(key, []):
            heapq.heappush(ready, (max(end, free[other]), other))
        heapq.heappush(ready, (end, s))
    return out


def _dependency(a: Action, num_stages: int) -> tuple[int, Kind, tuple[int, int]] | None:
    """The action of a neighbour stage that ``a`` waits for (None on the pipeline's ends)."""
    if a.kind is Kind.FORWARD:
        return None if a.stage == 0 else (a.stage - 1, Kind.FORWARD, a.unit)
    return None if a.stage == num_stages - 1 else (a.stage + 1, Kind.BACKWARD, a.unit)


def _peak(actions: list[Action], width: dict[tuple[int, int], int]) -> int:
    """Most activation ticks a stage holds under a (1F1B) list: F takes, B gives back."""
    cur = peak = 0
    for a in actions:
        cur += width[a.unit] if a.kind is Kind.FORWARD else -width[a.unit]
        peak = max(peak, cur)
    return peak
