"""The fast model's scalar replay: one pass over a compiled schedule, one candidate.

:func:`replay` is the recurrence of :mod:`~.costmodel` (an action starts when its stage's
previous action has ended and its input has arrived, and lasts its unit's share of the
stage's time) on plain floats. Per compiled schedule every action is reduced once to four
indices (its stage's previous action, its sender, the slot of its duration among the
candidate's few distinct ones, its link): a replay then reads two duration tables built per
candidate instead of looking the stage, kind and unit fraction up per action, a quarter less
CPU time on the partitioner's replays for the same float operations in the same order (the
estimates are equal to the bit; a test keeps the former loop as the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_autopipe.planner.compiled import B, Compiled

__all__ = ["replay"]


def _flat(comp: Compiled) -> tuple[tuple[tuple[int, int, int, int, int, int], ...], tuple]:
    """Per action (index, previous, sender, duration slot, transfer slot, link slot) and the
    distinct unit fractions, cached beside the compiled schedule."""
    got = comp.__dict__.get("_flat")
    if got is None:
        num = len(comp.last)
        fr = tuple(sorted(set(comp.fracs)))
        slot = {f: i for i, f in enumerate(fr)}
        nf = len(fr)
        ops = []
        for n, (s, code, u, prev, cross) in enumerate(comp.order):
            f = slot[comp.fracs[u]]
            if cross >= 0:
                is_b = code == B
                c = s if is_b else s - 1
                ops.append((n, prev, cross, (code * num + s) * nf + f, c * nf + f, 2 * c + is_b))
            else:
                ops.append((n, prev, -1, (code * num + s) * nf + f, -1, -1))
        got = comp.__dict__["_flat"] = (tuple(ops), fr)
    return got


def replay(
    comp: Compiled,
    var: list[list[float]],
    per_call: list[list[float]],
    cut_ms: list[float],
    lat: tuple[float, ...],
    ar: list[float],
    queue: bool = True,
    *,
    record: list[float] | None = None,
    resume: tuple | None = None,
) -> tuple[list[float], list[float], list[bool]]:
    """Finish time per stage (all-reduce included), end time and start cause per action.

    ``record`` (one slot per action) receives when each queued transfer leaves its link;
    ``resume`` = (ends, actions still to run, each cut's link free time per direction) starts
    from a state where the other actions have run (:class:`~.extrapolate.Tail`).

    With ``queue`` each cut's link carries one transfer per direction at a time, in the
    sender's order (startup slices leave back to back and would otherwise overtake each
    other's bandwidth); without it transfers are independent delays (a lower bound). Not
    modelled (the simulator has them): a stage's activations and gradients sharing one NIC,
    and fair sharing instead of first come first served.
    """
    ops, fr = _flat(comp)
    n_all = len(ops)
    work = [v * f for row in var for v in row for f in fr]  # per (kind, stage, fraction)
    call = [p for row in per_call for p in row for _ in fr]
    send = [x * f for x in cut_ms for f in fr]  # per (cut, fraction)
    wait = [x for x in lat[: len(cut_ms)] for _ in fr]
    via = [False] * n_all  # True: started by the cross-stage message
    todo: Sequence[tuple[int, int, int, int, int, int]]
    if resume is None:
        end = [0.0] * (n_all + 1)  # the last slot: 0.0 for "no previous action"
        free = [0.0] * (2 * len(cut_ms))  # when each cut's link is next free, per direction
        todo = ops
    else:
        done, idx, free_f, free_b = resume
        end = [*done, 0.0]
        free = [t for pair in zip(free_f, free_b) for t in pair]
        todo = [ops[i] for i in idx]
    for n, prev, cross, d, x, k in todo:
        t = end[prev]
        if cross >= 0:
            sent = end[cross]
            if queue:
                if free[k] > sent:
                    sent = free[k]
                sent = free[k] = sent + send[x]
                if record is not None:
                    record[n] = sent
            else:
                sent = sent + send[x]
            tc = sent + wait[x]
            if tc > t:
                t = tc
                via[n] = True
        end[n] = t + work[d] + call[d]
    end.pop()
    return [end[comp.last[s]] + ar[s] for s in range(len(ar))], end, via
