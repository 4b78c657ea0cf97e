"""Node-level facts about a traced graph: values, module paths, and which nodes may float.

A node is *anchored* when it runs in exactly one block (tensor-valued work that depends on the
inputs), or *floating* when every block that needs it recomputes its own copy: parameters and
buffers (``get_attr``), constants, and cheap non-tensor values such as sizes. Floating nodes are
what keep SymInts, shapes and parameters from ever crossing a stage boundary.

The example run also records which values alias one storage (a view, an in-place op's result)
and which storages the graph writes in place: two aliases sent over one stage boundary arrive
as two tensors, so a write through one would no longer reach the other (:mod:`~.cuts` never
cuts there, :mod:`~.stage` clones a received tensor written through a view).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from lightning_autopipe.errors import GraphRunError
from lightning_autopipe.graph.trace import Traced, _short, buffers_kept, has_meta, on_meta

__all__ = ["GraphInfo", "ValueMeta", "analyze"]

_NO_PATH = {"", "_empty_nn_module_stack_from_metadata_hook"}


@dataclass(frozen=True)
class ValueMeta:
    """What a node produced on the example inputs."""

    is_tensor: bool
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    nbytes: int = 0
    requires_grad: bool = False


@dataclass
class GraphInfo:
    """Facts about every node of ``traced.gm.graph`` (nodes are never mutated)."""

    traced: Traced
    nodes: list[fx.Node]
    index: dict[fx.Node, int]
    meta: dict[fx.Node, ValueMeta]
    dropped: set[fx.Node]
    floating: set[fx.Node]
    anchored: list[fx.Node]
    path: dict[fx.Node, str | None]
    params_of: dict[fx.Node, dict[int, int]]  # node -> {id(param): numel} it reads directly
    modules: dict[str, nn.Module]
    #: tensor node -> the node whose value owns its storage (itself unless it is a view or an
    #: in-place op's result): values with one root are aliases of one tensor
    alias_root: dict[fx.Node, fx.Node] = field(default_factory=dict)
    #: roots whose storage an anchored node writes in place (through any of its aliases)
    mutated_roots: set[fx.Node] = field(default_factory=set)
    #: node -> {module path: which call of that module (0 = the first) ran it}, for every
    #: module on its stack that the trace saw called more than once (a module applied in a
    #: loop, as ALBERT applies its one shared layer: each call can be a block of its own)
    calls: dict[fx.Node, dict[str, int]] = field(default_factory=dict)

    def is_value(self, node: fx.Node) -> bool:
        """Anchored nodes and model inputs: the only values that may cross blocks."""
        return node in self._value_set

    def __post_init__(self) -> None:
        self._value_set = set(self.anchored) | set(self.traced.input_nodes)
        self._reqs: dict[fx.Node, tuple[frozenset[fx.Node], frozenset[fx.Node]]] = {}

    def reqs(self, node: fx.Node) -> tuple[frozenset[fx.Node], frozenset[fx.Node]]:
        """Values and symbolic-size leaves that computing ``node`` needs.

        Floating arguments are expanded (they are recomputed where used). A ``sym_size`` leaf
        of an exported graph is returned separately: any available tensor carrying the same
        symbol can stand in for its source tensor, which need not be carried.
        """
        if node in self._reqs:
            return self._reqs[node]
        values: set[fx.Node] = set()
        syms: set[fx.Node] = set()
        for arg in _arg_nodes(node):
            if self.is_value(arg):
                values.add(arg)
            elif arg in self.floating:
                if self.is_sym_leaf(arg):
                    syms.add(arg)
                else:
                    sub_values, sub_syms = self.reqs(arg)
                    values |= sub_values
                    syms |= sub_syms
        result = (frozenset(values), frozenset(syms))
        self._reqs[node] = result
        return result

    def is_sym_leaf(self, node: fx.Node) -> bool:
        return (
            node.target is torch.ops.aten.sym_size.int
            and isinstance(node.meta.get("val"), torch.SymInt)
            and isinstance(node.args[0], fx.Node)
        )

    def sym_dims(self, node: fx.Node) -> dict[Any, int]:
        """Symbolic size expression -> dim, for tensors of an exported graph."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return {}
        out = {}
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                out.setdefault(size.node.expr, d)
        return out


def _arg_nodes(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


def _module_path(node: fx.Node) -> str | None:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return None if path in _NO_PATH else str(path)


def _module_calls(node: fx.Node) -> dict[str, int]:
    """Module path -> call number for the modules on ``node``'s stack: both tracers key a
    module's second and later calls ``<key>@<k>`` (k = 1, 2, ...)."""
    out: dict[str, int] = {}
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        head, _, count = str(key).rpartition("@")
        path = value[0] if isinstance(value, tuple) and value else None
        if head and count.isdigit() and isinstance(path, str) and path not in _NO_PATH:
            out[path] = int(count)
    return out


def _is_dropped_kind(node: fx.Node) -> bool:
    """Runtime guards of the trace (shape asserts, export's input guard) are not computation."""
    if node.op == "call_module" and node.target == "_guards_fn":
        return True
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "") or str(node.target)
    return "assert" in name or "sym_constrain_range" in str(node.target)


