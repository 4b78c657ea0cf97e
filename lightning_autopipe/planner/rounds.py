"""The round-by-round replay of a schedule that the validator and the step x rank grid read
(:mod:`~.replay`): in each round every rank runs its next action if it can.

Kept apart from the validator because the validator replays every schedule of the planner's
test grids (twice when it lowers one), so this loop is written for speed: ready is decided
inline, a waiting rank is looked at again only once what it waits for has happened, and the
wording of every other outcome lives in :func:`_check`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_autopipe.planner.schedule import Action, Kind, Schedule, chunk_owners

__all__ = ["Replay", "replay"]


@dataclass
class Replay:
    """Result of replaying a schedule in rounds: where each action ran and what went wrong."""

    stages: list[int]  # rank positions (the grid's columns)
    rows: int = 0  # rounds that executed something
    cell: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, index) -> row
    error: str | None = None
    where: tuple[int, int] | None = None  # (rank, index) of the offending action
    word: str = "stage"  # what a column is called: "stage" (one chunk per rank) or "rank"


def replay(schedule: Schedule, owner: Sequence[int] | None = None) -> Replay:
    """Replay ``schedule`` round by round, each rank running at most one action per round.

    Compute-only schedules get the implied dependencies (``F`` of a unit after the previous
    chunk's ``F``, ``B`` after the next chunk's ``B``); lowered schedules are replayed literally
    with non-blocking sends and blocking receives over first-in-first-out channels per
    (sending chunk, receiving chunk) pair. A neighbour chunk on the same rank must have run
    its part earlier in the rank's list (a local hand-off never waits). ``owner`` maps chunk
    to rank (default: as the schedule lists them). Stops at the first error or when no rank
    can move (deadlock).

    A rank that waits (for a remote compute, for a message) is tested again only in the round
    after what it waits for happened, not in every round (:func:`_awaits`); the usual
    outcome, ready, is decided inline with set lookups and :func:`_check` decides (and words)
    every other one. The validator replays every schedule it checks, twice when lowered.
    """
    stages = sorted(schedule)
    if owner is None:
        got = chunk_owners(schedule)
        owner = [got.get(c, -1) for c in range(max([*got, *stages]) + 1)]
    nc = len(owner)
    word = "stage" if nc == len(stages) else "rank"
    rep = Replay(stages, word=word)
    st = _State(owner, any(not a.kind.is_compute for acts in schedule.values() for a in acts))
    ptr = dict.fromkeys(stages, 0)
    fwd, bwd, wgt, got_f, got_b, chan = st.fwd, st.bwd, st.wgt, st.got_f, st.got_b, st.chan
    last, lowered = nc - 1, st.lowered
    forward, backward, weight = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
    send_f, send_b, recv_f = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F
    blocked: dict[int, Action] = {}  # rank -> the action it waits to run
    waiting: dict[tuple, int] = {}  # what a blocked rank waits for -> that rank
    candidates = [r for r in stages if schedule[r]]  # ranks whose next action may run now
    while True:
        ready: list[tuple[int, Action]] = []
        for r in sorted(candidates):
            a = schedule[r][ptr[r]]
            c, k, u = a.stage, a.kind, (a.microbatch, a.slice)
            if not 0 <= c < nc or owner[c] != r:
                held = owner[c] if 0 <= c < nc else None
                rep.error = f"action {a} is listed under {word} {r}; it belongs to {word} {held}"
                rep.where = (r, ptr[r])
                break
            if k is forward:  # the common outcomes, decided inline
                ok = u not in fwd[c] and (c == 0 or (
                    u in fwd[c - 1] if owner[c - 1] == r or not lowered else u in got_f[c]))
            elif k is backward:
                ok = u not in bwd[c] and u in fwd[c] and (c == last or (
                    u in bwd[c + 1] if owner[c + 1] == r or not lowered else u in got_b[c]))
            elif k is weight:
                ok = u not in wgt[c] and u in bwd[c]
            elif k is send_f:
                ok = c < last and owner[c + 1] != r and u in fwd[c]
            elif k is send_b:
                ok = c > 0 and owner[c - 1] != r and u in bwd[c]
            else:
                peer = c - 1 if k is recv_f else c + 1
                q = chan.get((peer, c)) if 0 <= peer < nc and owner[peer] != r else None
                ok = bool(q) and q[0][0] == u
            if not ok:  # a wait or an error: worded by _check
                ok = _check(st, word, r, a)
                if isinstance(ok, str):
                    rep.error, rep.where = ok, (r, ptr[r])
                    break
            if ok:
                ready.append((r, a))
            else:
                blocked[r] = a
                waiting[_awaits(a)] = r
        if rep.error is not None:
            break
        if not ready:
            if blocked:
                waits = ", ".join(str(blocked[r]) for r in sorted(blocked))
                rep.error = (
                    f"deadlock: no {word} can move; waiting: {waits} "
                    "(receives block, sends do not: check the order of these steps)"
                )
                first = min(blocked)
                rep.where = (first, ptr[first])
            break
        candidates = []
        for r, a in ready:  # apply after checking, so effects show up next round
            rep.cell[(r, ptr[r])] = rep.rows
            ptr[r] += 1
            if ptr[r] < len(schedule[r]):
                candidates.append(r)
            u, k, c = (a.microbatch, a.slice), a.kind, a.stage
            if k is forward:
                fwd[c].add(u)
                done = ("F", c, u)
            elif k is backward:
                bwd[c].add(u)
                done = ("B", c, u)
            elif k is weight:
                wgt[c].add(u)
                continue
            elif k is send_f:
                chan.setdefault((c, c + 1), deque()).append((u, a, r))
                done = (c, c + 1)
            elif k is send_b:
                chan.setdefault((c, c - 1), deque()).append((u, a, r))
                done = (c, c - 1)
            else:
                peer = c - 1 if k is recv_f else c + 1
                chan[(peer, c)].popleft()
                (got_f if k is recv_f else got_b)[c].add(u)
                continue
            woken = waiting.pop(done, None)
            if woken is not None:  # its wait is over: it tries again next round
                del blocked[woken]
                candidates.append(woken)
        rep.rows += 1
    if rep.error is None:
        for q in chan.values():
            if q:
                _, sent, r = q[0]
                rep.error = f"{sent} is sent but never received (no matching receive)"
                rep.where = (r, schedule[r].index(sent))
                break
    for r in stages:  # actions never reached go below, in list order
        for i in range(ptr[r], len(schedule[r])):
            rep.cell[(r, i)] = rep.rows + 1 + i - ptr[r]
    return rep


@dataclass
class _State:
    """What a replay has run so far: per chunk the units forwarded, backwarded, weight-
    backwarded and received (activations, gradients), and the messages in flight per
    (sending chunk, receiving chunk) channel."""

    owner: Sequence[int]
    lowered: bool  # the schedule lists its sends and receives
    fwd: list[set] = field(init=False)
    bwd: list[set] = field(init=False)
    wgt: list[set] = field(init=False)
    got_f: list[set] = field(init=False)
    got_b: list[set] = field(init=False)
    chan: dict[tuple[int, int], deque] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.owner)
        self.fwd, self.bwd, self.wgt, self.got_f, self.got_b = (
            [set() for _ in range(n)] for _ in range(5))


def _awaits(a: Action) -> tuple:
    """What a waiting action waits for (:func:`_check` said False): the remote compute of
    its unit on the neighbour chunk (a compute-only schedule), or a message on its channel
    (a receive); :func:`replay` names a run compute ``(kind, chunk, unit)`` and a send
    ``(sending chunk, receiving chunk)`` alike."""
    c, u = a.stage, (a.microbatch, a.slice)
    if a.kind is Kind.FORWARD:
        return ("F", c - 1, u)
    if a.kind is Kind.BACKWARD:
        return ("B", c + 1, u)
    return (c - 1, c) if a.kind is Kind.RECV_F else (c + 1, c)


def _name(c: int, u: tuple[int, int], kind: str) -> str:
    return f"{c}{kind}{u[0]}.{u[1]}"


def _needs(st: _State, word: str, r: int, a: Action, peer: int, done: list[set], what: str,
           got: list[set], recv: str) -> str | bool:
    """A compute's input from chunk ``peer``: local (must be done), remote (received)."""
    u = (a.microbatch, a.slice)
    if st.owner[peer] == r:
        return True if u in done[peer] else (
            f"{word} {r} runs {a} before its local {what} {_name(peer, u, a.kind.value)}")
    if st.lowered:
        return True if u in got[a.stage] else (
            f"{word} {r} runs {a} before receiving its {what} ({_name(a.stage, u, recv)})")
    return u in done[peer]


