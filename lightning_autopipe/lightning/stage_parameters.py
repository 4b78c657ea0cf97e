"""A hook that reads ``self.parameters()`` on a split model sees one stage's: said once.

Under the pipeline each rank holds its stage's parameters only (the others are released), so
code that works over "all the parameters" in one process covers one stage here, with no
error: a loss term over them in ``training_step`` (an L2 penalty), a norm over their
gradients in ``on_before_optimizer_step`` (``torch.nn.utils.clip_grad_norm_``, Lightning's
``grad_norm``), which clips or logs by the stage's norm instead of the model's.
:func:`parameters_read_warned` warns once per hook where such a hook reads them, naming what
works instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

__all__ = ["CLIPPING", "gradient_hooks_warned", "parameters_read_warned"]

_NAMES = ("parameters", "named_parameters")


@contextmanager
def _wrapped(module: Any, names: list[str], wrap: Callable[[str, Any], Any]) -> Iterator[None]:
    """Inside the block the module's methods ``names`` are ``wrap(name, method)`` (set on the
    instance); after it, what the instance held before (the class's methods, usually)."""
    own = {name: module.__dict__[name] for name in names if name in module.__dict__}
    for name in names:
        module.__dict__[name] = wrap(name, getattr(module, name))
    try:
        yield
    finally:
        for name in names:
            module.__dict__.pop(name, None)
        module.__dict__.update(own)


@contextmanager
def parameters_read_warned(module: nn.Module, hook: str, consequence: str,
                           warned: set[str]) -> Iterator[None]:
    """Inside the block ``module.parameters()`` / ``named_parameters()`` warn once (``hook``
    not yet in ``warned``, which records it) that ``hook`` sees this rank's stage's only;
    ``consequence``: what that breaks and what to use instead."""
    def warning(name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if hook not in warned:
                warned.add(hook)
                warnings.warn(
                    f"{hook} calls self.{name}(): under AutoPipeStrategy this rank holds only "
                    f"its stage's parameters (the others' are released here), so {consequence}",
                    UserWarning, stacklevel=2)
            return method(*args, **kwargs)
        return call

    with _wrapped(module, [] if hook in warned else list(_NAMES), warning):
        yield


#: What a gradient norm over ``self.parameters()`` in an optimizer-step hook is here.
CLIPPING = ("a norm over their gradients (torch.nn.utils.clip_grad_norm_, Lightning's "
            "grad_norm) is this stage's, not the model's: clip by the model's norm with "
            "Trainer(gradient_clip_val=..., gradient_clip_algorithm=\"norm\"), which the strategy "
            "takes over every stage; the model's norm is "
            "trainer.strategy.pipeline.executor.global_grad_norm() (called on every rank)")


@contextmanager
def gradient_hooks_warned(module: Any, split: bool, warned: set[str]) -> Iterator[None]:
    """Around Lightning's optimizer step: while the module's own ``on_after_backward``,
    ``on_before_optimizer_step`` or ``configure_gradient_clipping`` runs (not its
    ``training_step``, which the step's closure runs too), reading ``self.parameters()`` of a
    ``split`` model is warned once (:data:`CLIPPING`)."""
    hooks = [h for h in ("on_after_backward", "on_before_optimizer_step",
                         "configure_gradient_clipping")
             if split and module is not None and is_overridden(h, module, LightningModule)]

    def watched(hook: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with parameters_read_warned(module, hook, CLIPPING, warned):
                return method(*args, **kwargs)
        return call

    with _wrapped(module, hooks, watched):
        yield
