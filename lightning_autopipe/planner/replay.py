"""Replays schedules: the validator and the step x rank grid (the ASCII timeline lives in
:mod:`~.ascii`).

A schedule is keyed by rank position; with several stage chunks per rank
(:mod:`~.placement`) an action names its chunk, neighbouring chunks on one rank hand over
locally and messages between chunks on different ranks travel on one first-in first-out
channel per (sending chunk, receiving chunk) pair.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.ascii import ascii_timeline
from lightning_autopipe.planner.placement import chunk_ranks
from lightning_autopipe.planner.rounds import Replay, replay
from lightning_autopipe.planner.schedule import (
    Kind,
    Schedule,
    check_shape,
    is_split,
    lower_communication,
    spans,
    units,
)

__all__ = ["validate", "format_grid", "ascii_timeline", "inflight_per_rank"]


def inflight_per_rank(schedule: Schedule, num_microbatches: int, startup_slices: int,
                      drain_slices: int = 1) -> dict[int, list[float]]:
    """Per rank, the chunk micro-batches of activations held after each of its actions (a
    unit from its ``F`` until its ``B``, or its ``W`` when the backward is split; a slice
    counts its share; the chunks of a rank summed)."""
    order, scale = spans(num_microbatches, startup_slices, drain_slices)
    frac = {(mb, sl): (e - s) / scale for mb, sl, s, e in order}
    release = Kind.WEIGHT if is_split(schedule) else Kind.BACKWARD
    out: dict[int, list[float]] = {}
    for r, acts in schedule.items():
        cur, row = 0.0, []
        for a in acts:
            if a.kind is Kind.FORWARD:
                cur += frac.get(a.unit, 0.0)
            elif a.kind is release:
                cur -= frac.get(a.unit, 0.0)
            row.append(cur)
        out[r] = row
    return out


def _grid(schedule: Schedule, rep: Replay, mark: tuple[int, int] | None,
          held: dict[int, list[float]] | None = None) -> str:
    stages, word = rep.stages, rep.word
    pos = {(row, s): str(schedule[s][i]) for (s, i), row in rep.cell.items()}
    width = max([len(v) for v in pos.values()] + [len(f"{word} {s}") for s in stages]) + 2
    nrows = max([row for row, _ in pos] + [rep.rows - 1, mark[0] if mark else 0]) + 1
    lines = ["step | " + " ".join(f"{word} {s}".ljust(width) for s in stages)]
    for row in range(nrows):
        if row == rep.rows and row < nrows - 1:
            lines.append("---- not reached " + "-" * max(0, len(lines[0]) - 17))
            continue
        cells = []
        for s in stages:
            text = pos.get((row, s), "")
            if mark == (row, s):
                text = f">{text or '?'}<"
            cells.append(text.ljust(width))
        lines.append(f"{row:4d} | " + " ".join(cells).rstrip())
    if held is not None:  # memory per rank: the most chunk micro-batches it holds at once
        peak = [f"{max(held[s], default=0.0):g}".ljust(width) for s in stages]
        lines.append("peak | " + " ".join(peak).rstrip() + "   (chunk micro-batches held)")
    return "\n".join(lines)


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None, *,
                held: dict[int, list[float]] | None = None) -> str:
    """The step x rank grid of ``schedule`` in replay order, ``mark`` = (step, rank) as ``>..<``.

    Each step every rank runs its next action if it can (see :func:`~.rounds.replay`); actions that
    are never reached (error or deadlock) follow below a ``not reached`` line. With ``held``
    (:func:`inflight_per_rank`) a last row gives each rank's peak activations in flight.
    """
    return _grid(schedule, replay(schedule), mark, held)


def _fail(schedule: Schedule, rep: Replay, msg: str, where: tuple[int, int] | None,
          held: dict[int, list[float]] | None = None) -> None:
    mark = None
    if where is not None:
        s, i = where
        row = rep.cell.get((s, i))
        if row is None:  # past the end of that rank's list: mark the cell right after it
            row = max([r for (t, _), r in rep.cell.items() if t == s] + [-1]) + 1
        mark = (row, s)
    where_txt = f" (marked at step {mark[0]}, {rep.word} {mark[1]})" if mark else ""
    raise ScheduleError(f"invalid schedule: {msg}{where_txt}\n{_grid(schedule, rep, mark, held)}")


def validate(
    schedule: Schedule,
    num_microbatches: int,
    startup_slices: int,
    drain_slices: int = 1,
    *,
    chunks_per_rank: int = 1,
    placement: str = "looped",
    max_inflight: float | Sequence[float] | None = None,
) -> None:
    """Check a schedule the runtime and the simulator will replay.

    Checks ranks ``0..p-1`` holding the chunks ``placement`` gives them (``chunks_per_rank``
    each; with one, chunk == rank), every unit of ``units(m, k, j)`` forwarded exactly once
    per chunk and (unless the schedule has no backward at all, i.e. forward-only) backwarded
    exactly once after its forward; in a split (zero-bubble) schedule every unit also has
    exactly one weight backward ``W`` on every chunk, after its ``B`` there. With
    ``max_inflight`` (one bound, or one per rank) no rank may hold more chunk micro-batches of
    activations at once (:func:`inflight_per_rank`). Then it replays the schedule (a
    compute-only one both as given and lowered by :func:`lower_communication`): sends must
    match receives in order per chunk pair, a local hand-off must follow its producer on the
    rank, and the replay must finish (no deadlock).

    Raises:
        ScheduleError: with the step x rank grid (and each rank's peak in flight) and the
            offending step marked.
    """
    check_shape(1, num_microbatches, startup_slices, drain_slices)
    stages = sorted(schedule)
    if stages != list(range(len(stages))) or not stages:
        raise ScheduleError(f"schedule stages must be 0..S-1, got {stages}")
    owner = chunk_ranks(len(stages), chunks_per_rank, placement)
    word = "stage" if chunks_per_rank == 1 else "rank"
    rep = replay(schedule, owner)
    held = inflight_per_rank(schedule, num_microbatches, startup_slices, drain_slices)
    expected = units(num_microbatches, startup_slices, drain_slices)
    want = set(expected)
    has_backward = any(a.kind is Kind.BACKWARD for acts in schedule.values() for a in acts)
    split = is_split(schedule)
    kinds = [Kind.FORWARD, Kind.BACKWARD] if has_backward else [Kind.FORWARD]
    kinds += [Kind.WEIGHT] if split else []
    for r in stages:
        for i, a in enumerate(schedule[r]):
            if not 0 <= a.stage < len(owner) or owner[a.stage] != r:
                _fail(schedule, rep, f"action {a} is listed under {word} {r}", (r, i))
            if a.unit not in want:
                _fail(
                    schedule,
                    rep,
                    f"{a} names unit {a.unit}, not one of the {len(expected)} units of "
                    f"m={num_microbatches}, k={startup_slices}, j={drain_slices}",
                    (r, i),
                )
        seen: dict[tuple[int, Kind], set[tuple[int, int]]] = {}  # (chunk, kind) -> units
        twice: dict[tuple[int, Kind], int] = {}  # (chunk, kind) -> its first repeated action
        for i, a in enumerate(schedule[r]):
            got = seen.setdefault((a.stage, a.kind), set())
            if a.unit in got:
                twice.setdefault((a.stage, a.kind), i)
            got.add(a.unit)
        for c in (c for c, o in enumerate(owner) if o == r):
            where = f"stage {r}" if chunks_per_rank == 1 else f"chunk {c} (rank {r})"
            for kind in kinds:
                if (c, kind) in twice:
                    i = twice[(c, kind)]
                    _fail(schedule, rep, f"{word} {r} runs {schedule[r][i]} twice", (r, i))
                missing = [u for u in expected if u not in seen.get((c, kind), ())]
                if missing:
                    names = ", ".join(f"{c}{kind.value}{mb}.{sl}" for mb, sl in missing[:6])
                    _fail(schedule, rep, f"{where} lacks {names}", (r, len(schedule[r])))
    if max_inflight is not None:
        bounds = ([float(max_inflight)] * len(stages) if isinstance(max_inflight, int | float)
                  else [float(b) for b in max_inflight])
        for r in stages:
            for i, x in enumerate(held[r]):
                if x > bounds[r] + 1e-9:
                    _fail(schedule, rep,
                          f"{word} {r} holds {x:g} chunk micro-batches of activations after "
                          f"{schedule[r][i]}, over its bound of {bounds[r]:g}", (r, i), held)
    if rep.error is not None:
        _fail(schedule, rep, rep.error, rep.where, held if chunks_per_rank > 1 else None)
    if all(a.kind.is_compute for acts in schedule.values() for a in acts):
        lowered = lower_communication(schedule)
        low = replay(lowered, owner)
        if low.error is not None:
            _fail(lowered, low, f"after lowering: {low.error}", low.where)
