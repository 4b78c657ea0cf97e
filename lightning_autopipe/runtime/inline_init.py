"""Record how inline code builds a parameter's data, to replay it at materialisation.

GPT code often makes a parameter inline in ``__init__``: ``self.pos =
nn.Parameter(torch.zeros(T, D))``, ``nn.Parameter(torch.randn(D) * 0.02)``. On the meta device
the value is lost and no initialiser (``reset_parameters``, ``_init_weights``) re-creates it.
torchdistx's ``deferred_init`` answers this by recording every tensor operation of the
construction on fake tensors and replaying it. This module does the small part a pipeline
needs: while a model is built (:class:`FactoryRecorder`, a ``TorchFunctionMode``), every
tensor an operation returns carries a :class:`Recipe` (the operation and its arguments, tensor
arguments by their own recipes) when all its tensor inputs have one (or are small constants);
an in-place operation replaces its tensor's recipe by one applied to the previous.
``nn.Parameter(data)`` keeps ``data``'s recipe, and :func:`replay` re-runs it for one
parameter (on the CPU, from whatever generator state the caller seeded) and copies the value
in. A recipe made of ``torch.empty`` alone writes nothing and is not replayed (the layer's
``reset_parameters`` does the work). Not covered: writes through a view of the tensor
(``p.data[0] = 1``) and explicit ``generator=`` arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["FactoryRecorder", "Recipe", "replay"]

_RECIPE = "_autopipe_recipe"
_EMBED_BYTES = 1 << 16  # an unrecorded real tensor input this small is kept by value
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@dataclass(frozen=True)
class _Ref:
    recipe: Recipe


@dataclass(frozen=True)
class Recipe:
    """One recorded operation: ``func(*args, **kwargs)``, tensors as :class:`_Ref` s."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    writes: bool  # False: the value is uninitialised memory (``torch.empty``)

    def evaluate(self) -> Tensor:
        def value(v: Any) -> Any:
            if isinstance(v, _Ref):
                return v.recipe.evaluate()
            if isinstance(v, Tensor):
                return v.clone()
            return v

        args = pytree.tree_map(value, self.args, is_leaf=lambda v: isinstance(v, _Ref))
        kwargs = pytree.tree_map(value, self.kwargs, is_leaf=lambda v: isinstance(v, _Ref))
        if "device" in kwargs:
            kwargs["device"] = "cpu"  # replayed on the CPU, then copied where the stage lives
        with torch.no_grad():
            return self.func(*args, **kwargs)


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", "")).lower()


def recipe_of(t: Any) -> Recipe | None:
    return t.__dict__.get(_RECIPE) if isinstance(t, Tensor) else None


class FactoryRecorder(TorchFunctionMode):
    """While active, tensors that operations return carry their :class:`Recipe`; so do
    parameters made from them (``nn.Parameter.__new__`` is wrapped for as long)."""

    def __enter__(self) -> FactoryRecorder:
        self._new = nn.Parameter.__new__
        original = self._new

        def new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
            p = original(cls, data, requires_grad)
            recipe = recipe_of(data)
            if recipe is not None:
                p.__dict__[_RECIPE] = recipe
            return p

        nn.Parameter.__new__ = new  # type: ignore[method-assign]
        try:
            return super().__enter__()
        except BaseException:
            nn.Parameter.__new__ = original  # type: ignore[method-assign]
            raise

    def __exit__(self, *exc: Any) -> None:
        nn.Parameter.__new__ = self._new  # type: ignore[method-assign]
        super().__exit__(*exc)

    def recipe_of(self, t: Any) -> Recipe | None:
        return recipe_of(t)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, Tensor) and out.device.type != "meta":
            recipe = self._recipe(func, args, kwargs)
            if recipe is None:
                out.__dict__.pop(_RECIPE, None)
            else:
                out.__dict__[_RECIPE] = recipe
        return out

    @staticmethod
    def _recipe(func: Any, args: Any, kwargs: dict[str, Any]) -> Recipe | None:
        ok = True
        writes = _name(func) not in _EMPTY
        inplace = _name(func).endswith("_")

        def ref(v: Any) -> Any:
            nonlocal ok, writes
            if not isinstance(v, Tensor):
                return v
            recipe = recipe_of(v)
            if recipe is not None:
                writes = writes and (recipe.writes or inplace)
                return _Ref(recipe)
            if v.device.type == "meta" or v.numel() * v.element_size() > _EMBED_BYTES:
                ok = False
                return None
            return v.detach().clone()  # a small constant (a torch.tensor([...]) literal)

        a = pytree.tree_map(ref, tuple(args))
        k = pytree.tree_map(ref, dict(kwargs))
        if not ok:
            return None
        return Recipe(func, a, k, writes=writes or inplace)


def replay(recipe: Recipe, target: Tensor) -> bool:
    """Write ``recipe``'s value into ``target``; False when it writes nothing (``empty``) or
    its value does not fit ``target`` (then the initialisers must)."""
    if not recipe.writes:
        return False
    try:
        value = recipe.evaluate()
    except Exception:  # noqa: BLE001 - an operation that cannot be re-run: the initialisers decide
        return False
    if not isinstance(value, Tensor) or tuple(value.shape) != tuple(target.shape):
        return False
    with torch.no_grad():
        target.copy_(value)
    return True
