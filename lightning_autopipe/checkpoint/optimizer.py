"""Optimizer state keyed by parameter name: what makes a checkpoint independent of the layout.

A pipeline rank's optimizer numbers only its stage's parameters, so its integer ids mean nothing
to another layout. A consolidated checkpoint holds a plain ``torch.optim`` state dict whose ids
follow the whole model's parameter order (what ``Optimizer(model.parameters())`` would use),
plus a top-level ``"param_names"`` list per group; this module converts between that, the
per-stage named form and a rank's local state dict. The conversion of one optimizer's state
to and from the named form lives in :mod:`~lightning_autopipe.runtime.optim_state` (the
runtime moves it between layouts in memory too) and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.optim_state import (
    NAMES,
    named_optimizer_state,
    numbered_state,
    param_names_by_id,
    unwrap,
)

__all__ = [
    "group_names",
    "local_optimizer_state",
    "merge_optimizer_states",
    "merge_param_groups",
    "named_optimizer_state",
    "numbered_state",
    "param_names_by_id",
    "unwrap",
]


def merge_param_groups(
    group_lists: Iterable[Sequence[Mapping[str, Any]]], order: Sequence[str]
) -> list[dict[str, Any]]:
    """Merge named parameter groups of several stages: group ``g`` = union of their names.

    Names follow the whole model's parameter order ``order``; hyper-parameters come from the
    first list (every stage's scheduler steps alike).

    Raises:
        PlanError: the stages built different numbers of groups.
    """
    lists = [list(gl) for gl in group_lists]
    counts = {len(gl) for gl in lists}
    if len(counts) != 1:
        raise PlanError(
            f"the stages' optimizers have different numbers of parameter groups {sorted(counts)}; "
            "configure_optimizers must build the same groups on every stage"
        )
    rank_of = {name: i for i, name in enumerate(order)}
    merged = []
    for g in range(counts.pop()):
        seen: dict[str, None] = {}
        for gl in lists:
            seen.update(dict.fromkeys(gl[g][NAMES]))
        names = sorted(seen, key=lambda n: (rank_of.get(n, len(rank_of)), n))
        hyper = {k: v for k, v in lists[0][g].items() if k != NAMES}
        merged.append({**hyper, NAMES: names})
    return merged


def merge_optimizer_states(
    parts: Iterable[Mapping[str, Any]], order: Sequence[str]
) -> dict[str, Any]:
    """Merge per-stage named states into one plain ``torch.optim`` state dict.

    Group ``g`` holds the union of every part's group ``g`` names, in the whole model's
    parameter order ``order``; ids are numbered across groups as ``Optimizer.state_dict`` does,
    so the result loads into ``Optimizer(model.parameters())`` of the plain model. A name held by
    several parts (a tied weight) is kept once, from the first part.
    """
    parts = [p for p in parts if p]
    if not parts:
        return {}
    state: dict[str, Any] = {}
    for part in parts:
        for name, value in part["state"].items():
            state.setdefault(name, value)
    return numbered_state(merge_param_groups([p["param_groups"] for p in parts], order), state)


def group_names(saved: Mapping[str, Any]) -> list[list[str]] | None:
    """Parameter names per group of a saved optimizer state, when it records them."""
    if NAMES in saved:
        return [list(g) for g in saved[NAMES]]
    groups = saved.get("param_groups", [])
    if groups and all(NAMES in g for g in groups):
        return [list(g[NAMES]) for g in groups]
    return None


def local_optimizer_state(
    saved: Mapping[str, Any],
    optimizer: Any,
    names: Mapping[int, str],
    full_names: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The part of a consolidated optimizer state this rank's optimizer holds, as its state dict.

    Args:
        saved: a plain ``torch.optim`` state dict (ids in the whole model's order), from a
            pipeline checkpoint (names recorded) or from ``strategy="auto"`` (no names).
        optimizer: this rank's optimizer (over the local stage's parameters).
        names: ``id(parameter) -> original name`` on this rank.
        full_names: names per group of the whole model's optimizer, used when ``saved`` records
            no names (its ids are then matched to these names by position).

    Raises:
        PlanError: the groups do not match, or a local parameter is missing from the checkpoint.
    """
    opt = unwrap(optimizer)
    per_group = group_names(saved) or (
        [list(g) for g in full_names] if full_names is not None else None
    )
    saved_groups = saved["param_groups"]
    if per_group is None:
        raise PlanError(
            "the checkpoint's optimizer state records no parameter names and the whole model's "
            "parameter order is unknown; resume with the strategy that wrote it"
        )
    if len(saved_groups) != len(opt.param_groups) or len(per_group) != len(saved_groups):
        raise PlanError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but "
            f"configure_optimizers built {len(opt.param_groups)}; build the same groups"
        )
    state: dict[int, Any] = {}
    groups = []
    local_id = 0
    for g, (group, sgroup, gnames) in enumerate(zip(opt.param_groups, saved_groups, per_group)):
        if len(gnames) != len(sgroup["params"]):
            raise PlanError(
                f"optimizer group {g} of the checkpoint holds {len(sgroup['params'])} parameters "
                f"but the model's group {g} has {len(gnames)}; resume the same model with the "
                "same configure_optimizers"
            )
        id_of = dict(zip(gnames, sgroup["params"]))
        ids = []
        for p in group["params"]:
            name = names.get(id(p))
            if name not in id_of:
                raise PlanError(
                    f"parameter {name!r} of optimizer group {g} is not in the checkpoint's group "
                    f"{g} ({len(gnames)} parameters); resume the same model with the same "
                    "configure_optimizers"
                )
            if id_of[name] in saved["state"]:
                state[local_id] = saved["state"][id_of[name]]
            ids.append(local_id)
            local_id += 1
        hyper = {k: v for k, v in sgroup.items() if k not in ("params", NAMES)}
        groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": groups}

