"""Activation recomputation of one stage: its forward keeps only its inputs, its backward
runs the forward again.

The planner chooses it for a stage only when nothing fits device memory otherwise (it costs
that stage one more forward per unit, :mod:`~lightning_autopipe.planner.pricing`). Built on
``torch.utils.checkpoint`` (non-reentrant): the recomputed forward replays the random state
of the original one (dropout masks included), so the gradients are those of the stage run
without recomputation and the pipeline still equals one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recomputed"]


class Recomputed(nn.Module):
    """``stage`` with its activations recomputed in backward (its parameters are its own)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation saves nothing anyway
            return self.stage(*inputs)
        return checkpoint(self.stage, *inputs, use_reentrant=False, preserve_rng_state=True)
