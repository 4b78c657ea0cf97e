"""The pipeline runtime: process groups, point-to-point framing, the schedule executor."""

from lightning_autopipe.runtime.executor import PipelineExecutor, TiedParameter
from lightning_autopipe.runtime.groups import (
    ProcessGroups,
    RankLayout,
    build_groups,
    destroy_groups,
    layout_for_rank,
)

__all__ = [
    "PipelineExecutor",
    "ProcessGroups",
    "RankLayout",
    "TiedParameter",
    "build_groups",
    "destroy_groups",
    "layout_for_rank",
]
