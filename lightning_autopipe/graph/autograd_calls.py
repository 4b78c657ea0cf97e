"""Calls of ``torch.autograd.Function`` in a model, as the tracers must see them.

A tracer records what a forward computes, not how its backward is defined. Two kinds of call
would make the split model train differently from the model:

* The reentrant ``torch.utils.checkpoint(fn, *args, use_reentrant=True)`` (what Hugging
  Face's ``gradient_checkpointing_enable`` used by default, and what much fine-tuning code
  still asks for) is an autograd function whose forward runs ``fn`` under
  ``torch.no_grad()`` and whose backward runs it again with gradients. Traced, the no-grad
  region stays (torch.export keeps it as ``wrap_with_set_grad_enabled(False, ...)``): those
  layers compute without gradients, their weights never learn, or the backward fails with
  "element 0 of tensors does not require grad". While a model is traced, the reentrant form
  runs ``fn`` directly, so the graph holds the layers' plain computation (what the model
  computes). The pipeline does not keep it as recomputation: the planner decides per stage
  whether to recompute, by the memory the plan needs (``Plan.recompute``).
* A model's own autograd function (a straight-through estimator, a gradient reversal layer, a
  fused operation) has a backward of its own that differs from the gradient of its forward's
  operations. torch.fx records such a call as one node calling the function
  (:func:`own_functions_as_calls`), so the stage runs it and its backward. torch.export
  cannot keep it (its graph holds the forward's operations): where a model captured by
  torch.export applies one (:func:`own_functions_met`), the graph's gradients are compared
  with the model's on the example inputs (:func:`gradient_difference`), and a graph that would
  train with other gradients is refused, naming the function, rather than trained.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.autograd import Function
from torch.utils import checkpoint as _checkpoint

__all__ = ["gradient_difference", "own_functions_as_calls", "own_functions_met",
           "reentrant_checkpoints_traced_plain"]

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


def _own(cls: type) -> bool:
    """A function the model brings (torch's own are traced as torch designed them)."""
    return not (cls.__module__ or "").startswith("torch.")


@contextmanager
def _applying(hook: Callable[[type, tuple, dict], Any]) -> Iterator[None]:
    """Inside the block, ``SomeFunction.apply(...)`` of a model's own autograd function calls
    ``hook(cls, args, kwargs)``; the hook returns ``NotImplemented`` to apply it as usual."""
    original = vars(Function)["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _own(cls):
            out = hook(cls, args, kwargs)
            if out is not NotImplemented:
                return out
        return original.__get__(None, cls)(*args, **kwargs)

    with _LOCK:
        Function.apply = classmethod(apply)
    try:
        yield
    finally:
        with _LOCK:
            Function.apply = original


def _caller(cls: type) -> Callable[..., Any]:
    """A plain function applying ``cls``: what a graph node can name (fx's generated code
    holds it as a global), so the stage applies the function and autograd runs its backward."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return cls.apply(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"apply_{cls.__name__}"
    call.__module__ = cls.__module__
    return call


@contextmanager
def own_functions_as_calls() -> Iterator[None]:
    """While torch.fx traces: a model's own autograd function applied to traced values
    becomes one ``call_function`` node (fx would otherwise record its forward's operations)."""
    callers: dict[type, Callable[..., Any]] = {}

    def hook(cls: type, args: tuple, kwargs: dict) -> Any:
        proxies = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, fx.Proxy)]
        if not proxies:
            return NotImplemented
        call = callers.setdefault(cls, _caller(cls))
        return proxies[0].tracer.create_proxy("call_function", call, args, kwargs)

    with _applying(hook):
        yield


@contextmanager
def own_functions_met() -> Iterator[list[str]]:
    """While torch.export traces: the names of the model's own autograd functions applied
    (export keeps their forward only), in the order met."""
    met: list[str] = []

    def hook(cls: type, args: tuple, kwargs: dict) -> Any:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name not in met:
            met.append(name)
        return NotImplemented

    with _applying(hook):
        yield met


def gradient_difference(model: nn.Module, exported: nn.Module,
                        run: Callable[[nn.Module], Any]) -> str | None:
    """Where ``exported``'s parameter gradients differ from ``model``'s on one pass, or None.

    Some functions' backward *is* the gradient of their forward (Hugging Face BLOOM's GeLU,
    written as an autograd function for speed); an exported graph of such a model trains as
    the model does. Both run ``run`` (a forward on the example inputs) from the same random
    state, and back-propagate the outputs weighted by fixed random numbers (a plain sum can
    have no gradient: softmax outputs sum to one). A parameter's gradients differ where the
    norm of their difference passes :func:`_tolerance` of its norm: rounding in another order
    stays far below it (bfloat16's too), a function whose backward is another (a
    straight-through estimator, a reversed gradient) is off by about the whole norm. The
    caller keeps the buffers.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    kept = {n: p.grad for n, p in model.named_parameters()}
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})

    def grads(module: nn.Module) -> dict[str, torch.Tensor]:
        params = dict(module.named_parameters(remove_duplicate=False))
        for p in params.values():
            p.grad = None
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            out = run(module)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        weights = torch.Generator().manual_seed(0)
        if leaves:
            sum((t.float() * torch.randn(t.shape, generator=weights).to(t.device)).sum()
                for t in leaves).backward()
        found = {n: params[n].grad for n in names if n in params}
        for p in params.values():
            p.grad = None
        return found

    try:
        want, got = grads(model), grads(exported)
    finally:
        for n, p in model.named_parameters():
            p.grad = kept[n]
    for name in names:
        a, b = want.get(name), got.get(name)
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a.float()
        b = torch.zeros_like(a) if b is None else b.float()
        size, off = float(a.norm()), float((a - b).norm())
        if off > _tolerance(want.get(name, got.get(name))) * max(size, 1e-12):
            return (f"{name}'s gradient differs by {off:.3g} in norm (its norm is "
                    f"{size:.3g})")
    return None


def _tolerance(grad: torch.Tensor | None) -> float:
    """The relative difference in norm that rounding may leave: 0.1% in float32 and wider,
    32 units of the last place in narrower types (bfloat16: 25%)."""
    dtype = grad.dtype if grad is not None else torch.float32
    return min(0.25, max(1e-3, 32 * torch.finfo(dtype).eps)) if dtype.is_floating_point \
        else 1e-3
