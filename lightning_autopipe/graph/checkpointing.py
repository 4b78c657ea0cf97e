"""A model's own reentrant activation checkpointing, as the tracers must see it.

``torch.utils.checkpoint(fn, *args, use_reentrant=True)`` (what Hugging Face's
``gradient_checkpointing_enable`` used by default, and what much fine-tuning code still asks
for) is an autograd function whose forward runs ``fn`` under ``torch.no_grad()`` and whose
backward runs it again with gradients. A tracer records the forward only: torch.export keeps
the no-grad region as a ``wrap_with_set_grad_enabled(False, ...)`` call, so the stage built from
the graph computes those layers without gradients: their weights would never learn, or the
backward fails with "element 0 of tensors does not require grad". While a model is traced,
the reentrant form runs ``fn`` directly instead, so the graph holds the layers' plain
computation, which is what the model computes; the non-reentrant form traces as it is.

The pipeline does not keep the model's checkpointing as recomputation: the planner decides
per stage whether to recompute, by the memory the plan needs (``Plan.recompute``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils import checkpoint as _checkpoint

__all__ = ["reentrant_checkpoints_traced_plain"]

_LOCK = threading.Lock()
_DEPTH = 0


@contextmanager
def reentrant_checkpoints_traced_plain(model_name: str) -> Iterator[None]:
    """Inside the block, a reentrant ``torch.utils.checkpoint`` call runs its function plainly
    (with gradients), and a warning says once that the model's checkpointing was met."""
    global _DEPTH
    met = []

    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        met.append(True)
        return function(*args)

    cls = _checkpoint.CheckpointFunction
    own = vars(cls).get("apply")  # None: inherited from autograd.Function
    with _LOCK:
        _DEPTH += 1
        outer = _DEPTH > 1
        if not outer:
            cls.apply = apply  # a plain function as a class attribute: called unbound
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if not outer:
                if own is None:
                    del cls.apply
                else:
                    cls.apply = own
    if met:
        warnings.warn(
            f"{model_name} checkpoints activations with torch.utils.checkpoint(use_reentrant="
            "True), whose forward runs without gradients where it is traced; the pipeline's "
            "graph computes those layers plainly (with gradients), and the planner recomputes "
            "a stage's activations where the plan's memory needs it (Plan.recompute). To keep "
            "the warning away, disable the model's checkpointing (Hugging Face: "
            "gradient_checkpointing_disable()) or use use_reentrant=False",
            UserWarning, stacklevel=4)
