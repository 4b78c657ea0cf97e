"""Turn a LightningModule into the holder of one pipeline stage's parameters.

After :func:`bind_local_stage` the module's ``parameters()`` are exactly the local stage's (so
``configure_optimizers`` builds an optimizer over this stage only, and ``state_dict()`` keeps the
original names), and the parameters of every other stage are released on this rank.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["InputRule", "as_call_args", "bind_local_stage", "model_inputs", "restore_tensors",
           "set_input_rule", "tensor_names"]


@dataclass(frozen=True)
class InputRule:
    """The entries of a batch that a module's own step passes to ``self(...)``.

    ``entries``: tuple indices (of a tuple/list batch) or keys (of a dict batch), one per
    argument; ``names``: the forward parameters they bind to when passed by keyword (then the
    inputs are a keyword dict), else None (a positional tuple).
    """

    entries: tuple[int | str, ...]
    names: tuple[str, ...] | None = None

    def __call__(self, batch: Any) -> tuple[Any, ...] | dict[str, Any]:
        values = tuple(batch[e] for e in self.entries)
        return values if self.names is None else dict(zip(self.names, values, strict=True))

    def __str__(self) -> str:
        shown = [f"batch[{e!r}]" for e in self.entries]
        if self.names is not None:
            shown = [f"{n}={v}" for n, v in zip(self.names, shown, strict=True)]
        return f"self({', '.join(shown)})"


#: Rules read off each module's step at setup (:func:`set_input_rule`), by module.
_RULES: weakref.WeakKeyDictionary[nn.Module, InputRule] = weakref.WeakKeyDictionary()


def set_input_rule(module: nn.Module, rule: InputRule | None) -> None:
    """Take ``module``'s forward inputs by ``rule`` from now on (None: the default rules)."""
    if rule is None:
        _RULES.pop(module, None)
    else:
        _RULES[module] = rule


def model_inputs(module: nn.Module, batch: Any) -> Any:
    """The forward inputs of ``batch`` under the pipeline contract.

    ``module.pipeline_inputs(batch)`` when defined, else the entries its step was seen to pass
    to ``self(...)`` (:func:`set_input_rule`) where the batch has them, else ``batch[0]`` for a
    tuple/list batch, else for a dict batch its entries that name ``forward``'s parameters
    (:func:`_named`), else the batch itself. A dict batch is any mapping: a tokenizer's
    ``BatchEncoding`` (a ``UserDict``) is what Hugging Face collators return.
    """
    fn = getattr(module, "pipeline_inputs", None)
    if callable(fn):
        return fn(batch)
    rule = _RULES.get(module)
    if rule is not None:
        try:
            return rule(batch)
        except (IndexError, KeyError, TypeError):  # a batch of another structure: the defaults
            pass
    if isinstance(batch, tuple | list):
        return batch[0]
    if isinstance(batch, Mapping):
        return _named(module.forward, batch)
    return batch


def _named(forward: Any, batch: Mapping) -> dict:
    """A dict batch as ``forward``'s keyword arguments: the entries naming its parameters.

    Such a batch often carries the loss's targets beside the model's inputs (Hugging Face
    style ``{"input_ids", "attention_mask", "labels"}`` for ``forward(input_ids,
    attention_mask)``); the steps read those from the batch themselves. A forward taking
    ``**kwargs`` gets every entry; when no entry names a parameter (``forward(self, batch)``)
    it is the whole dict, which the strategy's check then refuses naming ``pipeline_inputs``.
    """
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a signature Python cannot read: every entry, as before
        return dict(batch)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(batch)
    named = {k: v for k, v in batch.items() if k in params}
    return named or dict(batch)


def as_call_args(inputs: Any) -> tuple[Any, ...] | dict[str, Any]:
    """Forward inputs as the graph layer takes them: positional tuple or keyword dict."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs)
    return (inputs,)


def tensor_names(module: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter and buffer of ``module``, keyed by each of its names
    (a tied weight reached as ``lm_head.weight`` and ``wte.weight`` lists both under both).

    Taken before :func:`bind_local_stage` releases other stages' tensors, it lets a later
    binding (to another plan's stage) restore every alias of a tensor it now holds."""
    names: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return {name: list(group) for group in names.values() for name in group}


def restore_tensors(module: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Put every tensor of ``tensors`` (original name -> the parameter or buffer object taken
    before a binding) back into its slot of ``module``.

    Stages share the user's submodules, so a slot :func:`bind_local_stage` emptied is empty in
    every stage holding that submodule too: a stage of another plan has its tensors again only
    once they are restored (their storage may still be released; binding then releases the
    foreign ones again)."""
    for name, t in tensors.items():
        owner, attr = _owner(module, name)
        if isinstance(t, nn.Parameter):
            owner._parameters[attr] = t
        else:
            owner._buffers[attr] = t


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def _slots(module: nn.Module, kind: str) -> dict[str, tuple[nn.Module, str, Tensor | None]]:
    """Every parameter (``kind="_parameters"``) or buffer slot of ``module`` by qualified name,
    empty ones (released by an earlier binding) included: ``name -> (owner, attr, value)``."""
    out: dict[str, tuple[nn.Module, str, Tensor | None]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, value in getattr(owner, kind).items():
            out[f"{prefix}.{attr}" if prefix else attr] = (owner, attr, value)
    return out


def bind_local_stage(
    module: nn.Module,
    stage: nn.Module,
    param_names: dict[str, str],
    aliases: dict[str, list[str]] | None = None,
) -> int:
    """Rebind ``module``'s parameters and buffers to the stage's; release the others.

    Every name under which the module reaches a local parameter (tied weights have several)
    now holds the stage's object; every other parameter slot is set to ``None`` and its storage
    freed. Buffers the stage owns are rebound too (batch-norm statistics stay visible through
    ``module.state_dict()``); other buffer slots are set to ``None`` (the stage keeps its own
    non-persistent buffers such as attention masks). A module bound before can be bound again
    to another stage of the same blocks (another plan's): slots emptied by the first binding
    are filled again.

    Args:
        module: the user's module (the traced root).
        stage: the local stage module.
        param_names: ``stage.param_names``: local state-dict key -> original key.
        aliases: :func:`tensor_names` of the module before its first binding (default: taken
            now, which finds the aliases of the tensors the module still holds).

    Returns:
        Bytes of parameter storage released.
    """
    local = stage.state_dict(keep_vars=True)
    params, buffers = _slots(module, "_parameters"), _slots(module, "_buffers")
    if aliases is None:
        aliases = tensor_names(module)

    target: dict[str, Tensor] = {}
    for local_key, orig_key in param_names.items():
        if local_key not in local:
            continue
        for name in aliases.get(orig_key, [orig_key]):
            target[name] = local[local_key]

    kept = {id(t) for t in target.values()}
    freed = 0
    for name, (owner, attr, p) in params.items():
        if name in target:
            new = target[name]
            owner._parameters[attr] = new if isinstance(new, nn.Parameter) else nn.Parameter(new)
        else:
            owner._parameters[attr] = None
        if p is not None and id(p) not in kept and p.numel():  # a foreign parameter, or a
            freed += p.numel() * p.element_size()  # copy the stage replaced
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    for name, (owner, attr, _) in buffers.items():
        owner._buffers[attr] = target.get(name)
    return freed
