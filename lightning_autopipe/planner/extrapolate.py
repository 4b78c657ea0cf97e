"""Where the two replays of an extrapolated step part ways, so the shorter one is mostly
taken over from the longer.

A step of ``m > m0`` micro-batches is priced from replays of ``m0`` and ``m0 + win``
micro-batches (:func:`~.costmodel.evaluate`). Both start alike: each stage's list of actions
begins with the same actions on the same units, and an action whose stage's earlier actions
and whose sender are the same in both ends at the same time in both (same inputs, same float
operations). Typically 75-95% of the shorter replay is such a prefix, so it is copied from
the longer replay and only the rest is replayed (:func:`~.scalar.replay` with
``resume``): the estimates are equal to the bit to two whole replays.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lightning_autopipe.planner.compiled import B, compiled, lists
from lightning_autopipe.planner.schedule import units

__all__ = ["Tail", "tail_of"]


@dataclass(frozen=True)
class Tail:
    """How the shorter replay of an extrapolation (``m0`` micro-batches) departs from the
    longer one (``m0 + win``): most of its actions are the same actions on the same inputs
    (each stage's list starts alike; an action is shared when its stage's earlier actions and
    its sender are), so their ends are taken over and only the rest is replayed."""

    pairs: tuple[tuple[int, int], ...]  # (action of the shorter step, its twin in the longer)
    size: int  # actions of the shorter step
    todo: tuple[int, ...]  # the rest, in dependency order
    link_f: tuple[int, ...]  # per cut: the longer step's last shared forward transfer (or -1)
    link_b: tuple[int, ...]  # per cut: the same for the gradients

    def resume(self, end2: list[float], sent2: list[float] | None, cuts: int) -> tuple:
        """The shorter replay's state once every shared action has run."""
        end = [0.0] * self.size
        for i, twin in self.pairs:
            end[i] = end2[twin]
        pick = (lambda i: sent2[i] if i >= 0 else 0.0) if sent2 is not None else (
            lambda i: 0.0)
        return (end, self.todo, [pick(i) for i in self.link_f[:cuts]],
                [pick(i) for i in self.link_b[:cuts]])


_USES: dict[tuple, int] = {}
_PAYS_FROM = 3  # a tail costs about two replays to find: worth it from the third use


def tail_of(
    schedule: str, num: int, m0: int, win: int, k: int, mb: int, j: int
) -> Tail | None:
    """The :class:`Tail` of this shape, or None for its first uses (then the shorter step is
    replayed whole: finding the shared prefix costs about two replays, so it pays only for a
    shape priced again and again, as the partitioner's are)."""
    key = (schedule, num, m0, win, k, mb, j)
    uses = _USES[key] = _USES.get(key, 0) + 1
    if uses < _PAYS_FROM:
        return None
    return _tail(*key)


@functools.lru_cache(maxsize=256)
def _tail(schedule: str, num: int, m0: int, win: int, k: int, mb: int, j: int) -> Tail:
    short, long = compiled(schedule, num, m0, k, mb, j), compiled(schedule, num, m0 + win, k, mb, j)
    key_s, key_l = units(m0, k, j), units(m0 + win, k, j)
    list_s, list_l = lists(schedule, num, m0, k, j), lists(schedule, num, m0 + win, k, j)
    prefix = []
    for s in range(num):
        n = 0
        for (ca, ua), (cb, ub) in zip(list_s[s], list_l[s]):
            if ca != cb or key_s[ua] != key_l[ub] or short.fracs[ua] != long.fracs[ub]:
                break
            n += 1
        prefix.append(n)
    where: dict[tuple[int, int], int] = {}
    count = [0] * num
    for i, (s, *_rest) in enumerate(long.order):
        where[(s, count[s])] = i
        count[s] += 1
    count = [0] * num
    ok = [False] * len(short.order)
    shared, twins, todo = [], [], []
    link_f, link_b = [-1] * num, [-1] * num
    for i, (s, code, _u, prev, cross) in enumerate(short.order):
        p = count[s]
        count[s] += 1
        if p < prefix[s] and (prev < 0 or ok[prev]) and (cross < 0 or ok[cross]):
            ok[i] = True
            shared.append(i)
            twins.append(where[(s, p)])
            if cross >= 0:
                if code == B:
                    link_b[s] = twins[-1]
                else:
                    link_f[s - 1] = twins[-1]
        else:
            todo.append(i)
    return Tail(tuple(zip(shared, twins)), len(short.order), tuple(todo), tuple(link_f),
                tuple(link_b))
