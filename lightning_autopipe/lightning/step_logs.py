"""``self.log`` calls of a step's micro-batch slices, merged per key into one call per step.

A step that runs once per slice would log each key once per slice; Lightning's result collection
expects one value per step, weighted by the batch size for ``on_epoch`` means. :class:`SliceLogs`
checks each call as ``LightningModule.log`` binds it, keeps one record per key and combines the
slices by the key's ``reduce_fx``: ``mean`` weighted by sample count (or the ``batch_size``
given), so the merged value is the whole batch's, ``sum`` / ``max`` / ``min`` as such. What
cannot be merged into a number (a ``torchmetrics.Metric`` object, a tensor of several elements,
a custom reduction, a process group) is refused with :class:`StepContractError`.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_autopipe.errors import StepContractError

__all__ = ["WAY_OUT", "LoggedValue", "SliceLogs", "bind_log"]

WAY_OUT = (
    "or define pipeline_loss(self, outputs, batch) returning the slice's mean loss: the "
    "strategy then runs forward, loss and backward itself and does not call the steps"
)
_SIGNATURE = inspect.signature(LightningModule.log)
_REDUCE_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_REDUCE_FUNCS = {torch.mean: "mean", torch.sum: "sum", sum: "sum", torch.max: "max", max: "max",
                 torch.min: "min", min: "min"}
# What a merged call passes on (enable_graph is moot: the values cross ranks detached).
_PASSED = ("prog_bar", "logger", "on_step", "on_epoch", "sync_dist", "add_dataloader_idx",
           "metric_attribute", "rank_zero_only")

LoggedValue = tuple[str, dict[str, Any], float, bool]
"""One merged key: name, ``self.log`` keywords, value, whether it was float64."""


@dataclass
class _Record:
    options: dict[str, Any]  # the call's keywords (whether batch_size was given, not its value)
    reduce: str
    total: Tensor  # float64: sum of weight x value (mean), sum, max or min
    weight: float  # sum of the slices' weights (their batch_size, else sample count)
    wide: bool  # a float64 value was logged (merged as float64, else float32)


def bind_log(hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], samples: int,
             ) -> tuple[str, Tensor, dict[str, Any], float]:
    """One ``self.log(*args, **kwargs)`` call of a slice of ``samples`` samples, checked.

    Returns:
        ``(name, value, options, weight)``: ``value`` a one-element tensor, ``options`` the
        call's keywords with ``reduce`` normalised, ``weight`` the ``batch_size`` given or the
        slice's sample count.

    Raises:
        TypeError: arguments ``LightningModule.log`` does not take (its own error).
        StepContractError: a value or keyword the slices cannot be merged over.
    """
    bound = _SIGNATURE.bind(None, *args, **kwargs)
    bound.apply_defaults()
    options = dict(bound.arguments)
    del options["self"]
    name, value = options.pop("name"), options.pop("value")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise StepContractError(
                f"self.log({name!r}, ...) in {hook} got a tensor of shape {tuple(value.shape)}; "
                "log one number per key (a one-element tensor or a Python number): the "
                "pipeline merges each key over the micro-batch slices, " + WAY_OUT
            )
    elif isinstance(value, numbers.Real):
        value = torch.tensor(float(value), dtype=torch.float64)
    else:
        kind = type(value).__name__
        what = "a torchmetrics Metric" if _is_metric(value) else f"a {kind}"
        raise StepContractError(
            f"self.log({name!r}, <{kind}>) in {hook} logs {what}, which the pipeline cannot "
            "merge: the step runs once per micro-batch slice on the last stage only, and what "
            "it logs is combined per key and sent to every rank as numbers. Log the value "
            "itself (a one-element tensor, e.g. metric(preds, target) or metric.compute()), "
            + WAY_OUT + " (then log from on_train_batch_end)"
        )
    reduce = options.pop("reduce_fx")
    if isinstance(reduce, str):
        reduce_name = _REDUCE_NAMES.get(reduce.lower())
    else:
        reduce_name = next((v for k, v in _REDUCE_FUNCS.items() if reduce is k), None)
    if reduce_name is None:
        raise StepContractError(
            f"self.log({name!r}, ..., reduce_fx={reduce!r}) in {hook}: only 'mean', 'sum', "
            "'max' and 'min' can be merged over micro-batch slices, " + WAY_OUT
        )
    if options.pop("sync_dist_group") is not None:
        raise StepContractError(
            f"self.log({name!r}, ..., sync_dist_group=...) in {hook}: a process group cannot "
            "be sent between ranks; use sync_dist=True (the whole world, as the pipeline logs "
            "on every rank), " + WAY_OUT
        )
    options.pop("enable_graph")
    batch_size = options.pop("batch_size")
    options["batch_size_given"] = batch_size is not None
    options["reduce"] = reduce_name
    weight = float(batch_size) if batch_size is not None else float(samples)
    return name, value, options, weight


class SliceLogs:
    """The records of one step, one per key, in the order the keys were first logged."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def __bool__(self) -> bool:
        return bool(self._records)

    def merge(self, name: str, value: Tensor, options: dict[str, Any], weight: float) -> None:
        """Add one slice's value of ``name`` (as :func:`bind_log` returned it)."""
        options = dict(options)
        reduce = options.pop("reduce")
        wide = value.dtype == torch.float64
        value = value.detach().reshape(()).double()
        rec = self._records.get(name)
        if rec is None:
            total = value * weight if reduce == "mean" else value
            self._records[name] = _Record(options, reduce, total, weight, wide)
            return
        if rec.options != options or rec.reduce != reduce:
            raise StepContractError(
                f"self.log({name!r}, ...) was called with different arguments in two micro-batch "
                f"slices of one step ({rec.options} vs {options}); use the same arguments"
            )
        if reduce == "mean":
            rec.total = rec.total + value * weight
        elif reduce == "sum":
            rec.total = rec.total + value
        elif reduce == "max":
            rec.total = torch.maximum(rec.total, value)
        else:
            rec.total = torch.minimum(rec.total, value)
        rec.weight += weight
        rec.wide = rec.wide or wide

    def combined(self) -> list[LoggedValue]:
        """One call per key: the merged value and the keywords to log it with (one sync)."""
        if not self._records:
            return []
        values = torch.stack([_value(r) for r in self._records.values()]).tolist()
        out = []
        for (name, rec), value in zip(self._records.items(), values):
            options = {k: rec.options[k] for k in _PASSED}
            options["reduce_fx"] = rec.reduce
            options["batch_size"] = max(1, round(rec.weight))
            out.append((name, options, float(value), rec.wide))
        return out


def _value(rec: _Record) -> Tensor:
    if rec.reduce == "mean":
        return rec.total / max(rec.weight, 1e-300)
    return rec.total


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - Lightning depends on torchmetrics
        return False
    return isinstance(value, Metric)
