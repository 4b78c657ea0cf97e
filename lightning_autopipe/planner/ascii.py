"""The time-proportional ASCII timeline of a compute-only schedule on a balanced pipeline."""

from __future__ import annotations

from lightning_autopipe.planner.schedule import Action, Kind, Schedule, chunk_owners, is_split

__all__ = ["ascii_timeline", "CONTINUE"]

#: continuation characters of F, B and W per chunk of a rank (its first, second, third ...)
CONTINUE = {Kind.FORWARD: "-+*:", Kind.BACKWARD: "=#%&", Kind.WEIGHT: "~^\"'"}


def ascii_timeline(
    schedule: Schedule,
    startup_slices: int,
    forward: int = 2,
    backward: int = 4,
    drain_slices: int = 1,
) -> str:
    """Time-proportional text picture of a compute-only schedule on a balanced pipeline.

    A micro-batch takes ``forward`` / ``backward`` ticks on a chunk, a slice of micro-batch 0
    (or of the last micro-batch, with ``drain_slices``) its share (rounded up to one tick).
    Digits are forwards of that micro-batch, letters backwards (``a`` = 0, ``b`` = 1, ...),
    ``-``/``=`` continue a unit, ``.`` is idle. In a split (zero-bubble) schedule the input
    backward ``B`` and the weight backward ``W`` take half of ``backward`` each; ``W`` is an
    upper-case letter continued by ``~``. With several chunks per rank (rows are then ranks)
    a rank's later chunks continue with other characters (:data:`CONTINUE`: ``+ # ^`` for
    its second chunk, ``* % "`` for its third). Transfers are free.
    """
    ranks = sorted(schedule)
    owner = chunk_owners(schedule)
    last = max(owner, default=0)
    local = {c: sorted(x for x in owner if owner[x] == r).index(c) for c, r in owner.items()}
    word = "stage" if last + 1 == len(ranks) else "rank"
    final = max((a.microbatch for acts in schedule.values() for a in acts), default=0)
    back = backward / 2 if is_split(schedule) else backward

    def ticks(a: Action) -> int:
        base = forward if a.kind is Kind.FORWARD else back
        n = startup_slices if a.microbatch == 0 else drain_slices if a.microbatch == final else 1
        return max(1, round(base / n))

    done: dict[tuple[int, Kind, tuple[int, int]], int] = {}
    free = dict.fromkeys(ranks, 0)
    ptr = dict.fromkeys(ranks, 0)
    spans: dict[int, list[tuple[int, int, Action]]] = {r: [] for r in ranks}
    moved = True
    while moved:
        moved = False
        for r in ranks:
            while ptr[r] < len(schedule[r]):
                a = schedule[r][ptr[r]]
                c = a.stage
                if a.kind is Kind.FORWARD:
                    dep = None if c == 0 else (c - 1, Kind.FORWARD, a.unit)
                elif a.kind is Kind.WEIGHT:
                    dep = None
                else:
                    dep = None if c == last else (c + 1, Kind.BACKWARD, a.unit)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0)
                free[r] = start + ticks(a)
                done[(c, a.kind, a.unit)] = free[r]
                spans[r].append((start, free[r], a))
                ptr[r] += 1
                moved = True
    lines = []
    for r in ranks:
        row: list[str] = []
        for start, end, a in spans[r]:
            row.extend("." * (start - len(row)))
            letter = chr(ord("a") + a.microbatch % 26)
            head = {Kind.FORWARD: str(a.microbatch % 10), Kind.BACKWARD: letter,
                    Kind.WEIGHT: letter.upper()}[a.kind]
            chars = CONTINUE[a.kind]
            row.extend(head + chars[local[a.stage] % len(chars)] * (end - start - 1))
        lines.append(f"{word} {r} |" + "".join(row))
    return "\n".join(lines)
