"""ZB-V: two stage chunks per rank in V placement, backward split into B and W, with startup
and drain slices.

Rank ``r`` holds chunks ``r`` and ``2p - 1 - r`` (:mod:`~.placement`, ``"v"``): a micro-batch
goes down the ranks and back up, so the first and last chunk share rank 0 and the turn at rank
``p - 1`` is a local hand-off. With the backward split as in :mod:`~.zero_bubble` (Qi et al.,
"Pipeline Parallelism with Controllable Memory", 2024, the V-shaped schedules), fill and drain
are half of ZB-H1's and the peak activation memory of every rank stays at 1F1B's first stage
(``p`` micro-batches of a whole stage = ``2 p`` chunk micro-batches).

The order is found by replaying the step on a balanced pipeline with free transfers, every
unit taking one tick per sample position for F, B and W alike (the paper's setting), and
letting each rank, whenever it is free, take in this order:

1. the backward (B) of its oldest unit whose gradient has arrived (a unit is older when it
   entered the pipeline earlier; between chunks, the later chunk first);
2. the forward (F) of its oldest unit whose input has arrived, unless that would hold more
   than ``2 p`` chunk micro-batches of activations (held from F until W);
3. its oldest pending weight backward (W);
4. otherwise it idles until the next action anywhere ends.

Every chunk forwards and backwards the units in pipeline order (so the runtime's channels stay
first-in first-out) and every W follows its own B. Should every rank wait at once (no shape
of the tests does), the oldest ready forward runs beyond the memory bound, so a schedule is
always produced. The result depends only on the shape, so the simulator, the fast model and
the runtime replay the same lists.

4 ranks, m = 8, one tick per F, B and W of a chunk micro-batch (:func:`~.ascii.ascii_timeline`:
digits forwards, lower-case letters B, upper-case W), against ZB-H1 on the same model (one
stage per rank = two chunks: two ticks per F, B and W): 50 ticks against 56, the ideal 48::

    ZB-V    rank 0 |01234560aA1bB2caA3dbBc7C4deCDD5fEeE6gFGfF7hgGH...hH
            rank 1 |.01234051aA2bBac3Abdc6B4dC7eC5DDef6EEgfF7FghGGH.hH
            rank 2 |..01203142aA3abAcb5cdB4dB6C5eC7eD6fDEfg7EgFFhGGhHH
            rank 3 |...00112233aaA4bbccA4ddB5B5C6eeC6D7ffD7ggEEFFhhGGHH

    ZB-H1   stage 0 |0-1-2-3-......a=A~4-b=B~5-c=C~6-d=D~7-e=E~f=F~g=G~h=H~
            stage 1 |..0-1-2-....a=3-b=A~4-c=B~5-d=C~6-e=D~7-f=E~g=F~h=G~H~
            stage 2 |....0-1-..a=2-b=3-c=A~4-d=B~5-e=C~6-f=D~7-g=E~h=F~G~H~
            stage 3 |......0-a=1-b=2-c=3-d=A~4-e=B~5-f=C~6-g=D~7-h=E~F~G~H~
"""

from __future__ import annotations

import heapq

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.placement import chunk_ranks
from lightning_autopipe.planner.schedule import Action, Kind, Schedule, check_shape, spans

__all__ = ["zbv", "greedy_schedule"]


def zbv(
    num_ranks: int,
    num_microbatches: int,
    startup_slices: int = 1,
    drain_slices: int = 1,
    chunks_per_rank: int = 2,
) -> Schedule:
    """ZB-V (module docstring): compute-only ``F``/``B``/``W`` actions keyed by rank.

    Raises:
        ScheduleError: ``chunks_per_rank`` is not 2 (the V needs exactly two chunks).
    """
    check_shape(num_ranks, num_microbatches, startup_slices, drain_slices)
    if chunks_per_rank != 2:
        raise ScheduleError(
            f"zbv needs exactly 2 chunks per rank (V placement), got {chunks_per_rank}; use "
            "'interleaved-1f1b' for other counts"
        )
    _, scale = spans(num_microbatches, startup_slices, drain_slices)
    return greedy_schedule(num_ranks, 2, "v", num_microbatches, startup_slices, drain_slices,
                           split=True, bound=2 * num_ranks * scale)


