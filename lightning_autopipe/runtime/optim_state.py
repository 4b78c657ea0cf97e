"""One optimizer's state keyed by parameter name, and back: the layout-independent form.

A pipeline rank's optimizer numbers only its stage's parameters, so its integer ids mean nothing
to another layout; keyed by the whole model's parameter names the state moves between layouts
(in memory: :mod:`~lightning_autopipe.runtime.migrate`) and into checkpoints (the checkpoint
package merges the stages' named states and re-shards them on load).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_autopipe.errors import PlanError

__all__ = ["NAMES", "named_optimizer_state", "numbered_state", "param_names_by_id", "unwrap"]

NAMES = "param_names"  # key of the names per group (top level of a numbered state, or per group)


def param_names_by_id(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` with tied parameters under their first (canonical) name.

    On a pipeline rank the module's parameters are the local stage's under the original names
    (``bind_local_stage``), so these are the names the whole model uses.
    """
    return {id(p): name for name, p in module.named_parameters()}


def unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer


def named_optimizer_state(optimizer: Any, names: Mapping[int, str]) -> dict[str, Any]:
    """The optimizer's state keyed by parameter *name*: the layout-independent form.

    Returns:
        ``{"state": {name: per-param state}, "param_groups": [hyper-parameters + names]}``;
        each group carries its parameters' names under ``"param_names"``.

    Raises:
        PlanError: the optimizer holds a parameter the module does not have.
    """
    opt = unwrap(optimizer)
    sd = opt.state_dict()
    state: dict[str, Any] = {}
    groups = []
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group_names = []
        for p, pid in zip(group["params"], saved["params"]):
            if id(p) not in names:
                raise PlanError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one "
                    "of the module's parameters; build optimizers from self.parameters() inside "
                    "configure_optimizers"
                )
            name = names[id(p)]
            group_names.append(name)
            if pid in sd["state"]:
                state[name] = sd["state"][pid]
        hyper = {k: v for k, v in saved.items() if k not in ("params", NAMES)}
        groups.append({**hyper, NAMES: group_names})
    return {"state": state, "param_groups": groups}


def numbered_state(
    groups: Sequence[Mapping[str, Any]], state: Mapping[str, Any]
) -> dict[str, Any]:
    """A plain ``torch.optim`` state dict from named groups and state keyed by name.

    Ids are numbered across the groups in order, as ``Optimizer.state_dict`` does, so the result
    loads into an optimizer built over those parameters in that order; the names stay under a
    top-level ``"param_names"`` list per group.
    """
    out_groups, out_state, all_names = [], {}, []
    next_id = 0
    for group in groups:
        names = list(group[NAMES])
        ids = list(range(next_id, next_id + len(names)))
        next_id += len(names)
        out_state.update({pid: state[name] for pid, name in zip(ids, names) if name in state})
        out_groups.append({**{k: v for k, v in group.items() if k != NAMES}, "params": ids})
        all_names.append(names)
    return {"state": out_state, "param_groups": out_groups, NAMES: all_names}
