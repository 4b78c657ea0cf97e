"""The replay engine against the plainest replay of the same rules.

:func:`~lightning_autopipe.planner.rounds.replay` decides the common case inline and looks at a
waiting rank again only once what it waits for has happened. The reference below tests every
rank's next action in every round with :func:`~lightning_autopipe.planner.rounds._check`, the
engine's own statement of the rules, so the two must agree to the round, the cell and the
error on every schedule: generated ones, lowered ones and broken variants of both.
"""

from __future__ import annotations

import itertools
import random
from collections import deque

from lightning_autopipe.planner.generators import generate
from lightning_autopipe.planner.placement import chunk_ranks
from lightning_autopipe.planner.rounds import Replay, _check, _State, replay
from lightning_autopipe.planner.schedule import Action, Kind, Schedule, lower_communication

FAMILIES = [("1f1b", 1, "looped"), ("zb-h1", 1, "looped"), ("interleaved-1f1b", 2, "looped"),
            ("interleaved-1f1b", 3, "looped"), ("zbv", 2, "v")]


def _reference(schedule: Schedule, owner: list[int]) -> Replay:
    """Every rank that has actions left, its next action tested in every round."""
    stages = sorted(schedule)
    word = "stage" if len(owner) == len(stages) else "rank"
    rep = Replay(stages, word=word)
    st = _State(owner, any(not a.kind.is_compute for acts in schedule.values() for a in acts))
    ptr = dict.fromkeys(stages, 0)
    while rep.error is None:
        ready, blocked = [], []
        for r in (r for r in stages if ptr[r] < len(schedule[r])):
            a = schedule[r][ptr[r]]
            if not 0 <= a.stage < len(owner) or owner[a.stage] != r:
                held = owner[a.stage] if 0 <= a.stage < len(owner) else None
                rep.error = f"action {a} is listed under {word} {r}; it belongs to {word} {held}"
            else:
                ok = _check(st, word, r, a)
                if isinstance(ok, str):
                    rep.error = ok
                else:
                    (ready if ok else blocked).append((r, a))
                    continue
            rep.where = (r, ptr[r])
            break
        if rep.error is not None or not ready:
            if rep.error is None and blocked:
                waits = ", ".join(str(a) for _, a in blocked)
                rep.error = (f"deadlock: no {word} can move; waiting: {waits} (receives block, "
                             "sends do not: check the order of these steps)")
                rep.where = (blocked[0][0], ptr[blocked[0][0]])
            break
        for r, a in ready:
            rep.cell[(r, ptr[r])] = rep.rows
            ptr[r] += 1
            u, k, c = (a.microbatch, a.slice), a.kind, a.stage
            if k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT):
                {Kind.FORWARD: st.fwd, Kind.BACKWARD: st.bwd, Kind.WEIGHT: st.wgt}[k][c].add(u)
            elif k in (Kind.SEND_F, Kind.SEND_B):
                peer = c + 1 if k is Kind.SEND_F else c - 1
                st.chan.setdefault((c, peer), deque()).append((u, a, r))
            else:
                peer = c - 1 if k is Kind.RECV_F else c + 1
                st.chan[(peer, c)].popleft()
                (st.got_f if k is Kind.RECV_F else st.got_b)[c].add(u)
        rep.rows += 1
    if rep.error is None:
        for q in st.chan.values():
            if q:
                _, sent, r = q[0]
                rep.error = f"{sent} is sent but never received (no matching receive)"
                rep.where = (r, schedule[r].index(sent))
                break
    for r in stages:
        for i in range(ptr[r], len(schedule[r])):
            rep.cell[(r, i)] = rep.rows + 1 + i - ptr[r]
    return rep


def _broken(schedule: Schedule, rng: random.Random) -> Schedule:
    """``schedule`` with one action swapped, dropped, repeated, moved to another rank, renamed
    to another micro-batch or turned into another kind (a send to a chunk on its own rank,
    a receive from nowhere...)."""
    out = {r: list(acts) for r, acts in schedule.items()}
    r = rng.choice(sorted(out))
    acts = out[r]
    i, j = rng.randrange(len(acts)), rng.randrange(len(acts))
    how = rng.randrange(6)
    if how == 0:
        acts[i], acts[j] = acts[j], acts[i]
    elif how == 1:
        del acts[i]
    elif how == 2:
        acts.insert(j, acts[i])
    elif how == 3:
        out[rng.choice(sorted(out))].insert(0, acts.pop(i))
    elif how == 4:
        a = acts[i]
        acts[i] = Action(a.stage, a.kind, a.microbatch + 1, a.slice)
    else:
        a = acts[i]
        acts.insert(i + 1, Action(a.stage, rng.choice(list(Kind)), a.microbatch, a.slice))
    return out


def _sends_added(schedule: Schedule) -> list[Schedule]:
    """Per rank and direction, ``schedule`` with a send right after the rank's first compute
    of that direction on each of its chunks (to a chunk on another rank, or its own)."""
    out = []
    for r, acts in schedule.items():
        for kind, send in ((Kind.FORWARD, Kind.SEND_F), (Kind.BACKWARD, Kind.SEND_B)):
            firsts = {}
            for i, a in enumerate(acts):
                if a.kind is kind:
                    firsts.setdefault(a.stage, i)
            for i in firsts.values():
                a = acts[i]
                out.append({**schedule, r: [*acts[:i + 1], Action(a.stage, send, a.microbatch,
                                                                   a.slice), *acts[i + 1:]]})
    return out


def _fields(rep: Replay) -> tuple:
    return rep.rows, rep.cell, rep.error, rep.where, rep.word


def test_the_replay_equals_the_round_by_round_reference_on_good_and_broken_schedules():
    rng = random.Random(0)
    errors = kinds = 0
    seen_errors: set[str] = set()
    for p, (name, v, placement), (m, k, j) in itertools.product(
            (2, 3, 5), FAMILIES, [(1, 1, 1), (4, 1, 1), (5, 2, 1), (6, 2, 3), (9, 1, 2)]):
        owner = list(chunk_ranks(p, v, placement))
        compute = generate(name, p, m, k, j, v)
        for schedule in (compute, lower_communication(compute)):
            variants = [schedule, *(_broken(schedule, rng) for _ in range(6)),
                        *_sends_added(schedule)]
            for variant in variants:
                want = _reference(variant, owner)
                assert _fields(replay(variant, owner)) == _fields(want), (name, p, m, k, j)
                kinds += 1
                if want.error is not None:
                    errors += 1
                    seen_errors.add(want.error.split(" ")[0] if "deadlock" in want.error
                                    else " ".join(w for w in want.error.split()[2:4]))
    # the variants reach errors of many kinds, and most schedules as generated none
    assert 0.3 * kinds < errors < kinds, (errors, kinds)
    assert len(seen_errors) >= 6, seen_errors