def greedy_schedule(
    num_ranks: int, chunks_per_rank: int, placement: str, num_microbatches: int,
    startup_slices: int, drain_slices: int, *, split: bool, bound: int,
) -> Schedule:
    """The balanced-pipeline list schedule of the module docstring for any placement.

    ``bound`` is the most activation positions (chunk micro-batches times ``k j``) a rank
    holds; with ``split`` a unit's activations are held until its W, else until its B.
    """
    p, v = num_ranks, chunks_per_rank
    owner = chunk_ranks(p, v, placement)
    nc = p * v
    order, _ = spans(num_microbatches, startup_slices, drain_slices)
    nu = len(order)
    width = [u[3] - u[2] for u in order]
    mine = [[c for c in range(nc) if owner[c] == r] for r in range(p)]
    nf = [0] * nc  # next unit to forward / backward per chunk
    nb = [0] * nc
    f_end = [[-1] * nu for _ in range(nc)]  # end tick of each chunk's F / B of a unit
    b_end = [[-1] * nu for _ in range(nc)]
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (unit, chunk) to W
    held = [0] * p
    out: Schedule = {r: [] for r in range(p)}
    ends: list[int] = []  # heap of end ticks of the actions decided so far
    ready = [(0, r, r) for r in range(p)]  # (tick the rank is free, sequence, rank)
    seq = p
    todo = [nu * len(mine[r]) * (3 if split else 2) for r in range(p)]
    left = sum(todo)
    idle, relax_at = 0, -1
    while left:
        t, _, r = heapq.heappop(ready)
        while ends and ends[0] <= t:
            heapq.heappop(ends)
        choice = _pick(t, mine[r], nf, nb, f_end, b_end, nu, nc, width, held[r], bound,
                       pending[r], relax=relax_at == t)
        if choice is None:
            seq += 1
            if ends:  # wait for the next action anywhere to end
                heapq.heappush(ready, (ends[0], seq, r))
                continue
            # nothing runs: the other ranks free at this tick decide first; when none of
            # them can move either, the memory bound gives way (a schedule is always made)
            idle += 1
            if idle > 2 * p:
                raise ScheduleError(f"the list schedule stalls at tick {t}")  # pragma: no cover
            if idle > p:
                relax_at = t
            heapq.heappush(ready, (t, seq, r))
            continue
        idle = 0
        kind, c, u = choice
        end = t + width[u]
        out[r].append(Action(c, kind, order[u][0], order[u][1]))
        left -= 1
        todo[r] -= 1
        if kind is Kind.FORWARD:
            nf[c] += 1
            f_end[c][u] = end
            held[r] += width[u]
        elif kind is Kind.BACKWARD:
            nb[c] += 1
            b_end[c][u] = end
            if split:
                pending[r].append((u, c))
            else:
                held[r] -= width[u]
        else:
            pending[r].remove((u, c))
            held[r] -= width[u]
        heapq.heappush(ends, end)
        seq += 1
        if todo[r]:
            heapq.heappush(ready, (end, seq, r))
    return out


def _pick(t, chunks, nf, nb, f_end, b_end, nu, nc, width, held, bound, pending, *, relax):
    """Rank ``r``'s action at tick ``t`` by the module docstring's rules, or None (wait)."""
    best_b = best_f = None
    for c in chunks:
        u = nb[c]
        if u < nu and 0 <= f_end[c][u] <= t and (
                c == nc - 1 or 0 <= b_end[c + 1][u] <= t):
            key = (u, -c)
            if best_b is None or key < best_b[0]:
                best_b = (key, c, u)
        u = nf[c]
        if u < nu and (c == 0 or 0 <= f_end[c - 1][u] <= t) and (
                relax or held + width[u] <= bound):
            key = (u, -c)
            if best_f is None or key < best_f[0]:
                best_f = (key, c, u)
    if best_b is not None:
        return Kind.BACKWARD, best_b[1], best_b[2]
    if best_f is not None:
        return Kind.FORWARD, best_f[1], best_f[2]
    if pending:
        u, c = min(pending)
        return Kind.WEIGHT, c, u
    return None
