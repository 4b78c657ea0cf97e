"""The train/eval mode in an exported graph: which nodes it decided, and where two captures differ.

torch.export records the decisions ``train()``/``eval()`` make as constants: ``dropout(x, 0.1,
True)``, ``batch_norm(..., training=True, ...)``, attention's dropout probability, BatchNorm's
``num_batches_tracked += 1``. A stage built from such a graph would run the captured mode's code
in every mode. These pure functions over graphs find those nodes (:func:`mode_nodes`), compare a
capture in training mode with one in evaluation mode (:func:`mode_values`: the constants a stage
then chooses by its own ``training`` flag, :mod:`~.stage`), and word the warning for a capture
whose mode stays (:func:`kept_mode`). :mod:`~.trace` captures; this module only reads graphs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["kept_mode", "mode_nodes", "mode_values"]


#: aten ops whose behaviour follows train()/eval() in eager PyTorch, and the argument holding
#: the mode (or, for attention, the dropout probability the module chose by its mode)
_MODE_ARGS = {f"{kind}dropout{inplace}": 2 for kind in ("", "feature_", "alpha_", "feature_alpha_")
              for inplace in ("", "_")} | {"batch_norm": 5, "scaled_dot_product_attention": 4}


def mode_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes of an exported graph that computed as they did because of the model's mode:
    dropout with ``p > 0`` (on in training), batch norm with running statistics (batch
    statistics in training), attention with a dropout probability."""
    out = []
    for n in gm.graph.nodes:
        name = getattr(getattr(n.target, "_overloadpacket", None), "__name__", "")
        if n.op != "call_function" or name not in _MODE_ARGS:
            continue
        i = _MODE_ARGS[name]
        value = n.args[i] if len(n.args) > i else n.kwargs.get(
            "dropout_p" if name == "scaled_dot_product_attention" else "train", None)
        if name == "batch_norm":  # without running statistics it is the same in both modes
            if value and n.args[3] is not None:
                out.append(n)
        else:  # a dropout, in place or not, or attention's dropout
            p = value if name == "scaled_dot_product_attention" else n.args[1]
            if isinstance(p, (int, float)) and p > 0 and value:
                out.append(n)
    return out


def _counts_batches(n: fx.Node) -> bool:
    """BatchNorm's ``num_batches_tracked += 1``, which only training does."""
    first = n.args[0] if n.args else None
    return (n.target is torch.ops.aten.add_.Tensor and isinstance(first, fx.Node)
            and first.op == "get_attr" and str(first.target).endswith("num_batches_tracked"))


#: ops that leave values as they are: a capture may hold one where the other mode's does not
#: (torch.export keeps a ``contiguous`` whose input the other mode's graph lays out already)
_NEUTRAL = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default,
            torch.ops.aten.alias.default}


def _constants(n: fx.Node, length: int = 0) -> tuple[Any, Any]:
    """A node's arguments with every node replaced by None, padded to ``length`` with the op's
    defaults (a capture may leave out an argument at its default, attention's dropout 0)."""
    args = list(fx.node.map_arg(n.args, lambda _: None))
    schema = getattr(n.target, "_schema", None)
    while schema is not None and len(args) < min(length, len(schema.arguments)):
        args.append(schema.arguments[len(args)].default_value)
    return tuple(args), fx.node.map_arg(n.kwargs, lambda _: None)


def mode_values(train: fx.GraphModule, evaluation: fx.GraphModule
                 ) -> dict[fx.Node, tuple[int, Any, Any]] | None:
    """Where the capture in evaluation mode differs from the one in training mode, if only by
    what :func:`mode_nodes` finds (one argument each), by ``num_batches_tracked += 1`` (which
    evaluation does not do: it adds 0 there) and by ops that leave values as they are; None
    for any other difference (a Python branch on ``self.training``), which the stages cannot
    follow."""
    calls = [n for n in evaluation.graph.nodes if n.op == "call_function"]
    out: dict[fx.Node, tuple[int, Any, Any]] = {}
    j = 0
    for n in (n for n in train.graph.nodes if n.op == "call_function"):
        while j < len(calls) and calls[j].target in _NEUTRAL and calls[j].target != n.target:
            j += 1
        other = calls[j] if j < len(calls) else None
        if other is not None and other.target == n.target:
            length = max(len(n.args), len(other.args))
            (args, kwargs), (eargs, ekwargs) = _constants(n, length), _constants(other, length)
            diff = [i for i, (a, b) in enumerate(zip(args, eargs)) if a != b]
            if kwargs != ekwargs or len(args) != len(eargs) or len(diff) > 1:
                return None
            if diff:
                if (_MODE_ARGS.get(n.target._overloadpacket.__name__) != diff[0]
                        or diff[0] >= len(n.args)):  # the stage sets an argument it holds
                    return None
                out[n] = (diff[0], args[diff[0]], eargs[diff[0]])
            j += 1
        elif _counts_batches(n):
            out[n] = (1, n.args[1], 0)
        elif n.target not in _NEUTRAL:
            return None
    return out if all(n.target in _NEUTRAL for n in calls[j:]) else None


def kept_mode(model_name: str, nodes: list[fx.Node]) -> str:
    """The warning for a graph whose ``nodes`` (:func:`mode_nodes`) keep the captured training
    mode: what validation, test and prediction then do, the first module, and the fixes."""
    first = next(iter(reversed(nodes[0].meta.get("nn_module_stack", {}).values())), ("?", ""))
    kinds = sorted({n.target._overloadpacket.__name__ for n in nodes})
    effects, fixes = [], []
    if kinds != ["batch_norm"]:  # a dropout, or attention's dropout
        effects.append("keep dropout on")
        fixes.append("build the model with dropout 0 (Hugging Face: the config's *dropout* / "
                     "*_prob fields)")
    if "batch_norm" in kinds:
        effects.append("normalise by batch statistics (updating BatchNorm's running statistics)")
    fixes.append("let torch.fx capture it (a forward without Python checks on traced values "
                 "such as hasattr)")
    return (f"{model_name} was captured with torch.export, whose graph keeps the training-mode "
            f"code of {len(nodes)} node(s) ({', '.join(kinds)}; the first in {first[0]!r}): "
            "the split model runs it in every mode, and the model's other mode captures another "
            f"graph, so validation, test and prediction {' and '.join(effects)}. To have the "
            f"stages follow train()/eval(), {', or '.join(fixes)}")
