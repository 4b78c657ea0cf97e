"""What torch.fx runs at trace time without recording it, found while it traces.

``fx.symbolic_trace`` runs the forward's Python once with proxies in place of tensors. What
touches no proxy runs then, for real, and is not in the graph: a switch of autograd or
autocast mode (``torch.no_grad()``, ``torch.autocast``) and an update of a buffer by a value
that reads no input. A split made from that graph would compute something else than the model
with no error, so :func:`watch_unrecorded` turns either into :class:`Unrecorded` and the
tracer moves on to ``torch.export``, which records both (:mod:`~.trace`). A branch on
``self.training`` (``if self.training:``, ``F.dropout(x, p, training=self.training)``) is
decided at trace time too: :func:`mode_difference` finds it (neither tracer records it).
Also here: fx's immutable output containers made plain again (:func:`plain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

__all__ = ["Unrecorded", "mode_difference", "plain", "watch_unrecorded"]


class Unrecorded(Exception):
    """torch.fx ran part of the forward eagerly instead of recording it (see
    :func:`watch_unrecorded`): its graph would compute something else than the model."""


#: context managers whose switch of autograd or autocast mode torch.fx runs at trace time
#: without recording it: the graph would differentiate a ``no_grad`` section, or compute an
#: ``autocast`` section in the inputs' precision
_MODE_SWITCHES = (
    (torch.autograd.grad_mode.no_grad, "__enter__", "torch.no_grad()"),
    (torch.autograd.grad_mode.enable_grad, "__enter__", "torch.enable_grad()"),
    (torch.autograd.grad_mode.set_grad_enabled, "__init__", "torch.set_grad_enabled(...)"),
    (torch.autograd.grad_mode.inference_mode, "__enter__", "torch.inference_mode()"),
    (torch.amp.autocast_mode.autocast, "__enter__", "torch.autocast(...)"),
)


@contextmanager
def watch_unrecorded(model: nn.Module) -> Iterator[None]:
    """Raise :class:`Unrecorded` when the forward switches autograd / autocast mode or
    updates a buffer while torch.fx traces it.

    symbolic_trace runs the forward's Python with proxies: a mode switch and an update of a
    buffer by a value that does not depend on the inputs (``self.steps.add_(1)``) happen
    once, at trace time, and are missing from the graph, so the split model would silently
    train differently. ``torch.export`` records both; ``tracer="auto"`` moves on to it.
    The buffers are restored to their values before the trace.
    """
    seen: list[str] = []
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in _MODE_SWITCHES]

    def watching(original: Callable[..., Any], what: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(what)
            return original(*args, **kwargs)
        return call

    buffers = [(n, b, b.detach().clone()) for n, b in model.named_buffers()
               if b is not None and b.device.type != "meta"]
    for (cls, name, original), (_, _, what) in zip(saved, _MODE_SWITCHES):
        setattr(cls, name, watching(original, what))
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)
        changed = [n for n, b, before in buffers if not _same(b, before)]
        with torch.no_grad():
            for _, b, before in buffers:
                b.copy_(before)
    if seen:
        raise Unrecorded(f"the forward enters {seen[0]}, which torch.fx runs once while "
                          "tracing instead of recording it in the graph")
    if changed:
        raise Unrecorded(f"the forward updates buffer {changed[0]!r} by a value that does not "
                          "depend on the inputs, which torch.fx runs once while tracing "
                          "instead of recording it in the graph")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b) or (
        a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(), b.nan_to_num())))


def plain(value: Any) -> Any:
    """An fx output structure with fx's immutable lists and dicts made plain again, so the
    split model returns a ``list`` / ``dict`` where the model does."""
    if isinstance(value, fx.immutable_collections.immutable_list):
        return [plain(v) for v in value]
    if isinstance(value, fx.immutable_collections.immutable_dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return type(value)((k, plain(v)) for k, v in value.items())
    return value


def mode_difference(model: nn.Module, traced: fx.GraphModule,
                    trace_again: Callable[[], fx.GraphModule]) -> str | None:
    """Where the forward computes differently in the other mode (``eval()`` when ``traced``
    was captured in training mode, and the reverse), or None.

    The graph holds the mode it was traced in as constants: a stage's ``train()`` / ``eval()``
    switches its ``nn.Dropout`` and ``nn.BatchNorm`` modules, but not a Python branch on
    ``self.training`` nor ``F.dropout(..., training=self.training)``. The forward is traced
    once more with every module in the other mode and the two graphs' code compared; the
    first line that differs (in the traced mode's graph) is returned.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.train(not model.training)
    try:
        other = trace_again()
    except Exception:  # noqa: BLE001 - the other mode cannot be traced: nothing to compare
        return None
    finally:
        for m, mode in modes:
            m.training = mode
    mine, theirs = traced.code.strip().splitlines(), other.code.strip().splitlines()
    if mine == theirs:
        return None
    differing = [a for a, b in zip(mine, theirs) if a != b]
    shorter = min(len(mine), len(theirs))
    return (differing[0] if differing else (mine + theirs[shorter:])[shorter]).strip()
