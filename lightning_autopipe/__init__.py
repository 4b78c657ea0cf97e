"""lightning_autopipe: heterogeneity-aware data-parallel pipeline training for Lightning."""

from lightning_autopipe.errors import (
    AutoPipeError,
    BlockRangeError,
    ClusterError,
    InputError,
    MemoryPlanError,
    PipelineRuntimeError,
    PlanError,
    ScheduleError,
    TraceError,
)
from lightning_autopipe.graph import BlockGraph, split_model
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.profile import BlockProfile, Profile, profile_blocks
from lightning_autopipe.strategy import AutoPipeStrategy, _register

# Lightning strategies have no entry points: importing the package registers "autopipe".
_register()

__all__ = [
    "AutoPipeError",
    "AutoPipeStrategy",
    "BlockGraph",
    "BlockProfile",
    "BlockRangeError",
    "ClusterError",
    "InputError",
    "MemoryPlanError",
    "PipelineRuntimeError",
    "Plan",
    "PlanError",
    "Profile",
    "ScheduleError",
    "StagePlan",
    "TraceError",
    "profile_blocks",
    "split_model",
]
__version__ = "0.1.0"
