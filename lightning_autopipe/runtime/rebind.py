"""A stage's state under the whole model's names, and loading migrated state back into it.

:func:`~lightning_autopipe.runtime.migrate.migrate` moves named tensors and named optimizer
state; this module is the bridge to live objects: the names of a stage module's tensors
(:func:`stage_tensors`), the new stage's parameters and buffers given the migrated tensors
in place (:func:`load_stage_tensors`: the same Parameter objects, new storage, so whatever
holds them keeps working) and a *live* optimizer pointed at the new stage's parameters with
the migrated state (:func:`rebind_optimizer`: the same optimizer object, so Lightning's
``trainer.optimizers`` and any LR scheduler holding it keep working).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.optim_state import NAMES, numbered_state, unwrap

__all__ = [
    "load_stage_tensors",
    "rebind_optimizer",
    "stage_names",
    "stage_tensors",
    "tie_aliases",
]


def tie_aliases(blocks: Any, cuts: Sequence[int]) -> dict[str, str]:
    """``alias -> canonical name`` of every tied parameter under ``cuts`` (a ``BlockGraph``).

    A tied parameter appears in each stage under the alias that stage uses (``wte.weight`` in
    the first, ``lm_head.weight`` in the last); a migration names it once, by its first alias.
    """
    out: dict[str, str] = {}
    for tie in blocks.tie_groups(list(cuts)):
        for alias in tie.aliases:
            out[alias] = tie.name
    return out


def stage_names(stage: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """``local state_dict key -> whole-model name`` of a stage's parameters and buffers.

    A graph-layer stage maps its keys to the original names (``param_names``); any other
    module is taken to use the whole model's names already. ``aliases`` canonicalises tied
    parameters (:func:`tie_aliases`).
    """
    aliases = aliases or {}
    local = getattr(stage, "param_names", None)
    keys = stage.state_dict(keep_vars=True).keys()
    return {k: aliases.get(local.get(k, k) if local else k, local.get(k, k) if local else k)
            for k in keys}


def stage_tensors(stage: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[str, Tensor]:
    """The stage's parameters and persistent buffers under the whole model's names (the
    objects themselves, one entry per tied parameter)."""
    local = stage.state_dict(keep_vars=True)
    out: dict[str, Tensor] = {}
    for key, name in stage_names(stage, aliases).items():
        out.setdefault(name, local[key])
    return out


@torch.no_grad()
def load_stage_tensors(
    stage: nn.Module, tensors: Mapping[str, Tensor], aliases: Mapping[str, str] | None = None
) -> int:
    """Give the stage's parameters and buffers the migrated values, keeping their objects.

    A tensor that already *is* the stage's (a name this rank kept) is left alone; any other is
    swapped in as the stage tensor's storage (``.data``; a parameter's stale ``.grad`` is
    dropped), so the stage, the user's module and anything else holding the Parameter objects
    see the new values. Load before building the new stage's executor: its gradient buckets
    are sized from the parameters. Returns the number of tensors replaced.

    Raises:
        PlanError: a name of the stage is missing from ``tensors`` or has another shape.
    """
    local = stage.state_dict(keep_vars=True)
    replaced = 0
    done: set[int] = set()
    for key, name in stage_names(stage, aliases).items():
        target = local[key]
        if id(target) in done:
            continue
        done.add(id(target))
        if name not in tensors:
            raise PlanError(
                f"the migrated state lacks {name!r} of the new stage; migrate to the layout "
                "this stage was built for"
            )
        value = tensors[name]
        if value is target:
            continue
        if target.numel() and tuple(target.shape) != tuple(value.shape):
            raise PlanError(
                f"migrated {name!r} has shape {tuple(value.shape)} but the stage's is "
                f"{tuple(target.shape)}; migrate between layouts of the same model"
            )
        if isinstance(target, nn.Parameter):
            target.grad = None
        target.data = value.to(device=target.device, dtype=target.dtype)
        replaced += 1
    return replaced


def rebind_optimizer(
    optimizer: Any, params: Mapping[str, nn.Parameter], named: Mapping[str, Any]
) -> None:
    """Point a live optimizer at the new stage's ``params`` and load the migrated state.

    The optimizer object stays the same (Lightning's ``trainer.optimizers``, a
    ``LightningOptimizer`` around it and LR schedulers keep their reference): each group's
    ``params`` becomes the new stage's parameters of that group (``named``'s
    ``"param_names"``), its per-parameter state is replaced by the migrated one and its
    hyper-parameters by ``named``'s (this rank's own, so a scheduler's ``lr`` is kept).

    Args:
        optimizer: the optimizer (or a wrapper exposing ``_optimizer``).
        params: whole-model name -> the new stage's Parameter.
        named: one entry of :attr:`~lightning_autopipe.runtime.migrate.Migrated.optimizers`.

    Raises:
        PlanError: the groups do not match, or a name has no parameter on the new stage.
    """
    opt = unwrap(optimizer)
    groups = named["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise PlanError(
            f"the migrated optimizer state has {len(groups)} parameter groups but the "
            f"optimizer has {len(opt.param_groups)}; rebind the optimizer that was migrated"
        )
    missing = [n for g in groups for n in g[NAMES] if n not in params]
    if missing:
        raise PlanError(
            f"the migrated optimizer state names {missing[:4]}, which the new stage does not "
            "hold; pass the new stage's parameters under the whole model's names"
        )
    for group, saved in zip(opt.param_groups, groups):
        group["params"] = [params[n] for n in saved[NAMES]]
        if NAMES in group:  # built from named_parameters(): torch keeps the names per group
            group[NAMES] = list(saved[NAMES])
    opt.state.clear()
    numbered = numbered_state(groups, named["state"])
    numbered.pop(NAMES, None)
    opt.load_state_dict(numbered)  # casts the state to each parameter's device and dtype
    for group, saved in zip(opt.param_groups, groups):  # but the optimizer's own dtypes stay:
        for p, name in zip(group["params"], saved[NAMES]):  # NAdam keeps mu_product float32
            for key, value in named["state"].get(name, {}).items():
                now = opt.state[p].get(key)
                if isinstance(value, Tensor) and isinstance(now, Tensor) and \
                        now.dtype != value.dtype:
                    opt.state[p][key] = now.to(value.dtype)
