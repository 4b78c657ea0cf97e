"""Graph side: trace a model, cut it into blocks, build stage modules for block ranges."""

from lightning_autopipe.graph.blocks import BlockGraph, split_model
from lightning_autopipe.graph.stage import StageIO, StageModule, TieGroup, ValueInfo

__all__ = ["BlockGraph", "StageIO", "StageModule", "TieGroup", "ValueInfo", "split_model"]
