"""Stage modules: a standalone ``GraphModule`` for a contiguous block range ``[i, j)``.

A stage takes the tensors crossing boundary ``i`` and returns those crossing boundary ``j``
(both as tuples). It owns the parameters and buffers its nodes use, registered under the
original model's qualified names; it *shares* those Parameter objects with the model it was
split from (``copy.deepcopy(stage)`` gives an independent copy). Floating nodes (parameters,
sizes, constants) are recomputed inside the stage, so only tensors ever enter or leave it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from lightning_autopipe.errors import TraceError
from lightning_autopipe.graph.analysis import GraphInfo, mutates_first_arg

__all__ = ["StageIO", "StageModule", "TieGroup", "ValueInfo", "adopt_orphans", "build_stage"]


@dataclass(frozen=True)
class ValueInfo:
    """A value crossing a block boundary, as seen on the example inputs.

    Attributes:
        name: the graph node's name (stable for one trace).
        shape: shape at the traced batch size (dim 0 is the batch for activations).
        dtype: element type.
        requires_grad: a float tensor that depends on parameters: its gradient must be sent
            back to the stage that produced it.
        nbytes: size at the traced batch size.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    nbytes: int


@dataclass(frozen=True)
class StageIO:
    """Inputs and outputs of a block range (see :meth:`BlockGraph.stage_io`)."""

    blocks: tuple[int, int]
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]


@dataclass(frozen=True)
class TieGroup:
    """One original parameter held under several names or by several stages.

    Attributes:
        name: canonical original ``state_dict`` name (the first alias).
        aliases: every original name of the parameter (``lm_head.weight``, ``wte.weight``).
        stages: stage index -> the parameter's local name(s) in that stage's ``state_dict``.
            With more than one stage, each stage holds its own copy and the runtime must sum
            their gradients every step; within one stage it stays a single Parameter.
    """

    name: str
    aliases: tuple[str, ...]
    stages: dict[int, tuple[str, ...]]


def by_mode(training: bool, in_training: Any, in_evaluation: Any) -> Any:
    """The value a module's mode chose when the model was captured: the stage graph calls this
    with its own ``training`` flag, so an exported stage follows ``train()``/``eval()``."""
    return in_training if training else in_evaluation


class StageModule(fx.GraphModule):
    """The ``GraphModule`` of one stage; metadata lives in ``self.meta`` so copies keep it."""

    @property
    def block_range(self) -> tuple[int, int]:
        return self.meta["autopipe"]["blocks"]

    @property
    def param_names(self) -> dict[str, str]:
        """This stage's ``state_dict`` key -> the original model's ``state_dict`` name."""
        return self.meta["autopipe"]["param_names"]

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.meta["autopipe"]["inputs"]

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.meta["autopipe"]["outputs"]


class _Builder:
    def __init__(self, info: GraphInfo, inputs: list[fx.Node], nodes: list[fx.Node]):
        """``nodes``: the stage's anchored nodes. An input the stage writes in place, itself or
        through a view of it, is cloned first: a received tensor is an autograd leaf."""
        self.info = info
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.available: list[fx.Node] = []  # original values present in the stage, in order
        self.training: fx.Node | None = None  # the stage's ``self.training``, once read
        root = info.traced.gm
        written = {
            info.alias_root.get(a, a)
            for u in nodes
            if mutates_first_arg(u, root) and isinstance(a := u.args[0] if u.args else None,
                                                         fx.Node)
        }
        mutated = {v for v in inputs if info.alias_root.get(v, v) in written}
        for v in inputs:
            ph = self.graph.placeholder(v.name)
            ph.meta = dict(v.meta)
            self.env[v] = self.graph.call_method("clone", (ph,)) if v in mutated else ph
            self.available.append(v)

    def lookup(self, n: fx.Node) -> Any:
        if n in self.env:
            return self.env[n]
        info = self.info
        if n in info.traced.constant_inputs:
            return info.traced.constant_inputs[n]
        if n not in info.floating:
            raise TraceError(
                f"internal: value {n.name} is used in a stage that neither receives nor computes "
                "it; please report this with the model"
            )
        src = n.args[0] if n.args else None
        if info.is_sym_leaf(n) and src not in self.env and info.is_value(src):
            new = self._substitute(n)
        else:
            new = self._copy(n)
        self.env[n] = new
        return new

    def _copy(self, n: fx.Node) -> fx.Node:
        """``n`` in the stage's graph; a constant the model's mode chose (an exported graph's
        dropout, batch norm: :attr:`~.trace.Traced.mode_values`) becomes a choice by the
        stage's own ``training`` flag, read as ``self.training`` when the stage runs."""
        new = self.graph.node_copy(n, self.lookup)
        mode = self.info.traced.mode_values.get(n)
        if mode is not None:
            index, in_training, in_evaluation = mode
            with self.graph.inserting_before(new):
                if self.training is None:
                    self.training = self.graph.get_attr("training")
                chosen = self.graph.call_function(by_mode, (self.training, in_training,
                                                            in_evaluation))
            new.update_arg(index, chosen)
        return new

    def _substitute(self, n: fx.Node) -> fx.Node:
        expr = n.meta["val"].node.expr
        for v in self.available:
            dim = self.info.sym_dims(v).get(expr)
            if dim is not None:
                return self.graph.call_function(torch.ops.aten.sym_size.int, (self.env[v], dim))
        raise TraceError(
            f"internal: no tensor in the stage carries the symbolic size {expr} of {n.name}"
        )

    def add(self, n: fx.Node) -> None:
        self.env[n] = self._copy(n)
        self.available.append(n)

    def output(self, values: Iterable[fx.Node]) -> None:
        self.graph.output(tuple(self.lookup(v) for v in values))


