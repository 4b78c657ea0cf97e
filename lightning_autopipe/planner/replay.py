"""Replays schedules: the validator, the step x stage grid and the ASCII timeline."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.schedule import (
    Action,
    Kind,
    Schedule,
    check_shape,
    is_split,
    lower_communication,
    units,
)

__all__ = ["validate", "format_grid", "ascii_timeline"]


# ---------------------------------------------------------------------------- replay
@dataclass
class _Replay:
    """Result of replaying a schedule in rounds: where each action ran and what went wrong."""

    stages: list[int]
    rows: int = 0  # rounds that executed something
    cell: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, index) -> row
    error: str | None = None
    where: tuple[int, int] | None = None  # (stage, index) of the offending action


def _replay(schedule: Schedule) -> _Replay:
    """Replay ``schedule`` round by round, each stage running at most one action per round.

    Compute-only schedules get the implied dependencies (``F`` of a unit after the previous
    stage's ``F``, ``B`` after the next stage's ``B``); lowered schedules are replayed literally
    with non-blocking sends and blocking receives over first-in-first-out channels per
    (sender, receiver) pair. Stops at the first error or when no stage can move (deadlock).
    """
    stages = sorted(schedule)
    rep = _Replay(stages)
    first, last = stages[0], stages[-1]
    lowered = any(not a.kind.is_compute for acts in schedule.values() for a in acts)
    ptr = dict.fromkeys(stages, 0)
    fwd: dict[int, set] = {s: set() for s in stages}
    bwd: dict[int, set] = {s: set() for s in stages}
    wgt: dict[int, set] = {s: set() for s in stages}
    got_f: dict[int, set] = {s: set() for s in stages}
    got_b: dict[int, set] = {s: set() for s in stages}
    chan: dict[tuple[int, int], deque] = {}

    def check(s: int, a: Action) -> str | None | bool:
        """True: ready; False: waiting; str: error."""
        u = a.unit
        k = a.kind
        if k is Kind.WEIGHT:
            if u in wgt[s]:
                return f"stage {s} runs {a} twice"
            if u not in bwd[s]:
                return f"stage {s} runs {a} before its input backward {s}B{u[0]}.{u[1]}"
            return True
        if k is Kind.FORWARD:
            if u in fwd[s]:
                return f"stage {s} runs {a} twice"
            if lowered:
                return (
                    True
                    if s == first or u in got_f[s]
                    else (f"stage {s} runs {a} before receiving its input ({s}RF{u[0]}.{u[1]})")
                )
            return s == first or (s - 1 in fwd and u in fwd[s - 1])
        if k is Kind.BACKWARD:
            if u in bwd[s]:
                return f"stage {s} runs {a} twice"
            if u not in fwd[s]:
                return f"stage {s} runs {a} before its forward {s}F{u[0]}.{u[1]}"
            if lowered:
                return (
                    True
                    if s == last or u in got_b[s]
                    else (f"stage {s} runs {a} before receiving its gradient ({s}RB{u[0]}.{u[1]})")
                )
            return s == last or (s + 1 in bwd and u in bwd[s + 1])
        if k in (Kind.SEND_F, Kind.SEND_B):
            done = fwd if k is Kind.SEND_F else bwd
            peer = s + 1 if k is Kind.SEND_F else s - 1
            if peer not in schedule:
                return f"stage {s} sends {a} to stage {peer}, which does not exist"
            if u not in done[s]:
                what = "forward" if k is Kind.SEND_F else "backward"
                return f"stage {s} sends {a} before running its {what}"
            return True
        peer = s - 1 if k is Kind.RECV_F else s + 1
        if peer not in schedule:
            return f"stage {s} receives {a} from stage {peer}, which does not exist"
        q = chan.get((peer, s))
        if not q:
            return False
        if q[0][0] != u or q[0][1] != k:
            sent = q[0][2]
            return f"stage {s} receives {a} but the next message from stage {peer} is {sent}"
        return True

    while True:
        ready: list[tuple[int, Action]] = []
        blocked = []
        for s in stages:
            acts = schedule[s]
            if ptr[s] >= len(acts):
                continue
            a = acts[ptr[s]]
            if a.stage != s:
                rep.error = f"action {a} is listed under stage {s}; it belongs to stage {a.stage}"
                rep.where = (s, ptr[s])
                break
            st = check(s, a)
            if isinstance(st, str):
                rep.error, rep.where = st, (s, ptr[s])
                break
            (ready if st else blocked).append((s, a))
        if rep.error is not None:
            break
        if not ready:
            if blocked:
                waits = ", ".join(str(a) for _, a in blocked)
                rep.error = (
                    f"deadlock: no stage can move; waiting: {waits} "
                    "(receives block, sends do not: check the order of these steps)"
                )
                rep.where = (blocked[0][0], ptr[blocked[0][0]])
            break
        for s, a in ready:  # apply after checking, so effects show up next round
            rep.cell[(s, ptr[s])] = rep.rows
            ptr[s] += 1
            u, k = a.unit, a.kind
            if k is Kind.FORWARD:
                fwd[s].add(u)
            elif k is Kind.BACKWARD:
                bwd[s].add(u)
            elif k is Kind.WEIGHT:
                wgt[s].add(u)
            elif k is Kind.SEND_F:
                chan.setdefault((s, s + 1), deque()).append((u, Kind.RECV_F, a))
            elif k is Kind.SEND_B:
                chan.setdefault((s, s - 1), deque()).append((u, Kind.RECV_B, a))
            else:
                peer = s - 1 if k is Kind.RECV_F else s + 1
                chan[(peer, s)].popleft()
                (got_f if k is Kind.RECV_F else got_b)[s].add(u)
        rep.rows += 1
    if rep.error is None:
        for q in chan.values():
            if q:
                sent = q[0][2]
                idx = schedule[sent.stage].index(sent)
                rep.error = f"{sent} is sent but never received (no matching receive)"
                rep.where = (sent.stage, idx)
                break
    for s in stages:  # actions never reached go below, in list order
        for i in range(ptr[s], len(schedule[s])):
            rep.cell[(s, i)] = rep.rows + 1 + i - ptr[s]
    return rep


def _grid(schedule: Schedule, rep: _Replay, mark: tuple[int, int] | None) -> str:
    stages = rep.stages
    pos = {(row, s): str(schedule[s][i]) for (s, i), row in rep.cell.items()}
    width = max([len(v) for v in pos.values()] + [len(f"stage {s}") for s in stages]) + 2
    nrows = max([row for row, _ in pos] + [rep.rows - 1, mark[0] if mark else 0]) + 1
    lines = ["step | " + " ".join(f"stage {s}".ljust(width) for s in stages)]
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
    return "\n".join(lines)


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """The step x stage grid of ``schedule`` in replay order, ``mark`` = (step, stage) as ``>..<``.

    Each step every stage runs its next action if it can (see :func:`_replay`); actions that
    are never reached (error or deadlock) follow below a ``not reached`` line.
    """
    return _grid(schedule, _replay(schedule), mark)


def _fail(schedule: Schedule, rep: _Replay, msg: str, where: tuple[int, int] | None) -> None:
    mark = None
    if where is not None:
        s, i = where
        row = rep.cell.get((s, i))
        if row is None:  # past the end of that stage's list: mark the cell right after it
            row = max([r for (t, _), r in rep.cell.items() if t == s] + [-1]) + 1
        mark = (row, s)
    where_txt = f" (marked at step {mark[0]}, stage {mark[1]})" if mark else ""
    raise ScheduleError(f"invalid schedule: {msg}{where_txt}\n{_grid(schedule, rep, mark)}")


def validate(
    schedule: Schedule, num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> None:
    """Check a schedule the runtime and the simulator will replay.

    Checks stages ``0..S-1`` with their own actions, every unit of ``units(m, k, j)`` forwarded
    exactly once per stage and (unless the schedule has no backward at all, i.e. forward-only)
    backwarded exactly once after its forward; in a split (zero-bubble) schedule every unit also
    has exactly one weight backward ``W`` on every stage, after its ``B`` there. Then it replays
    the schedule (a compute-only one
    both as given and lowered by :func:`lower_communication`): sends must match receives in
    order between neighbouring stages and the replay must finish (no deadlock).

    Raises:
        ScheduleError: with the step x stage grid and the offending step marked.
    """
    check_shape(1, num_microbatches, startup_slices, drain_slices)
    stages = sorted(schedule)
    if stages != list(range(len(stages))) or not stages:
        raise ScheduleError(f"schedule stages must be 0..S-1, got {stages}")
    rep = _replay(schedule)
    expected = units(num_microbatches, startup_slices, drain_slices)
    want = set(expected)
    has_backward = any(a.kind is Kind.BACKWARD for acts in schedule.values() for a in acts)
    split = is_split(schedule)
    for s in stages:
        for i, a in enumerate(schedule[s]):
            if a.stage != s:
                _fail(schedule, rep, f"action {a} is listed under stage {s}", (s, i))
            if a.unit not in want:
                _fail(
                    schedule,
                    rep,
                    f"{a} names unit {a.unit}, not one of the {len(expected)} units of "
                    f"m={num_microbatches}, k={startup_slices}, j={drain_slices}",
                    (s, i),
                )
        kinds = [Kind.FORWARD, Kind.BACKWARD] if has_backward else [Kind.FORWARD]
        kinds += [Kind.WEIGHT] if split else []
        for kind in kinds:
            seen: dict[tuple[int, int], int] = {}
            for i, a in enumerate(schedule[s]):
                if a.kind is kind:
                    if a.unit in seen:
                        _fail(schedule, rep, f"stage {s} runs {a} twice", (s, i))
                    seen[a.unit] = i
            missing = [u for u in expected if u not in seen]
            if missing:
                names = ", ".join(f"{s}{kind.value}{mb}.{sl}" for mb, sl in missing[:6])
                _fail(schedule, rep, f"stage {s} lacks {names}", (s, len(schedule[s])))
    if rep.error is not None:
        _fail(schedule, rep, rep.error, rep.where)
    if all(a.kind.is_compute for acts in schedule.values() for a in acts):
        lowered = lower_communication(schedule)
        low = _replay(lowered)
        if low.error is not None:
            _fail(lowered, low, f"after lowering: {low.error}", low.where)


# ---------------------------------------------------------------------------- ascii timeline
def ascii_timeline(
    schedule: Schedule,
    startup_slices: int,
    forward: int = 2,
    backward: int = 4,
    drain_slices: int = 1,
) -> str:
    """Time-proportional text picture of a compute-only schedule on a balanced pipeline.

    A micro-batch takes ``forward`` / ``backward`` ticks, a slice of micro-batch 0 (or of the
    last micro-batch, with ``drain_slices``) its share (rounded up to one tick). Digits are
    forwards of that micro-batch, letters backwards (``a`` = 0, ``b`` = 1, ...), ``-``/``=``
    continue a unit, ``.`` is idle. In a split (zero-bubble) schedule the input backward ``B``
    and the weight backward ``W`` take half of ``backward`` each; ``W`` is an upper-case letter
    continued by ``~``. Transfers are free.
    """
    stages = sorted(schedule)
    first, last = stages[0], stages[-1]
    final = max((a.microbatch for acts in schedule.values() for a in acts), default=0)
    back = backward / 2 if is_split(schedule) else backward

    def ticks(a: Action) -> int:
        base = forward if a.kind is Kind.FORWARD else back
        n = startup_slices if a.microbatch == 0 else drain_slices if a.microbatch == final else 1
        return max(1, round(base / n))

    done: dict[tuple[int, Kind, tuple[int, int]], int] = {}
    free = dict.fromkeys(stages, 0)
    ptr = dict.fromkeys(stages, 0)
    spans: dict[int, list[tuple[int, int, Action]]] = {s: [] for s in stages}
    moved = True
    while moved:
        moved = False
        for s in stages:
            while ptr[s] < len(schedule[s]):
                a = schedule[s][ptr[s]]
                if a.kind is Kind.FORWARD:
                    dep = None if s == first else (s - 1, Kind.FORWARD, a.unit)
                elif a.kind is Kind.WEIGHT:
                    dep = None
                else:
                    dep = None if s == last else (s + 1, Kind.BACKWARD, a.unit)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep else 0)
                free[s] = start + ticks(a)
                done[(s, a.kind, a.unit)] = free[s]
                spans[s].append((start, free[s], a))
                ptr[s] += 1
                moved = True
    lines = []
    for s in stages:
        row: list[str] = []
        for start, end, a in spans[s]:
            row.extend("." * (start - len(row)))
            letter = chr(ord("a") + a.microbatch % 26)
            head, rest = {Kind.FORWARD: (str(a.microbatch % 10), "-"),
                          Kind.BACKWARD: (letter, "="),
                          Kind.WEIGHT: (letter.upper(), "~")}[a.kind]
            row.extend(head + rest * (end - start - 1))
        lines.append(f"stage {s} |" + "".join(row))
    return "\n".join(lines)
