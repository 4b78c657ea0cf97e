"""Uneven replica batches at run time: each replica takes its share of the global batch.

Every replica loads an even batch (DDP-style sampling, fixed when training starts); a plan with
``replica_batches`` (:class:`~lightning_autopipe.planner.plan.Plan`) gives a faster replica
more of the step's samples. The global batch is the replicas' loaded batches one after another
(replica order), and replica ``i`` trains the next ``replica_batches[i]`` samples of it, so the
union of what the replicas train is exactly what even loading gives: the same training, only
dealt differently. The ranks of one stage all-gather the per-sample tensors of their batches
(those whose first dimension is the batch size, as :func:`~.units.slice_batch` cuts), the only
ones that differ between replicas; any other value passes unchanged.

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

__all__ = ["take_share"]


def take_share(batch: Any, size: int, replica_batches: Sequence[int], replica: int,
               row: Sequence[int], group: Any) -> Any:
    """This replica's ``replica_batches[replica]`` samples of the replicas' joined batches.

    Args:
        batch: the batch this rank loaded (one replica's even share).
        size: its samples (the first dimension of the model's first input).
        replica_batches: the plan's samples per replica (their proportions when the joined
            batches hold another number of samples).
        replica: this rank's replica.
        row: the global ranks of this rank's stage, by replica (the data-parallel group).
        group: that group.

    Raises:
        InputError: the replicas' batches differ in size or in a per-sample tensor's shape
            beyond its first dimension (per-batch padding), so they cannot be joined.
    """
    leaves: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: leaves.append(t) if _per_sample(t, size) else None,
                        allow_frozen=True)
    shapes = [(size, [tuple(t.shape[1:]) for t in leaves], [t.dtype for t in leaves])]
    everyone: list[Any] = [None] * len(row)
    dist.all_gather_object(everyone, shapes[0], group=group)
    if any(e != shapes[0] for e in everyone):
        raise InputError(
            "uneven replica batches (the plan's replica_batches) join the replicas' batches, "
            "but they differ in size or in a per-sample tensor's shape beyond the first "
            f"dimension: {dict(zip(row, everyone))} by rank (per-batch padding of sequences?); "
            "pad to one fixed length, or plan even batches (balance_replicas=False)"
        )
    by_replica = {r: i for i, r in enumerate(sorted(row))}  # group ranks are sorted globally
    total = size * len(row)
    counts = (list(replica_batches) if sum(replica_batches) == total
              else share_counts([float(n) for n in replica_batches], total, 1))
    start = sum(counts[:replica])
    stop = start + counts[replica]
    joined = []
    for t in leaves:
        parts = [torch.empty_like(t) for _ in row]
        dist.all_gather(parts, t.contiguous(), group=group)
        ordered = torch.cat([parts[by_replica[r]] for r in row])
        joined.append(ordered[start:stop])
    out = iter(joined)
    return apply_to_collection(batch, Tensor, lambda t: next(out) if _per_sample(t, size) else t,
                               allow_frozen=True)


def _per_sample(t: Tensor, size: int) -> bool:
    return t.dim() > 0 and t.shape[0] == size
