"""Example inputs for profiling and planning, drawn from the Trainer's dataloader or the module.

Setup must trace, profile and plan the model before the first step, so it needs forward inputs of
the real shapes, the replica batch size that sizes the plan, and (when one was drawn anyway) a
batch whose samples match the example so the profile can include ``pipeline_loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_autopipe.errors import InputError, PlanError


def _example(trainer: Any, module: Any) -> tuple[Any, int, Any]:
    """Example forward inputs (``example_input_array`` or the first batch), the batch size and
    the batch holding the example's samples (or None).

    The batch size is the dataloader's (one data-parallel replica's batch); it sizes the plan.
    The third value lets the profile include ``pipeline_loss``: the first batch when the
    example came from it, or its first samples when they match ``example_input_array``'s
    shapes; None when no batch was drawn. A loader batch size and ``example_input_array`` need
    no batch, but fitting draws one anyway from a loader that starts over at every ``iter()``
    (a ``DataLoader`` over a map-style dataset): it lets the profile price the loss, which
    the last stage holds from each unit's forward to its backward (a causal LM's
    log-probabilities are the size of its logits). A one-pass stream (an iterable dataset) is
    not drawn from, as that would consume its data.
    """
    from lightning_autopipe.runtime.local_stage import as_call_args, model_inputs

    fitting = trainer.state.fn == TrainerFn.FITTING
    loop = trainer.fit_loop if fitting else _eval_loop(trainer)
    loader = loop._data_source.dataloader()
    if isinstance(loader, list | tuple):
        loader = loader[0]
    batch = None
    size = getattr(loader, "batch_size", None)
    example = module.example_input_array
    if example is None or not size or (fitting and _starts_over(loader)):
        states = _collect_rng_states()  # a shuffling sampler seeds itself from torch's stream
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise PlanError("the dataloader is empty; AutoPipeStrategy needs a batch") from None
        finally:
            _set_rng_states(states)
        read_step_inputs(module, batch, trainer.state.fn)
        inputs = as_call_args(model_inputs(module, batch))
        _check_forward(module, inputs, "the first batch of the dataloader")
        first = next(iter(inputs.values() if isinstance(inputs, dict) else inputs))
        size = size or int(first.shape[0])
        if example is None:
            return inputs, int(size), batch
    example = as_call_args(example)
    _check_forward(module, example, "example_input_array")
    return example, int(size), _batch_like(module, batch, example)


#: The step each Trainer entry point runs, whose ``self(...)`` call names the forward inputs.
_STEPS = {TrainerFn.FITTING: "training_step", TrainerFn.VALIDATING: "validation_step",
          TrainerFn.TESTING: "test_step", TrainerFn.PREDICTING: "predict_step"}


class _Called(Exception):
    """Raised by the stand-in forward: what the step passed to ``self(...)``."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


def read_step_inputs(module: Any, batch: Any, fn: TrainerFn) -> None:
    """Take the forward inputs as the module's own step passes them to ``self(...)``.

    A step reads its batch as it likes (``x, mask, y = batch; self(x, mask)``), and the
    pipeline must feed the first stage the very tensors the step gives the model, before the
    step runs (on the last stage). Without ``pipeline_inputs`` the default rules (``batch[0]``
    of a tuple batch) miss such a step, so the step is run here once on the first batch up to
    its ``self(...)`` call, under a stand-in forward that records the call's arguments and stops
    it: where each argument is an entry of the batch itself (the same tensor object), those
    entries become the rule (:class:`InputRule`) for every batch. ``fn``: the Trainer's entry
    point, whose step is read (``training_step`` when fitting). A step that computes its
    inputs (casts, augmentation), fails or never calls ``self`` before that keeps the default
    rules, and the strategy's check at the first step names ``pipeline_inputs``. The random
    number generators are restored and nothing is logged, so the run trains as it would have.
    """
    from lightning_autopipe.runtime.local_stage import (
        as_call_args,
        model_inputs,
        set_input_rule,
    )

    set_input_rule(module, None)
    hook = _STEPS.get(fn)
    if (callable(getattr(module, "pipeline_inputs", None)) or hook is None
            or not isinstance(batch, tuple | list | Mapping)
            or not is_overridden(hook, module, LightningModule)):
        return
    call = _record_call(module, getattr(module, hook), batch)
    rule = None if call is None else _rule_of(module, batch, *call)
    if rule is None:
        return
    before = as_call_args(model_inputs(module, batch))
    now = as_call_args(rule(batch))
    if type(before) is type(now) and _same(before, now):
        return  # the default rules already take these inputs
    set_input_rule(module, rule)
    rank_zero_info(f"forward inputs: {rule} of each batch, as {hook} passes them")