def mutates_first_arg(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` writes its first argument in place (``x.add_(...)``, an
    ``inplace=True`` module or function, an aten op whose schema marks argument 0 written)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_module":
        try:
            return bool(getattr(root.get_submodule(str(node.target)), "inplace", False))
        except AttributeError:
            return False
    if node.op == "call_function":
        if node.kwargs.get("inplace", False):
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.arguments:
            alias = schema.arguments[0].alias_info
            return bool(alias is not None and alias.is_write)
        return getattr(node.target, "__name__", "").endswith("_")
    return False


def _is_impure(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    if node.op == "call_module":
        return False
    try:
        return node.is_impure()
    except Exception:  # noqa: BLE001 - unknown targets are treated as pure
        return False


class _Recorder(fx.Interpreter):
    """Runs the graph once on the example inputs and records what each node produced."""

    def __init__(self, gm: fx.GraphModule, feeds: dict[fx.Node, Any], dropped: set[fx.Node]):
        super().__init__(gm, garbage_collect_values=True)
        self.feeds = feeds
        self.dropped = dropped
        self.meta: dict[fx.Node, ValueMeta] = {}
        self.current: fx.Node | None = None
        self.alias_root: dict[fx.Node, fx.Node] = {}
        # id(storage-owning tensor) -> (a weak reference to it, the first node that produced
        # it): values are freed as the run goes, so an id is trusted only while it is alive
        self._owners: dict[int, tuple[weakref.ref, fx.Node]] = {}

    def _note_alias(self, n: fx.Node, value: torch.Tensor) -> None:
        base = value._base if value._base is not None else value
        known = self._owners.get(id(base))
        if known is not None and known[0]() is base:
            self.alias_root[n] = known[1]
        else:
            self._owners[id(base)] = (weakref.ref(base), n)
            self.alias_root[n] = n

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        if n.op == "placeholder":
            value = self.feeds[n]
        elif n in self.dropped:
            return None
        else:
            value = super().run_node(n)
        if isinstance(value, torch.Tensor):
            self._note_alias(n, value)
            self.meta[n] = ValueMeta(
                True,
                tuple(value.shape),
                value.dtype,
                value.numel() * value.element_size(),
                bool(value.requires_grad),
            )
        else:
            self.meta[n] = ValueMeta(False)
        return value


def _record(
    traced: Traced, flat: tuple[torch.Tensor, ...], dropped: set[fx.Node]
) -> tuple[dict[fx.Node, ValueMeta], dict[fx.Node, fx.Node]]:
    feeds: dict[fx.Node, Any] = dict(zip(traced.input_nodes, flat))
    feeds.update(traced.constant_inputs)
    recorder = _Recorder(traced.gm, feeds, dropped)
    # A model built on the meta device runs on shapes alone (values are not needed here).
    deferred = has_meta(traced.gm) or has_meta(traced.model)
    try:
        with buffers_kept(traced.gm, traced.model), torch.enable_grad(), (
                on_meta() if deferred else nullcontext()):
            recorder.run()
    except Exception as exc:  # noqa: BLE001 - reported as an input problem with the node
        node = recorder.current
        path = _module_path(node) if node is not None else None
        where = ("the start" if node is None else f"node {node.name} ({node.op} {node.target})"
                 + (f" in module {path!r}" if path is not None else ""))
        shapes = ", ".join(str(s) for s in traced.example_shapes)
        raise GraphRunError(
            f"running the traced model on example_inputs (shapes {shapes}) failed at {where}: "
            f"{_short(exc)}; pass example inputs of the shape/dtype the model expects",
            where, _short(exc)) from exc
    return recorder.meta, recorder.alias_root


def analyze(traced: Traced, flat_inputs: tuple[torch.Tensor, ...]) -> GraphInfo:
    """Classify every node of the traced graph (see module docstring)."""
    gm = traced.gm
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    dropped = {n for n in nodes if _is_dropped_kind(n)}
    for n in reversed(nodes):  # dead code: pure nodes all of whose users are dropped
        if n.op in ("placeholder", "output", "call_module") or n in dropped:
            continue  # a module call stays: it may be made for its side effects
        if all(u in dropped for u in n.users) and not _is_impure(n):
            dropped.add(n)
    meta, alias_root = _record(traced, flat_inputs, dropped)

    inputs = set(traced.input_nodes)
    depends: dict[fx.Node, bool] = {}
    floating: set[fx.Node] = set()
    anchored: list[fx.Node] = []
    for n in nodes:
        if n is output or n in dropped:
            continue
        if n.op == "placeholder":
            depends[n] = n in inputs
            if n not in inputs:
                floating.add(n)
            continue
        if n.op == "get_attr":
            depends[n] = False
            floating.add(n)
            continue
        depends[n] = any(depends.get(a, False) for a in _arg_nodes(n))
        value = meta.get(n, ValueMeta(False))
        pure = n.op != "call_module" and not _is_impure(n)
        if pure and (not value.is_tensor or not depends[n]):
            floating.add(n)
        else:
            anchored.append(n)

    modules = dict(traced.model.named_modules(remove_duplicate=False))
    gm_modules = dict(gm.named_modules(remove_duplicate=False))
    path = {n: _module_path(n) for n in nodes}
    calls = {n: c for n in nodes if (c := _module_calls(n))}
    params_of: dict[fx.Node, dict[int, int]] = {}
    for n in nodes:
        reads: dict[int, int] = {}
        if n.op == "get_attr":
            obj = _get_attr(gm, str(n.target))
            if isinstance(obj, nn.Parameter):
                reads[id(obj)] = obj.numel()
        elif n.op == "call_module":
            mod = gm_modules.get(str(n.target))
            if mod is not None:
                reads = {id(p): p.numel() for p in mod.parameters()}
        params_of[n] = reads
    mutated_roots = {
        alias_root[a] for n in anchored
        if mutates_first_arg(n, gm) and (a := n.args[0] if n.args else None) in alias_root
    }
    return GraphInfo(
        traced=traced,
        nodes=nodes,
        index=index,
        meta=meta,
        dropped=dropped,
        floating=floating,
        anchored=anchored,
        path=path,
        params_of=params_of,
        modules=modules,
        alias_root=alias_root,
        mutated_roots=mutated_roots,
        calls=calls,
    )


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
