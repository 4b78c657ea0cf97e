"""Activation recomputation of one stage: its forward keeps only its inputs, its backward
runs the forward again.

The planner chooses it for a stage only when nothing fits device memory otherwise (it costs
that stage one more forward per unit, :mod:`~lightning_autopipe.planner.pricing`). Built on
``torch.utils.checkpoint`` (non-reentrant): the recomputed forward replays the random state
of the original one (dropout masks included), so the gradients are those of the stage run
without recomputation and the pipeline still equals one process.

While a :class:`~lightning_autopipe.runtime.memory.MemoryMeter` measures a step on the CPU,
checkpoint gets the meter's recompute context (``context_fn``), which counts what the
backward re-creates; in any other step, and while compiling, checkpoint runs as without a
meter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_autopipe.runtime.memory import MemoryMeter

__all__ = ["Recomputed"]


class Recomputed(nn.Module):
    """``stage`` with its activations recomputed in backward (its parameters are its own).

    Args:
        stage: the stage module.
        meter: the rank's memory meter, if any (it counts the recomputation while it
            measures).
    """

    def __init__(self, stage: nn.Module, meter: MemoryMeter | None = None) -> None:
        super().__init__()
        self.stage = stage
        self.meter = meter

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation saves nothing anyway
            return self.stage(*inputs)
        meter = self.meter
        if (not torch.compiler.is_compiling()  # first: no guard on the meter's state
                and meter is not None and meter.counts_recomputation):
            return checkpoint(self.stage, *inputs, use_reentrant=False,
                              preserve_rng_state=True, context_fn=meter.recompute_contexts)
        return checkpoint(self.stage, *inputs, use_reentrant=False, preserve_rng_state=True)
