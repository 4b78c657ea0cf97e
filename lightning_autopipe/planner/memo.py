"""The fast model's estimates kept for one search: a cut list priced twice is replayed once.

One :func:`~.search.make_plan` call prices the same (layout, cuts, shape) several times: the
partitioner under each startup slice count starts from cuts another run already walked
through, the slicers price the partitioner's answer again, the final local search its
neighbours. The estimates live beside the search's :class:`~.layout.BlockCosts` (built once
per call, so nothing outlives the search) and a repeated candidate costs a dictionary lookup:
the same estimate, since the fast model is a pure function of these inputs. One priced
without its critical path serves only requests that do not ask for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_autopipe.planner.layout import BlockCosts, Layout

__all__ = ["kept"]


def _layout_id(memo: dict, token: object, layout: Layout) -> int:
    """A small number per distinct layout (equal fields, equal number), found once per
    layout object: hashing a layout's link tables on every lookup would cost a replay. The
    layout keeps it under ``memo``'s token, an object the layout then holds alive: a memo
    made after this one is freed cannot share it (as it could share the freed memo's ``id``,
    and so read another layout's number)."""
    seen = layout.__dict__.setdefault("_memo_ids", {})
    got = seen.get(token)
    if got is None:
        ids = memo.setdefault("layouts", {})
        got = seen[token] = ids.setdefault(layout, len(ids))
    return got


def kept(
    costs: BlockCosts, layouts: Sequence[Layout], cuts_list: Sequence[Sequence[int]],
    shape: tuple, critical_path: bool, price: Callable[[list[int]], list[Any]],
) -> list[Any]:
    """The estimates of every (layout, cuts) under ``shape`` (everything else the estimate
    depends on, hashable), pricing with ``price(indices)`` only those not kept yet."""
    memo = costs.__dict__.setdefault("_estimates", {})
    found = memo.setdefault("found", {})
    token = memo.setdefault("token", object())
    keys = [(_layout_id(memo, token, lay), tuple(c), shape)
            for lay, c in zip(layouts, cuts_list)]
    out: list[Any] = [None] * len(keys)
    todo = []
    for i, key in enumerate(keys):
        hit = found.get(key)
        if hit is not None and (hit[1] or not critical_path):
            out[i] = hit[0]
        else:
            todo.append(i)
    if todo:
        for i, est in zip(todo, price(todo)):
            out[i] = est
            found[keys[i]] = (est, critical_path)
    return out
