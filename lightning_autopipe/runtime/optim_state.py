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

__all__ = ["NAMES", "named_optimizer_state", "numbered_state", "param_names_by_id",
           "state_bytes_per_param_byte", "unwrap"]

NAMES = "param_names"  # key of the names per group (top level of a numbered state, or per group)
_PROBE = 256  # elements of the probe tensor an optimizer's state is measured on


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


def state_bytes_per_param_byte(optimizers: Sequence[Any]) -> float | None:
    """Bytes of per-parameter state ``optimizers`` will keep per byte of the parameters they
    train (Adam 2, SGD with momentum 1, plain SGD 0), before any of them has stepped.

    Measured, not looked up: each parameter group's optimizer class is made again over one
    probe tensor with the group's settings and stepped once (state such as Adam's moments is
    made lazily at the first step), its per-element state counted; the groups are weighted by
    their parameters' bytes. None when a group's optimizer cannot be made again from its
    settings alone (a constructor that needs more) or its step fails on the probe.
    """
    total = kept = 0.0
    for opt in optimizers:
        opt = unwrap(opt)
        for group in opt.param_groups:
            nbytes = sum(p.numel() * p.element_size() for p in group["params"])
            if not nbytes:
                continue
            probe = torch.zeros(_PROBE, requires_grad=True)
            settings = {k: v for k, v in group.items() if k != "params"}
            try:
                clone = type(opt)([{**settings, "params": [probe]}])
                probe.grad = torch.full_like(probe, 1e-3)
                clone.step()
            except Exception:  # noqa: BLE001 - any failure: not measurable this way
                return None
            state = clone.state.get(probe, {})
            per_element = sum(v.numel() * v.element_size() for v in state.values()
                              if isinstance(v, torch.Tensor) and v.shape == probe.shape)
            kept += per_element / (probe.numel() * probe.element_size()) * nbytes
            total += nbytes
    return kept / total if total else 0.0
