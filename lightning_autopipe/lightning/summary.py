"""The model summary of a module split into pipeline stages: every stage's parameters, by layer.

After the split a rank's module holds one stage's parameters (the others are released), so
Lightning's ``ModelSummary`` callback would count rank 0's stage alone as if it were the model.
The whole model's parameter table is taken before the split (:func:`whole_model_parameters`);
:class:`PipelineSummary` reports it per layer under ``Params`` and, as Lightning's summary of
DeepSpeed's partitioned parameters does, what the reporting rank itself holds under ``Params per
Device``; :func:`install` makes a Trainer's summary callbacks use it (the hook Lightning's callback
itself uses for DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    NOT_APPLICABLE,
    get_human_readable_count,
)
from torch import nn

__all__ = ["ParamInfo", "PipelineSummary", "install", "uninstall", "whole_model_parameters"]

ParamInfo = tuple[tuple[str, ...], int, bool]
"""One parameter of the whole model: every name it is reached by, its size, trainable."""

_PER_DEVICE = "Params per Device"


def whole_model_parameters(module: nn.Module) -> list[ParamInfo]:
    """The parameter table of ``module`` while it is still whole (tied weights once)."""
    table: dict[int, tuple[list[str], int, bool]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names, _, _ = table.setdefault(id(p), ([], p.numel(), p.requires_grad))
        names.append(name)
    return [(tuple(names), numel, trainable) for names, numel, trainable in table.values()]


class PipelineSummary(ModelSummary):
    """``ModelSummary`` whose parameter counts are the whole model's, not this rank's stage.

    Args:
        model: the (split) LightningModule; its module tree is still whole.
        params: :func:`whole_model_parameters` of the module before the split.
        max_depth: as for ``ModelSummary``.
    """

    def __init__(self, model: Any, params: Sequence[ParamInfo], max_depth: int = 1) -> None:
        self._params = list(params)
        super().__init__(model, max_depth=max_depth)

    @property
    def param_nums(self) -> list[int]:
        return [self._layer_params(name) for name in self._layer_summary]

    @property
    def total_parameters(self) -> int:
        return sum(numel for _, numel, _ in self._params)

    @property
    def trainable_parameters(self) -> int:
        return sum(numel for _, numel, trainable in self._params if trainable)

    def _layer_params(self, layer: str) -> int:
        prefix = f"{layer}."
        return sum(
            numel for names, numel, _ in self._params if any(n.startswith(prefix) for n in names)
        )

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        local = [layer.num_parameters for layer in self._layer_summary.values()]  # this rank's
        column = list(map(get_human_readable_count, local))
        column += [NOT_APPLICABLE] * (len(arrays[0][1]) - len(column))  # the "other params" row
        at = next(i for i, (head, _) in enumerate(arrays) if head == "Params") + 1
        return [*arrays[:at], (_PER_DEVICE, column), *arrays[at:]]


def install(trainer: Any, params: Sequence[ParamInfo]) -> list[Any]:
    """Make the Trainer's summary callbacks summarise the whole model; returns those patched."""
    patched = []
    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, ModelSummaryCallback):
            cb._summary = lambda trainer, pl_module, cb=cb: PipelineSummary(
                pl_module, params, max_depth=cb._max_depth
            )
            patched.append(cb)
    return patched


def uninstall(patched: Sequence[Any]) -> None:
    """Give the callbacks :func:`install` patched their own summary back."""
    for cb in patched:
        cb.__dict__.pop("_summary", None)
