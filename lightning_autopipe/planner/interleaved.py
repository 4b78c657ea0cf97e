"""Interleaved 1F1B: ``v`` stage chunks per rank in looped placement, with startup and drain
slices.

Each rank holds chunks ``r, r + p, ..., r + (v-1) p`` (:mod:`~.placement`, ``"looped"``): a
micro-batch loops through the ranks ``v`` times, so the pipeline fills after ``p - 1``
chunk-forwards of ``1/v`` of a stage and fill and drain shrink by about ``v`` (Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters", SC 2021). The order is
Megatron's: micro-batches go in rounds of ``p``; within a round a rank forwards its chunks in
model order (all units of the round on its first chunk, then on its second, ...) and runs the
backwards of the round's units on its chunks in reverse model order.

Warm-up is counted in samples as in :func:`~.schedule.one_f_one_b`: before rank ``r`` runs
the backward of the ``i``-th item of its backward order, it has forwarded every item of its
forward order that starts before that backward item's end plus ``((v - 1) p + p - 1 - r)``
micro-batches (positions summed over its chunks; a slice counts its share). With ``v = 1``
this is exactly :func:`~.schedule.one_f_one_b`; activations in flight on a rank stay within
``(v - 1) p + p - r`` chunk micro-batches.

2 ranks, v = 2, m = 4, forward 1 and backward 2 ticks per chunk micro-batch, free transfers
(:func:`~.ascii.ascii_timeline`: digits forwards, letters backwards; a rank's second chunk
continues its backwards with ``#``)::

    rank 0 |0101..a#2b#3a=2b=3c#.d#c=d=
    rank 1 |.010a#1b#2a=3b=2c#3d#c=d=
"""

from __future__ import annotations

from itertools import accumulate

from lightning_autopipe.planner.schedule import Action, Kind, Schedule, check_shape, spans

__all__ = ["interleaved_1f1b", "rounds"]


def rounds(order: list[tuple[int, int, int, int]], num_ranks: int) -> list[list[tuple]]:
    """The units of ``spans`` grouped in rounds of ``num_ranks`` micro-batches."""
    out: list[list[tuple]] = []
    for unit in order:
        g = unit[0] // num_ranks
        if g == len(out):
            out.append([])
        out[g].append(unit)
    return out


def interleaved_1f1b(
    num_ranks: int,
    num_microbatches: int,
    startup_slices: int = 1,
    drain_slices: int = 1,
    chunks_per_rank: int = 2,
) -> Schedule:
    """Interleaved 1F1B (module docstring) as a compute-only schedule keyed by rank.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: micro-batches ``m`` per replica and step.
        startup_slices: slices ``k`` of micro-batch 0 (1 = off).
        drain_slices: slices ``j`` of the last micro-batch when ``m >= 2`` (1 = off).
        chunks_per_rank: chunks ``v`` per rank (looped placement).

    Returns:
        ``F``/``B`` actions naming the chunk (``Action.stage`` in ``0..p v - 1``).
    """
    check_shape(num_ranks, num_microbatches, startup_slices, drain_slices)
    check_shape(chunks_per_rank, 1, 1)
    p, v = num_ranks, chunks_per_rank
    order, scale = spans(num_microbatches, startup_slices, drain_slices)
    groups = rounds(order, p)
    out: Schedule = {}
    for r in range(p):
        fwd = [(lap * p + r, u) for g in groups for lap in range(v) for u in g]
        bwd = [(lap * p + r, u) for g in groups for lap in reversed(range(v)) for u in g]
        starts = list(accumulate((u[3] - u[2] for _, u in fwd), initial=0))
        ends = list(accumulate(u[3] - u[2] for _, u in bwd))
        lead = ((v - 1) * p + p - 1 - r) * scale
        acts: list[Action] = []
        nxt = 0
        for (c, u), end in zip(bwd, ends):
            while nxt < len(fwd) and starts[nxt] < end + lead:
                fc, fu = fwd[nxt]
                acts.append(Action(fc, Kind.FORWARD, fu[0], fu[1]))
                nxt += 1
            acts.append(Action(c, Kind.BACKWARD, u[0], u[1]))
        out[r] = acts
    return out
