"""``self.log`` calls of a step's micro-batch slices, merged per key into one call per step.

A step that runs once per slice would log each key once per slice; Lightning's result collection
expects one value per step, weighted by the batch size for ``on_epoch`` means. :class:`SliceLogs`
checks each call as ``LightningModule.log`` binds it, keeps one record per key and combines the
slices by the key's ``reduce_fx``: ``mean`` weighted by sample count (or by the ``batch_size``
given, e.g. a slice's token count), so the merged value is the whole batch's, ``sum`` /
``max`` / ``min`` as such (a count or an extreme of the batch: a mean logged with them is
combined the same way). A ``batch_size`` that is one number in every slice, other than the
slices' own sample counts, is the batch's size written as a constant
(``batch_size=self.batch_size``): the slices are then weighted by their samples and the step
logs that constant, as one process would; otherwise the step's ``batch_size`` (the weight of
its value in an ``on_epoch`` mean) is the slices' sum. What cannot be merged into a number (a
``torchmetrics.Metric`` object, a tensor of several elements, a custom reduction, a process
group) is refused with :class:`StepContractError`.

Under uneven replica batches (a plan's ``replica_batches``) a replica's mean is over its own
share; Lightning's ``sync_dist`` mean of a step weights every rank alike, so a synced mean is
logged times the replica's weight (its samples over an even share), and a ``batch_size`` that
is the replica's own sample count over it (one given as a batch's size, the loader's or the
global one, stays): the step's synced
value and the epoch's batch-weighted mean are then the global batch's, as with even batches
(a value alike on every replica, e.g. a learning rate, is unchanged, the weights averaging
1). A mean weighted by given per-slice counts (tokens) is left as it is: Lightning's epoch
mean already weights each rank by its count.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Sequence
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
    values: list[Tensor]  # float64, one per slice
    samples: list[int]  # each slice's sample count
    given: list[float | None]  # each slice's batch_size, None where not given
    wide: bool  # a float64 value was logged (merged as float64, else float32)

    def weighting(self) -> str:
        """``"samples"`` (no ``batch_size``), ``"constant"`` (one ``batch_size`` in every
        slice, not their sample counts) or ``"given"`` (per-slice counts, e.g. tokens)."""
        if self.given[0] is None:
            return "samples"
        given = [float(g) for g in self.given]  # type: ignore[arg-type]
        if len(set(given)) == 1 and given != [float(n) for n in self.samples]:
            return "constant"
        return "given"

    def weights(self) -> tuple[list[float], float]:
        """The slices' weights in a mean and the step's ``batch_size`` (module docstring)."""
        kind, samples = self.weighting(), [float(n) for n in self.samples]
        if kind == "samples":
            return samples, sum(samples)
        given = [float(g) for g in self.given]  # type: ignore[arg-type]
        return (samples, given[0]) if kind == "constant" else (given, sum(given))


def bind_log(hook: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             ) -> tuple[str, Tensor, dict[str, Any], float | None]:
    """One ``self.log(*args, **kwargs)`` call of a slice, checked.

    Returns:
        ``(name, value, options, given)``: ``value`` a one-element tensor, ``options`` the
        call's keywords with ``reduce`` normalised, ``given`` the ``batch_size`` given (None
        when not).

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
            + (WAY_OUT + " (then log from on_train_batch_end)" if hook == "training_step" else
               "or update the metric in the step (metric.update(...)) and log "
               f"metric.compute() from on_{hook.split('_')[0]}_epoch_end")
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
    return name, value, options, None if batch_size is None else float(batch_size)


class SliceLogs:
    """The records of one step, one per key, in the order the keys were first logged."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def __bool__(self) -> bool:
        return bool(self._records)

    def merge(self, name: str, value: Tensor, options: dict[str, Any], samples: int,
              given: float | None) -> None:
        """Add one slice's value of ``name`` (as :func:`bind_log` returned it) for a slice of
        ``samples`` samples."""
        options = dict(options)
        reduce = options.pop("reduce")
        wide = value.dtype == torch.float64
        value = value.detach().reshape(()).double()
        rec = self._records.get(name)
        if rec is None:
            self._records[name] = _Record(options, reduce, [value], [samples], [given], wide)
            return
        if rec.options != options or rec.reduce != reduce:
            raise StepContractError(
                f"self.log({name!r}, ...) was called with different arguments in two micro-batch "
                f"slices of one step ({rec.options} vs {options}); use the same arguments"
            )
        rec.values.append(value)
        rec.samples.append(samples)
        rec.given.append(given)
        rec.wide = rec.wide or wide

    def combined(self, replica_weight: float = 1.0, replicas: int = 1) -> list[LoggedValue]:
        """One call per key: the merged value and the keywords to log it with (one sync).

        ``replica_weight``: the replica's samples over an even share, of ``replicas``
        (module docstring)."""
        if not self._records:
            return []
        values = torch.stack([_value(r) for r in self._records.values()]).tolist()
        out = []
        for (name, rec), value in zip(self._records.items(), values):
            options = {k: rec.options[k] for k in _PASSED}
            options["reduce_fx"] = rec.reduce
            size = rec.weights()[1]
            if replica_weight != 1.0 and rec.reduce == "mean" and options["sync_dist"]:
                kind = rec.weighting()
                even = sum(rec.samples) / replica_weight
                if kind == "constant" and all(abs(float(rec.given[0] or 0) - size) > 0.5
                                              for size in (even, even * replicas)):
                    kind = "given"  # not a batch's size: a count (one slice's tokens)
                if kind != "given":  # a token count is its own weight across the ranks
                    value *= replica_weight
                if kind == "samples":  # the replica's own count: restated as the even share
                    size /= replica_weight
            options["batch_size"] = max(1, round(size))
            out.append((name, options, float(value), rec.wide))
        return out


def weighted_mean(values: Tensor, weights: Sequence[float]) -> Tensor:
    """The slices' values (one per slice) weighted by ``weights`` (their samples): the whole
    batch's mean, in float64."""
    w = torch.tensor(list(weights), dtype=torch.float64)
    return (values.double() * w).sum() / max(float(w.sum()), 1e-300)


def _value(rec: _Record) -> Tensor:
    values = torch.stack(rec.values)
    if rec.reduce == "mean":
        return weighted_mean(values, rec.weights()[0])
    if rec.reduce == "sum":
        return values.sum()
    return values.max() if rec.reduce == "max" else values.min()


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - Lightning depends on torchmetrics
        return False
    return isinstance(value, Metric)
