"""Lightning's fine-tuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``), split models.

Such a callback records the optimizer's parameter groups by parameter name in its own state (the
groups it added when it unfroze a backbone), and on resume puts them back before the optimizer
state loads, naming parameters through ``pl_module.named_parameters()``. Each rank of a pipeline
holds one stage: its record names that stage's parameters only, the checkpoint keeps rank 0's,
and on resume a rank finds the names of another stage (of another layout, the plan may differ)
missing: a ``KeyError`` in Lightning's code. So the checkpoint records the whole model's groups
(:func:`record_whole_groups`, from the merged optimizer state, the names one process would
record), and each rank narrows them to its own parameters before the callback restores them
(:func:`narrow_to_stage`): a group none of whose parameters this rank holds stays, empty, so that
group ``g`` is the same group on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_autopipe.checkpoint.optimizer import group_names

__all__ = ["narrow_to_stage", "record_whole_groups"]

_KEY = "internal_optimizer_metadata"


def _finetuning(trainer: Any) -> list[Any]:
    from lightning.pytorch.callbacks import BaseFinetuning

    return [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, BaseFinetuning)]


def record_whole_groups(checkpoint: dict[str, Any], trainer: Any) -> None:
    """In a consolidated ``checkpoint``: each fine-tuning callback's recorded groups name the
    whole model's parameters of that group (``checkpoint["optimizer_states"]``, merged over the
    stages), not rank 0's alone."""
    states = checkpoint.get("callbacks") or {}
    optimizers = checkpoint.get("optimizer_states") or []
    for cb in _finetuning(trainer):
        record = (states.get(cb.state_key) or {}).get(_KEY)
        if not isinstance(record, Mapping):
            continue
        for idx, groups in record.items():
            names = group_names(optimizers[idx]) if idx < len(optimizers) else None
            if names is None:
                continue
            for g, group in enumerate(groups):
                if g < len(names):
                    group["params"] = list(names[g])


def narrow_to_stage(trainer: Any, module: Any) -> None:
    """Every resuming fine-tuning callback's recorded groups narrowed to the parameters this
    rank's stage holds (call after the split, before ``on_fit_start``)."""
    held = {name for name, _ in module.named_parameters()}
    for cb in _finetuning(trainer):
        record = getattr(cb, "_internal_optimizer_metadata", None)
        if not getattr(cb, "_restarting", False) or not isinstance(record, dict):
            continue
        for groups in record.values():
            for group in groups:
                group["params"] = [n for n in group["params"] if n in held]
