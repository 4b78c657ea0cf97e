"""Python numbers a capture keeps: module attributes that change after the graph was captured.

Tracing runs ``forward`` once; a plain Python number it reads from a module
(``h / self.temperature``, ``self.alpha * new + (1 - self.alpha) * old``) becomes a constant
of the graph. Code that anneals such a number during training (a temperature schedule, a
progressive-growing ``alpha``, a curriculum flag) changes what one process computes, while
every stage goes on computing with the captured value: the run trains another model and says
nothing. Which attributes ``forward`` read is not recorded by the tracers, so
:func:`numbers_of` keeps every number the modules hold when the graph is captured and
:func:`changed_numbers` names those that changed since, for a warning that says how to make
the value one the stages read at run time (a tensor buffer updated in place).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from torch import nn

__all__ = ["CapturedNumber", "changed_numbers", "numbers_of"]

#: attributes every module has whose changes the stages follow themselves (:mod:`~.modes`)
_FOLLOWED = frozenset({"training"})


@dataclass(frozen=True)
class CapturedNumber:
    """One number a module held when the graph was captured."""

    module: nn.Module
    path: str  # the attribute's name from the captured model, e.g. ``net.temperature``
    attribute: str
    value: int | float | bool


def numbers_of(model: nn.Module, called: Collection[str] = ()) -> list[CapturedNumber]:
    """Every public ``int``/``float``/``bool`` attribute of ``model``'s submodules, now, but
    those of the modules ``called`` (paths): a torch.fx graph calls such a module
    (``dropout.p``, a BatchNorm's ``track_running_stats``), which reads its attributes when it
    runs. ``model``'s own are left out: on a LightningModule they are mostly what its steps
    read (a loss weight annealed by a hook), not its ``forward``."""
    out = []
    for name, module in model.named_modules():
        if name in called or not name:
            continue
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or attribute in _FOLLOWED:
                continue
            if type(value) in (int, float, bool):
                out.append(CapturedNumber(module, f"{name}.{attribute}", attribute, value))
    return out


def changed_numbers(numbers: list[CapturedNumber]) -> list[tuple[CapturedNumber, object]]:
    """Those of ``numbers`` whose module now holds another value, with that value."""
    return [(n, now) for n in numbers
            if _differs(now := vars(n.module).get(n.attribute, n.value), n.value)]


def _differs(now: object, then: object) -> bool:
    if type(now) is not type(then):  # first: a tensor would compare elementwise
        return True
    return now != then and not (now != now and then != then)  # a NaN that stays NaN