def _check(st: _State, word: str, r: int, a: Action) -> str | bool:
    """Whether rank ``r`` can run ``a`` (owned by it) in this round: True (ready), False
    (waiting: a message not arrived yet, a remote compute not run yet) or the error."""
    u, k, c = (a.microbatch, a.slice), a.kind, a.stage
    owner, nc = st.owner, len(st.owner)
    if k is Kind.WEIGHT:
        if u in st.wgt[c]:
            return f"{word} {r} runs {a} twice"
        if u not in st.bwd[c]:
            return f"{word} {r} runs {a} before its input backward {_name(c, u, 'B')}"
        return True
    if k is Kind.FORWARD:
        if u in st.fwd[c]:
            return f"{word} {r} runs {a} twice"
        return c == 0 or _needs(st, word, r, a, c - 1, st.fwd, "input", st.got_f, "RF")
    if k is Kind.BACKWARD:
        if u in st.bwd[c]:
            return f"{word} {r} runs {a} twice"
        if u not in st.fwd[c]:
            return f"{word} {r} runs {a} before its forward {_name(c, u, 'F')}"
        return c == nc - 1 or _needs(st, word, r, a, c + 1, st.bwd, "gradient", st.got_b, "RB")
    if k in (Kind.SEND_F, Kind.SEND_B):
        done = st.fwd if k is Kind.SEND_F else st.bwd
        peer = c + 1 if k is Kind.SEND_F else c - 1
        if not 0 <= peer < nc:
            return f"{word} {r} sends {a} to stage {peer}, which does not exist"
        if owner[peer] == r:
            return f"{word} {r} sends {a} to chunk {peer} on the same rank (a local hand-off)"
        if u not in done[c]:
            what = "forward" if k is Kind.SEND_F else "backward"
            return f"{word} {r} sends {a} before running its {what}"
        return True
    peer = c - 1 if k is Kind.RECV_F else c + 1
    if not 0 <= peer < nc:
        return f"{word} {r} receives {a} from stage {peer}, which does not exist"
    if owner[peer] == r:
        return f"{word} {r} receives {a} from chunk {peer} on the same rank (a local hand-off)"
    q = st.chan.get((peer, c))
    if not q:
        return False
    if q[0][0] != u:
        return f"{word} {r} receives {a} but the next message from stage {peer} is {q[0][1]}"
    return True
