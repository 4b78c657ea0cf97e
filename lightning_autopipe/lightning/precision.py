"""The precisions ``AutoPipeStrategy`` runs, and fp16 loss scaling agreed over the pipeline.

``32-true`` and ``bf16-mixed`` need nothing from the pipeline: Lightning's plugin wraps each
training step (every unit's forward and backward) in its autocast context. ``16-mixed`` also
scales the loss, and a scaler per rank would decide alone whether to skip a step (see
:mod:`~lightning_autopipe.runtime.scaler`): :func:`install_loss_scaling` swaps the plugin's
``torch.amp.GradScaler`` for a :class:`~lightning_autopipe.runtime.scaler.PipelineGradScaler`
with the same settings and state, and hands its ``scale`` to the executor, which scales each
unit's loss on the last stage. Lightning's ``MixedPrecision.optimizer_step`` then runs as
written: ``unscale_`` (the one all-reduce of the inf/NaN flag) before the clipping hooks, so
the strategy's global-norm clipping sees unscaled gradients, then ``step`` / ``update``, the
same decision on every rank; the plugin's ``state_dict`` (the scaler's) is saved with every
checkpoint and restored on every rank.

On a CPU, Lightning turns ``precision="16-mixed"`` into ``bf16-mixed`` (with a warning); an
explicit plugin keeps fp16 there:
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.scaler import PipelineGradScaler

__all__ = ["SUPPORTED_PRECISIONS", "check_precision", "install_loss_scaling"]

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
# the scalers that carry no behaviour of their own, so a PipelineGradScaler can stand in
_PLAIN_SCALERS = (torch.amp.GradScaler, torch.cuda.amp.GradScaler)


def check_precision(plugin: Any) -> str:
    """The plugin's precision, when the pipeline runs it.

    Raises:
        PlanError: another precision (``16-true``, ``64-true``, ``transformer-engine``...),
            or ``16-mixed`` from a plugin that is not Lightning's ``MixedPrecision``.
    """
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision not in SUPPORTED_PRECISIONS:
        raise PlanError(
            f"precision {precision!r} is not supported by AutoPipeStrategy; use one of "
            f"{list(SUPPORTED_PRECISIONS)} (16-mixed keeps float32 weights and scales the loss; "
            "bf16-mixed needs no scaling)"
        )
    if precision == "16-mixed":
        from lightning.pytorch.plugins.precision import MixedPrecision

        if not isinstance(plugin, MixedPrecision):
            raise PlanError(
                f"precision '16-mixed' under AutoPipeStrategy needs Lightning's MixedPrecision "
                f"plugin, got {type(plugin).__name__}; pass precision='16-mixed' or "
                "plugins=[MixedPrecision('16-mixed', device, scaler=...)]"
            )
    return precision


def install_loss_scaling(plugin: Any, executor: Any) -> PipelineGradScaler | None:
    """For ``16-mixed``: the plugin's scaler reduced over every rank, scaling the executor's loss.

    Idempotent (a second ``fit`` on the same Trainer keeps the installed scaler and its scale).
    Returns the scaler, or None where the precision scales nothing (the executor's
    ``loss_scale`` is then cleared).

    Raises:
        PlanError: the plugin holds a scaler of another class (its behaviour cannot be kept
            while its decision is shared).
    """
    scaler = getattr(plugin, "scaler", None)
    if getattr(plugin, "precision", None) != "16-mixed" or scaler is None:
        executor.loss_scale = None
        return None
    if not isinstance(scaler, PipelineGradScaler):
        if type(scaler) not in _PLAIN_SCALERS:
            raise PlanError(
                f"the 16-mixed plugin holds a {type(scaler).__name__}; AutoPipeStrategy needs "
                "a plain torch.amp.GradScaler (it takes over its settings and shares its "
                "decision over all stages) or a lightning_autopipe.runtime.scaler."
                "PipelineGradScaler"
            )
        scaler = PipelineGradScaler.from_scaler(scaler, device=str(plugin.device))
        plugin.scaler = scaler
    executor.loss_scale = scaler.scale
    return scaler