def _fix_buffers(stage: nn.Module, shared: set[int], persistent: set[int]) -> None:
    """Buffers absent from the original ``state_dict`` stay out of the stage's too."""
    for name, buf in list(stage.named_buffers(remove_duplicate=False)):
        owner_path, _, field = name.rpartition(".")
        owner = stage.get_submodule(owner_path) if owner_path else stage
        if id(owner) not in shared and id(buf) not in persistent:
            owner._non_persistent_buffers_set.add(field)


def adopt_orphans(stage: StageModule, orphans: dict[str, torch.Tensor]) -> None:
    """Give ``stage`` the model's tensors no block reads, under their original names.

    A parameter or persistent buffer the forward never touches is still part of the model:
    one the module's steps read (a loss's class weights, a learnable temperature, a teacher),
    or one nothing reads (a head kept for later). It is in the ``state_dict``, the optimizer's
    state (Adagrad makes state for every parameter up front) and so the checkpoint, which
    must load into the plain model with ``strict=True``. A stage holding nothing but what its
    graph reads would drop it; the last stage, where the steps run, keeps it instead. A holder
    module is made for each missing step of its path, so no module of the user's gains an
    attribute.
    """
    names = stage.meta["autopipe"]["param_names"]
    for name, tensor in orphans.items():
        path, _, field = name.rpartition(".")
        owner: nn.Module = stage
        for part in path.split(".") if path else []:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(field, tensor)
        else:
            owner.register_buffer(field, tensor)
        names[name] = name


def build_stage(
    info: GraphInfo,
    blocks: list[list[fx.Node]],
    inputs: list[fx.Node],
    outputs: list[Any],
    block_range: tuple[int, int],
    original_names: dict[int, list[str]],
) -> StageModule:
    """Build the module computing ``outputs`` from ``inputs`` through ``blocks``' nodes.

    Args:
        info: the analysed graph.
        blocks: anchored nodes of each block in the range, in order.
        inputs: the values entering the range (boundary ``i``).
        outputs: the values leaving the range (boundary ``j``; for the last block the model's
            flattened outputs, which may include constants).
        block_range: ``(i, j)`` for the metadata.
        original_names: id(tensor) -> its names in the original model's ``state_dict``.
    """
    builder = _Builder(info, inputs, [n for nodes in blocks for n in nodes])
    for nodes in blocks:
        for n in nodes:
            builder.add(n)
    node_outputs = [v for v in outputs if isinstance(v, fx.Node)]
    builder.output(node_outputs)
    builder.graph.lint()
    root = info.traced.gm
    stage = StageModule(root, builder.graph, class_name="StageModule")
    shared = {id(m) for m in root.modules()} | {id(m) for m in info.traced.model.modules()}
    _fix_buffers(stage, shared, set(original_names))
    param_names: dict[str, str] = {}
    for key, tensor in stage.state_dict(keep_vars=True).items():
        names = original_names.get(id(tensor))
        if not names:
            raise TraceError(
                f"internal: stage tensor {key!r} has no name in the original state_dict"
            )
        param_names[key] = key if key in names else names[0]
    stage.meta["autopipe"] = {
        "blocks": block_range,
        "param_names": param_names,
        "inputs": tuple(v.name for v in inputs),
        "outputs": tuple(v.name for v in node_outputs),
    }
    return stage
