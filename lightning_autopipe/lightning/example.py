"""Example inputs for profiling and planning, drawn from the Trainer's dataloader or the module.

Setup must trace, profile and plan the model before the first step, so it needs forward inputs of
the real shapes, the replica batch size that sizes the plan, and (when one was drawn anyway) a
batch whose samples match the example so the profile can include ``pipeline_loss``.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_autopipe.errors import InputError, PlanError


def _example(trainer: Any, module: Any) -> tuple[Any, int, Any]:
    """Example forward inputs (``example_input_array`` or the first batch), the batch size and
    the batch holding the example's samples (or None).

    The batch size is the dataloader's (one data-parallel replica's batch); it sizes the plan.
    The third value lets the profile include ``pipeline_loss``: the first batch when the
    example came from it, or its first samples when they match ``example_input_array``'s
    shapes; None when no batch was drawn (a loader batch size and ``example_input_array`` need
    none, and drawing one only for the profile would consume a one-pass stream's data).
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
    if example is None or not size:
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise PlanError("the dataloader is empty; AutoPipeStrategy needs a batch") from None
        inputs = as_call_args(model_inputs(module, batch))
        _check_forward(module, inputs, "the first batch of the dataloader")
        first = next(iter(inputs.values() if isinstance(inputs, dict) else inputs))
        size = size or int(first.shape[0])
        if example is None:
            return inputs, int(size), batch
    example = as_call_args(example)
    _check_forward(module, example, "example_input_array")
    return example, int(size), _batch_like(module, batch, example)


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
            "batch) when the module defines it, else batch[0] of a tuple or list batch, else "
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