def _record_call(module: Any, step: Any, batch: Any) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of the step's first ``self(...)`` on ``batch``, or None."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)

    def log(*args: Any, **kwargs: Any) -> None:
        return None

    own = {k: module.__dict__[k] for k in ("forward", "log", "log_dict") if k in module.__dict__}
    states = _collect_rng_states()
    module.forward, module.log, module.log_dict = forward, log, log
    try:
        takes_index = len(inspect.signature(step).parameters) > 1
        with torch.no_grad():
            step(batch, 0) if takes_index else step(batch)
    except _Called as called:
        return called.args, called.kwargs
    except Exception:  # the step needs what setup has not made yet: the default rules
        return None
    finally:
        for k in ("forward", "log", "log_dict"):
            del module.__dict__[k]
        module.__dict__.update(own)
        _set_rng_states(states)
    return None


def _rule_of(module: Any, batch: Any, args: tuple, kwargs: dict) -> Any:
    """The :class:`InputRule` taking ``args`` / ``kwargs`` from ``batch``, or None where an
    argument is not one of the batch's own entries."""
    from lightning_autopipe.runtime.local_stage import InputRule

    entries = list(batch.items()) if isinstance(batch, Mapping) else list(enumerate(batch))

    def where(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return None
        return next((key for key, entry in entries if entry is value), None)

    if not args and not kwargs:
        return None
    if not kwargs:
        found = tuple(where(a) for a in args)
        return None if None in found else InputRule(found)
    try:  # keyword arguments: every argument by its parameter's name
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    params = inspect.signature(module.forward).parameters
    if any(params[n].kind in (params[n].VAR_POSITIONAL, params[n].VAR_KEYWORD) for n in bound):
        return None
    found = tuple(where(v) for v in bound.values())
    return None if None in found else InputRule(found, tuple(bound))


def _same(a: Any, b: Any) -> bool:
    """The same tensor objects in the same places (positions or keys)."""
    if isinstance(a, dict):
        return set(a) == set(b) and all(a[k] is b[k] for k in a)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _starts_over(loader: Any) -> bool:
    """Drawing a batch leaves the epoch's data as it was: each ``iter()`` of a ``DataLoader``
    over a map-style dataset starts from its first batch again."""
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


def _check_forward(module: Any, inputs: Any, source: str) -> None:
    """The forward inputs drawn from ``source`` must bind to ``module.forward``: said here in
    the terms of the module and its batches, not of the tracer's ``example_inputs``.

    Raises:
        InputError: naming the inputs, the signature, and ``pipeline_inputs`` as the fix.
    """
    sig = inspect.signature(module.forward)
    try:
        sig.bind(**inputs) if isinstance(inputs, dict) else sig.bind(*inputs)
    except TypeError as exc:
        given = (f"keyword arguments {sorted(inputs)}" if isinstance(inputs, dict)
                 else f"{len(inputs)} positional argument(s)")
        raise InputError(
            f"the forward inputs AutoPipeStrategy took from {source} ({given}) do not fit "
            f"{type(module).__name__}.forward{sig}: {exc}. The inputs are pipeline_inputs("
            "batch) when the module defines it, else the batch entries its step passes to "
            "self(...) where setup could read them, else batch[0] of a tuple or list batch, else "
            "the batch itself (of a dict batch, the entries that name forward's parameters, "
            "as keyword arguments); define pipeline_inputs(self, batch) returning the tensors "
            "forward takes (e.g. batch['x'], or a dict of them keyed by forward's parameter "
            "names): only tensors cross pipeline stages"
        ) from None


def _batch_like(module: Any, batch: Any, example: Any) -> Any:
    """``batch`` cut to the example's sample count if its inputs then match the example's
    shapes (so the loss's targets fit the outputs of the example), else None."""
    from lightning_autopipe.runtime.local_stage import as_call_args, model_inputs
    from lightning_autopipe.runtime.units import slice_batch

    if batch is None:
        return None
    ex = _tensors(example)
    got = _tensors(as_call_args(model_inputs(module, batch)))
    if not ex or len(ex) != len(got) or ex[0].dim() == 0 or got[0].dim() == 0:
        return None
    n, size = int(ex[0].shape[0]), int(got[0].shape[0])
    if n > size:
        return None
    part = slice_batch(batch, 0, n, size)
    got = _tensors(as_call_args(model_inputs(module, part)))
    if [t.shape for t in got] != [t.shape for t in ex]:
        return None
    return part


def _tensors(args: Any) -> list[Tensor]:
    values = args.values() if isinstance(args, dict) else args
    return [v for v in values if isinstance(v, Tensor)]


def _eval_loop(trainer: Any) -> Any:
    if trainer.state.fn == TrainerFn.VALIDATING:
        return trainer.validate_loop
    if trainer.state.fn == TrainerFn.PREDICTING:
        return trainer.predict_loop
    return trainer.test_loop
