"""Put ``"autopipe"`` in Lightning's strategy registry as soon as Lightning is loaded.

Lightning strategies have no entry points, so importing this package must register the
strategy. Registering at once would import torch and Lightning with every submodule, though the
planner and the profile data type need neither; so ``lightning.pytorch`` is watched instead:
the strategy is registered now when it is loaded, else right after it has finished loading
(before any ``Trainer`` can exist).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["register", "register_when_lightning_loads"]

_WATCHED = "lightning.pytorch"


def register() -> None:
    """Register ``"autopipe"`` (idempotent), without importing the strategy yet.

    The registry holds a factory, so registering imports nothing of ours: it may run while this
    package's own modules are still being imported (one of them importing Lightning is what
    triggers it). Lightning calls the factory when a ``Trainer(strategy="autopipe")`` is built.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    StrategyRegistry.register(
        "autopipe",
        _autopipe,
        description="AutoPipe-H: heterogeneity-aware data-parallel pipeline",
        override=True,
    )


def _autopipe(**options: Any) -> Any:
    from lightning_autopipe.lightning.strategy import AutoPipeStrategy

    return AutoPipeStrategy(**options)


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` through the other finders and registers once it has run.

    It stays installed until the module has really been executed: a bare
    ``importlib.util.find_spec`` (an availability check) builds a spec that is never run.
    """

    def __init__(self) -> None:
        self._searching = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _WATCHED or self._searching:
            return None
        self._searching = True
        try:
            spec = _find_with_others(self, fullname, path, target)
        finally:
            self._searching = False
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            vars(loader).pop("exec_module", None)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            register()

        loader.exec_module = exec_module
        return spec


def _find_with_others(
    me: object, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if finder is me or find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def register_when_lightning_loads() -> None:
    """Register now if ``lightning.pytorch`` is loaded, else as soon as it is."""
    if _WATCHED in sys.modules:
        register()
    elif not any(isinstance(f, _AfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())
