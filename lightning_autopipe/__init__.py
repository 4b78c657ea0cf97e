"""lightning_autopipe: heterogeneity-aware data-parallel pipeline training for Lightning.

The names below are loaded on first use, so the planner and the profile data type can be used
without importing torch; ``"autopipe"`` joins Lightning's strategy registry as soon as
``lightning.pytorch`` is loaded (see ``_registry``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_autopipe.errors import (
    AutoPipeError,
    BlockRangeError,
    CheckpointReadError,
    ClusterError,
    InputError,
    MemoryPlanError,
    PipelineRuntimeError,
    PlanError,
    ScheduleError,
    StepContractError,
    TraceError,
    UnsafeCheckpointError,
)
from lightning_autopipe.lightning._registry import register_when_lightning_loads

if TYPE_CHECKING:
    from lightning_autopipe.graph import BlockGraph, split_model
    from lightning_autopipe.lightning.strategy import AutoPipeStrategy
    from lightning_autopipe.planner.plan import Plan, StagePlan
    from lightning_autopipe.profile import BlockProfile, Profile
    from lightning_autopipe.runtime.profiler import profile_blocks

_LAZY = {
    "AutoPipeStrategy": "lightning_autopipe.lightning.strategy",
    "BlockGraph": "lightning_autopipe.graph",
    "BlockProfile": "lightning_autopipe.profile",
    "Plan": "lightning_autopipe.planner.plan",
    "Profile": "lightning_autopipe.profile",
    "StagePlan": "lightning_autopipe.planner.plan",
    "profile_blocks": "lightning_autopipe.runtime.profiler",
    "split_model": "lightning_autopipe.graph",
}


def __getattr__(name: str) -> Any:
    """A name of ``__all__`` or a submodule (``lightning_autopipe.checkpoint``), on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# Lightning strategies have no entry points: importing the package registers "autopipe".
register_when_lightning_loads()

__all__ = [
    "AutoPipeError",
    "AutoPipeStrategy",
    "BlockGraph",
    "BlockProfile",
    "BlockRangeError",
    "CheckpointReadError",
    "ClusterError",
    "InputError",
    "MemoryPlanError",
    "PipelineRuntimeError",
    "Plan",
    "PlanError",
    "Profile",
    "ScheduleError",
    "StagePlan",
    "StepContractError",
    "TraceError",
    "UnsafeCheckpointError",
    "profile_blocks",
    "split_model",
]
__version__ = "0.1.0"
