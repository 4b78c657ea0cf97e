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
from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.optim_state import NAMES

__all__ = ["narrow_to_stage", "record_whole_groups"]

_KEY = "internal_optimizer_metadata"


def _finetuning(trainer: Any) -> list[Any]:
    from lightning.pytorch.callbacks import BaseFinetuning

    return [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, BaseFinetuning)]


def record_whole_groups(checkpoint: dict[str, Any], trainer: Any) -> None:
    """In a ``checkpoint`` about to be written: each fine-tuning callback's recorded groups are
    the whole model's (``checkpoint["optimizer_states"]``, whose groups are merged over the
    stages), not rank 0's alone: one per group, naming the group's parameters on every stage
    (a group another stage added is recorded too; rank 0 holds it empty)."""
    states = checkpoint.get("callbacks") or {}
    optimizers = checkpoint.get("optimizer_states") or []
    for cb in _finetuning(trainer):
        state = states.get(cb.state_key)
        record = (state or {}).get(_KEY)
        if not isinstance(record, Mapping):
            continue
        whole = {}
        for idx, groups in record.items():
            saved = optimizers[idx] if idx < len(optimizers) else None
            names = group_names(saved) if saved else None
            if names is None:
                whole[idx] = groups
                continue
            merged = saved["param_groups"]
            whole[idx] = [
                {**{k: v for k, v in (groups[g] if g < len(groups) else merged[g]).items()
                    if k not in ("params", NAMES)}, "params": list(names[g])}
                for g in range(len(names))
            ]
        state[_KEY] = whole  # a new record: the callback's own stays as it is


def narrow_to_stage(trainer: Any, module: Any) -> None:
    """Every resuming fine-tuning callback's recorded groups narrowed to the parameters this
    rank's stage holds (call after the split, before ``on_fit_start``).

    Raises:
        PlanError: the record names none of the stage's trainable parameters (a checkpoint
            written before the record held the whole model's groups): restored so, this
            stage's optimizer would hold nothing and the stage would not train.
    """
    held = {name for name, _ in module.named_parameters()}
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    for cb in _finetuning(trainer):
        record = getattr(cb, "_internal_optimizer_metadata", None)
        if not getattr(cb, "_restarting", False) or not isinstance(record, dict):
            continue
        named = {n for groups in record.values() for g in groups for n in g["params"]}
        if trained and not trained & named:
            raise PlanError(
                f"{type(cb).__name__}'s record of the optimizer's groups in the checkpoint "
                "names none of this stage's trainable parameters (it was written by one "
                "stage): restored, this stage would not train. Resume from a checkpoint "
                "written by this version of AutoPipeStrategy, or without the callback's state"
            )
        for groups in record.values():
            for group in groups:
                group["params"] = [n for n in group["params"] if n in held]
