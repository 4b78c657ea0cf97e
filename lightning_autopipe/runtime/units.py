"""How one replica's batch is cut into units: micro-batches, and slices of the first and last.

Every rank of a replica computes the same cuts from the batch size and the plan's counts, so
the units the schedule names (``(micro-batch, slice)``) hold the same samples on every stage.
"""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.planner.schedule import slice_count, slice_sizes

__all__ = ["Unit", "fit_units", "per_sample", "slice_batch", "unit_bounds"]

Unit = tuple[int, int]
"""``(micro-batch, slice)``: one unit of work of the schedule."""


def fit_units(
    batch_size: int, num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> tuple[int, int, int]:
    """The (micro-batches, startup slices, drain slices) actually used for ``batch_size``.

    The plan's values unless the batch is too small to give every unit a sample (a short last
    batch); then they shrink so that every unit is non-empty.
    """
    if batch_size < 1:
        raise PipelineRuntimeError("cannot run a pipeline step on an empty batch")
    m = min(num_microbatches, batch_size)
    first, last = -(-batch_size // m), batch_size // m  # sizes of micro-batch 0 and m - 1
    return m, min(startup_slices, first), min(drain_slices, last)


def unit_bounds(
    batch_size: int, num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> dict[Unit, tuple[int, int]]:
    """Sample range ``[start, stop)`` of every (micro-batch, slice) unit of one replica's batch.

    Micro-batches are contiguous and even (sizes differ by at most one, larger first); micro-batch
    0 is cut into ``startup_slices`` slices and, with two or more, the last into ``drain_slices``
    (:func:`~lightning_autopipe.planner.schedule.units`, :func:`slice_sizes`).
    """
    m, k, j = num_microbatches, startup_slices, drain_slices
    base, extra = divmod(batch_size, m)
    sizes = [base + (1 if i < extra else 0) for i in range(m)]
    out: dict[Unit, tuple[int, int]] = {}
    start = 0
    for mb, size in enumerate(sizes):
        for sl, part in enumerate(slice_sizes(size, slice_count(mb, m, k, j))):
            out[(mb, sl)] = (start, start + part)
            start += part
    return out


def per_sample(t: Tensor, batch_size: int) -> bool:
    """Whether ``t`` holds one row per sample of a batch of ``batch_size`` (what is cut)."""
    return t.dim() > 0 and t.shape[0] == batch_size


def slice_batch(batch: Any, start: int, stop: int, batch_size: int) -> Any:
    """Cut every tensor whose first dimension is ``batch_size`` to ``[start, stop)``.

    Containers (tuples, namedtuples, lists, dicts, dataclasses: Lightning's
    ``apply_to_collection``) are walked; other values (and tensors of another leading size,
    e.g. class weights) pass unchanged, so the loss sees the batch sliced consistently.
    """

    def cut(t: Tensor) -> Tensor:
        return t[start:stop] if per_sample(t, batch_size) else t

    return apply_to_collection(batch, Tensor, cut, allow_frozen=True)
