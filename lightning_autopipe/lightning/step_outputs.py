"""What a step returns under the pipeline, joined over its micro-batch slices.

The module's own steps run once per slice on the last stage (:mod:`.steps`); Lightning hands
the step's return value to ``on_validation_batch_end`` / ``on_test_batch_end`` and collects
``predict_step``'s: :func:`join_slices` makes of the slices' values what one call on the whole
batch returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_autopipe.errors import StepContractError
from lightning_autopipe.lightning.step_logs import weighted_mean

__all__ = ["join_slices"]


def join_slices(parts: Sequence[Any], sizes: Sequence[int], *, evaluating: bool = False
                ) -> Any:
    """The return values of a batch's slices, joined as one call on the batch returns them.

    Tensors with the batch first are concatenated along dim 0; dicts and tuples are joined
    entry by entry; a list with one entry per sample in every slice is concatenated; a value
    alike in every slice (``None``, ``batch_idx``, a name) is kept. ``evaluating``
    (``validation_step`` / ``test_step``): a one-element floating tensor or a float that
    differs between slices is a batch value, a mean over its samples (a loss, an accuracy), so
    the slices' values are averaged weighted by their samples; prediction refuses it, and an
    integer that differs (a count: summed or averaged?) cannot be joined.

    Raises:
        StepContractError: a value that cannot be joined (a 0-dim tensor when predicting,
            mismatched keys, a per-batch statistic of another shape...).
    """
    hook = "a validation/test step" if evaluating else "predict_step"
    first = parts[0]
    if all(isinstance(p, Tensor) for p in parts):
        if all(p.dim() and p.shape[0] == n for p, n in zip(parts, sizes)) or (
                not evaluating and first.dim() and all(p.dim() for p in parts)):
            return torch.cat(list(parts), dim=0)
        if evaluating and all(p.numel() == 1 and p.is_floating_point() for p in parts):
            mean = weighted_mean(torch.stack([p.detach().reshape(()) for p in parts]), sizes)
            return mean.to(first.dtype).reshape(first.shape)
        shapes = sorted({tuple(p.shape) for p in parts})
        raise StepContractError(
            f"{hook} returned tensors of shapes {shapes} for micro-batch slices of "
            f"{list(sizes)} samples; return per-sample values (the batch first) so the slices "
            "can be joined in batch order" + (", or a one-element mean" if evaluating else ""))
    if not isinstance(first, Mapping | list | tuple) and all(_alike(p, first) for p in parts):
        return first  # a plain value alike in every slice (None, batch_idx, a name)
    if evaluating and all(isinstance(p, float) for p in parts):  # a count (int) is no mean
        return float(weighted_mean(torch.tensor(parts, dtype=torch.float64), sizes))
    if isinstance(first, Mapping) and all(isinstance(p, Mapping) for p in parts):
        keys = list(first)
        if any(list(p) != keys for p in parts):
            raise StepContractError(f"{hook} returned dicts with different keys per slice")
        return type(first)({k: join_slices([p[k] for p in parts], sizes, evaluating=evaluating)
                            for k in keys})
    if isinstance(first, list) and all(isinstance(p, list) for p in parts) and all(
        len(p) == n for p, n in zip(parts, sizes)
    ):
        return [item for p in parts for item in p]
    if isinstance(first, tuple | list) and all(
        isinstance(p, tuple | list) and len(p) == len(first) for p in parts
    ):
        joined = [join_slices([p[i] for p in parts], sizes, evaluating=evaluating)
                  for i in range(len(first))]
        return type(first)(joined) if not hasattr(first, "_fields") else type(first)(*joined)
    raise StepContractError(
        f"{hook} returned {type(first).__name__} values that differ between micro-batch "
        "slices and cannot be joined; return tensors (the batch first), dicts or tuples of "
        "them, or a list with one entry per sample"
    )


def _alike(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same plain value (no tensor: those are joined, not compared)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == is not a truth value
        return False

