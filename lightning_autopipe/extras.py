"""Optional dependencies: a feature that needs a package outside the core install says which extra.

The strategy library needs torch and Lightning only; Hydra configs, timeline pictures, Hugging
Face models and the torchvision zoo come with ``pip install "lightning_autopipe[recipes]"``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from lightning_autopipe.errors import MissingExtraError

__all__ = ["EXTRAS", "import_extra"]

#: The pip distribution and extra that brings each optional top-level module.
EXTRAS: dict[str, tuple[str, str]] = {
    "hydra": ("hydra-core", "recipes"),
    "omegaconf": ("hydra-core", "recipes"),
    "matplotlib": ("matplotlib", "recipes"),
    "transformers": ("transformers", "recipes"),
    "torchvision": ("torchvision", "recipes"),
}


def import_extra(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRAS` or a submodule of one) for ``feature``.

    Raises:
        MissingExtraError: the package is not installed; the message names the extra to install.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but one of *its* imports failed: not ours to rename
        dist, extra = EXTRAS.get(top, (top, "recipes"))
        raise MissingExtraError(
            f"{feature} needs {dist!r}, which is not installed: "
            f'pip install "lightning_autopipe[{extra}]" (or pip install {dist})'
        ) from exc
