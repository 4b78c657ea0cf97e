"""What a step's ``self(...)`` call must agree with under the pipeline.

The last stage answers a step's ``self(...)`` with the outputs the pipeline computed from the
slice's model inputs; the call's own arguments are not run. So the call must name those inputs
(:func:`check_call`) and, for every other argument of ``forward``, the value the graph was
captured with (:func:`check_constants`); otherwise the step would read outputs of another
computation than the one it asked for.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_autopipe.errors import StepContractError

__all__ = ["check_call", "check_constants", "tensors_in"]


def tensors_in(obj: Any) -> list[Tensor]:
    """The tensors of a (nested) collection, in order."""
    found: list[Tensor] = []
    apply_to_collection(obj, Tensor, found.append)
    return found


def check_call(hook: str, call: Any, expected: list[Tensor]) -> None:
    """``self(...)`` must be called on the slice's model inputs (their shapes, at least)."""
    got = sorted(tuple(t.shape) for t in tensors_in(call))
    want = sorted(tuple(t.shape) for t in expected)
    if got != want:
        raise StepContractError(
            f"{hook} called self(...) on tensors of shapes {got}, but the pipeline ran the model "
            f"on this slice's inputs of shapes {want} (pipeline_inputs(self, batch) when "
            "defined, else the batch entries the step passed to self(...) at setup where each "
            "was an entry of the batch itself, else batch[0] for a tuple/list batch, else the "
            "batch); define pipeline_inputs(self, batch) to return exactly what the step "
            "passes to self(...)"
        )


def check_constants(hook: str, forward: Any, args: tuple, kwargs: dict) -> None:
    """The step's other arguments to ``self(...)`` must be what the graph was captured with.

    Only tensors reach the pipeline's graph; a parameter of ``forward`` that is given no tensor
    was traced at its default (``self(x, scale=2.0)`` for ``forward(self, x, scale=1.0)`` would
    otherwise train the model at ``scale=1.0``, with no error). A default of None often means
    "as configured" (Hugging Face's ``return_dict=None``), which the given value may equal: it
    is warned of instead. Arguments of ``*args`` / ``**kwargs`` have no default to compare
    with and pass.
    """
    try:
        sig = inspect.signature(forward)
        bound = sig.bind(None, *args, **kwargs).arguments
    except (TypeError, ValueError):  # the call does not fit: forward itself would say so
        return
    for name, value in list(bound.items())[1:]:
        param = sig.parameters[name]
        if (param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or tensors_in(value)
                or param.default is inspect.Parameter.empty or _same_value(value, param.default)):
            continue
        if param.default is None:  # often "as configured" (Hugging Face's return_dict=None)
            warnings.warn(
                f"{hook} calls self(...) with {name}={value!r}, but the pipeline's graph was "
                f"captured with forward's default {name}=None: only tensors reach the "
                "pipeline's stages, so the outputs are those of the default; where the two "
                f"compute differently, make {name}={value!r} forward's default",
                UserWarning, stacklevel=4)
            continue
        raise StepContractError(
            f"{hook} called self(...) with {name}={value!r}, but the pipeline's graph was "
            f"captured with forward's default {name}={param.default!r}: only tensors reach the "
            "pipeline's stages, so every other argument keeps the value the model was traced "
            f"with. Make {name}={value!r} forward's default, or keep it on the module (an "
            "attribute set in __init__) and read it in forward"
        )


def _same_value(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - a value that cannot compare is another value
        return False
