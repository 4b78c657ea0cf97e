"""Uneven replica batches at run time: each replica takes its share of the global batch.

Every replica loads an even batch (DDP-style sampling, fixed when training starts); a plan with
``replica_batches`` (:class:`~lightning_autopipe.planner.plan.Plan`) gives a faster replica
more of the step's samples. The global batch is the replicas' loaded batches one after another
(replica order), and replica ``i`` trains the next ``replica_batches[i]`` samples of it, so the
union of what the replicas train is exactly what even loading gives: the same training, only
dealt differently. The ranks of one stage all-gather the per-sample tensors of their batches
(those whose first dimension is the batch size, as :func:`~.units.slice_batch` cuts), the only
ones that differ between replicas, and the lists of per-sample strings or numbers a collate
function makes; any other value passes unchanged.

The executor weights each unit's loss by ``unit samples / loaded batch`` (the even share), not
``/ replica batch``, so that the replicas' summed, then averaged, gradients are those of the
global batch's mean loss. A step whose loaded batches are not the plan's (the short last batch
of an epoch) deals its joined samples in the plan's proportions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_autopipe.errors import InputError
from lightning_autopipe.planner.replica_batches import share_counts
from lightning_autopipe.runtime.units import per_sample

__all__ = ["take_share"]


def take_share(batch: Any, size: int, replica_batches: Sequence[int], replica: int,
               row: Sequence[int], group: Any) -> tuple[Any, float]:
    """This replica's share of the replicas' joined batches, and the even share it is
    weighted over (the joined samples over the replicas).

    Per-sample values are the tensors whose first dimension is ``size`` and the lists of
    plain values (strings, numbers) of ``size`` items, as a collate function makes of
    per-sample strings; any other value passes unchanged. The replicas' batches may hold
    different numbers of samples (a data set sharded by hand, unequal last batches).

    Args:
        batch: the batch this rank loaded (one replica's even share).
        size: its samples (the first dimension of the model's first input).
        replica_batches: the plan's samples per replica (their proportions when the joined
            batches hold another number of samples).
        replica: this rank's replica.
        row: the global ranks of this rank's stage, by replica (the data-parallel group).
        group: that group.

    Raises:
        InputError: the replicas' batches differ in a per-sample tensor's shape beyond its
            first dimension (per-batch padding) or in their per-sample values, so they cannot
            be joined.
    """
    tensors: list[Tensor] = []
    lists: list[list] = []
    _walk(batch, size, lambda t: tensors.append(t) or t, lambda x: lists.append(x) or x)
    mine = (size, [(tuple(t.shape[1:]), t.dtype) for t in tensors], lists)
    everyone: list[Any] = [None] * len(row)
    dist.all_gather_object(everyone, mine, group=group)
    by_replica = {r: i for i, r in enumerate(sorted(row))}  # group ranks are sorted globally
    ordered = [everyone[by_replica[r]] for r in row]  # by replica
    if any(e[1] != mine[1] or len(e[2]) != len(lists) for e in ordered):
        raise InputError(
            "uneven replica batches (the plan's replica_batches) join the replicas' batches, "
            "but their per-sample values differ in kind or in a tensor's shape beyond the "
            f"first dimension: {dict(zip(row, (e[:2] for e in ordered)))} by rank (per-batch "
            "padding of sequences?); pad to one fixed length, or plan even batches "
            "(balance_replicas=False)"
        )
    sizes = [e[0] for e in ordered]
    total = sum(sizes)
    counts = (list(replica_batches) if sum(replica_batches) == total
              else share_counts([float(n) for n in replica_batches], total, 1))
    start = sum(counts[:replica])
    stop = start + counts[replica]
    longest = max(sizes)
    dealt_tensors = []
    for t in tensors:
        padded = t.contiguous()
        if size < longest:
            padded = torch.cat([padded, padded.new_zeros((longest - size, *t.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in row]
        dist.all_gather(parts, padded, group=group)
        joined = torch.cat([parts[by_replica[r]][:n] for r, n in zip(row, sizes)])
        dealt_tensors.append(joined[start:stop])
    dealt_lists = [[x for e in ordered for x in e[2][k]][start:stop] for k in range(len(lists))]
    it_t, it_l = iter(dealt_tensors), iter(dealt_lists)
    share = _walk(batch, size, lambda t: next(it_t), lambda x: next(it_l))
    return share, total / len(row)


def _walk(batch: Any, size: int, on_tensor: Any, on_list: Any) -> Any:
    """``batch`` with its per-sample tensors and lists replaced by ``on_tensor`` /
    ``on_list`` of them, in one fixed order."""

    def visit(x: Any) -> Any:
        if isinstance(x, Tensor):
            return on_tensor(x) if per_sample(x, size) else x
        if _sample_list(x, size):
            return on_list(x)
        return [apply_to_collection(e, (Tensor, list), visit, allow_frozen=True) for e in x]

    return apply_to_collection(batch, (Tensor, list), visit, allow_frozen=True)


def _sample_list(x: Any, size: int) -> bool:
    """A list of ``size`` plain values (strings, numbers): one per sample."""
    return (isinstance(x, list) and len(x) == size and size > 0
            and all(isinstance(e, str | bytes | int | float | bool) for e in x))
