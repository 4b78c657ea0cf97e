"""Turn a LightningModule into the holder of one pipeline stage's parameters.

After :func:`bind_local_stage` the module's ``parameters()`` are exactly the local stage's (so
``configure_optimizers`` builds an optimizer over this stage only, and ``state_dict()`` keeps the
original names), and the parameters of every other stage are released on this rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["model_inputs", "as_call_args", "bind_local_stage"]


def model_inputs(module: nn.Module, batch: Any) -> Any:
    """The forward inputs of ``batch`` under the pipeline contract.

    ``module.pipeline_inputs(batch)`` when defined, else ``batch[0]`` for a tuple/list batch,
    else the batch itself.
    """
    fn = getattr(module, "pipeline_inputs", None)
    if callable(fn):
        return fn(batch)
    if isinstance(batch, tuple | list):
        return batch[0]
    return batch


def as_call_args(inputs: Any) -> tuple[Any, ...] | dict[str, Any]:
    """Forward inputs as the graph layer takes them: positional tuple or keyword dict."""
    if isinstance(inputs, dict):
        return dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs)
    return (inputs,)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def bind_local_stage(module: nn.Module, stage: nn.Module, param_names: dict[str, str]) -> int:
    """Rebind ``module``'s parameters and buffers to the stage's; release the others.

    Every name under which the module reaches a local parameter (tied weights have several)
    now holds the stage's object; every other parameter slot is set to ``None`` and its storage
    freed. Buffers the stage owns are rebound too (batch-norm statistics stay visible through
    ``module.state_dict()``); other buffer slots are set to ``None`` (the stage keeps its own
    non-persistent buffers such as attention masks).

    Args:
        module: the user's module (the traced root).
        stage: the local stage module.
        param_names: ``stage.param_names``: local state-dict key -> original key.

    Returns:
        Bytes of parameter storage released.
    """
    local = stage.state_dict(keep_vars=True)
    orig_params = dict(module.named_parameters(remove_duplicate=False))
    orig_buffers = dict(module.named_buffers(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, t in [*orig_params.items(), *orig_buffers.items()]:
        aliases.setdefault(id(t), []).append(name)

    target: dict[str, Tensor] = {}
    for local_key, orig_key in param_names.items():
        if local_key not in local:
            continue
        obj = local[local_key]
        orig = orig_params.get(orig_key, orig_buffers.get(orig_key))
        for name in aliases.get(id(orig), [orig_key]) if orig is not None else [orig_key]:
            target[name] = obj

    kept = {id(t) for t in target.values()}
    freed = 0
    for name, p in orig_params.items():
        owner, attr = _owner(module, name)
        if name in target:
            new = target[name]
            owner._parameters[attr] = new if isinstance(new, nn.Parameter) else nn.Parameter(new)
        else:
            owner._parameters[attr] = None
        if id(p) not in kept and p.numel():  # a foreign parameter, or a copy the stage replaced
            freed += p.numel() * p.element_size()
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    for name in orig_buffers:
        owner, attr = _owner(module, name)
        owner._buffers[attr] = target.get(name)
    return freed
