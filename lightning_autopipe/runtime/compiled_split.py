"""Zero bubble for compiled stages: the compiled backward cut into an input-gradient graph
(``B``) and a weight-gradient graph (``W``).

Why this is needed: ``torch.compile`` turns a stage's forward into one autograd node, and
AOTAutograd compiles that node's backward as one graph that returns the input *and* the weight
gradients together. There is no autograd node to split at (torch pipelining's
``stage_backward_weight`` would rerun the whole backward), so ZB-H1's ``W`` action, which must
run later than ``B``, needs two compiled graphs.

How: the backend here is the named backend's own compile (inductor's ``compile_fx``, or
AOTAutograd with the eager compiler of ``aot_eager``) with one change: the backward graph it
would compile is first cut in two (:func:`split_backward_graph`). Its outputs are one gradient
per forward input, in the forward's input order; those of ``nn.Parameter`` inputs are the
weight gradients. ``W`` is every node that only the weight gradients need; ``B`` is the rest,
and also returns the values ``W`` reads (the gradients flowing into each layer's output, the
activations its weight gradient multiplies). Both halves are compiled by the backend's own
compiler. At run time (:class:`SplitBackward`) the autograd engine calls ``B``, which hands the
engine the input gradients (and None for the weights, so nothing is accumulated); what ``W``
needs is queued on the :class:`Deferral` the executor opened for that backward, and the
executor's ``W`` action runs the weight graph and accumulates its gradients through autograd
(``AccumulateGrad``: ``.grad`` views and post-accumulate hooks see them as from any backward).
A backward run outside a deferral runs ``B`` and ``W`` at once: the same gradients. (Autograd
still calls a parameter's post-accumulate hooks after ``B``, with no new ``.grad``; the data-
parallel buckets count gradients only once armed, which a split stage is not before ``W``.)

Two things the halves must not share with the whole: AOTAutograd lets a backward overwrite the
saved activations it is handed ("donated buffers"), and ``W`` reads some of them after ``B``,
so donation is off for split graphs; and a compile cached whole would come back whole, so
the AOTAutograd cache is off for them. Operators Dynamo leaves to eager code between graphs (a
graph break) keep their eager backward: their weight gradients arrive in ``B``.

A backward graph whose outputs do not line up with the forward's inputs is compiled whole and
its backward stays whole (``W`` then has nothing left to do): correct, without the overlap;
:attr:`Deferral.unsplit` counts such graphs, and each one warns.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_autopipe.options import SPLIT_BACKENDS

__all__ = ["Deferral", "SplitBackward", "split_backend", "split_backward_graph"]


@dataclass
class Deferral:
    """Where one stage's compiled backwards leave their weight halves.

    ``pending`` is None outside a deferred backward (``B`` and ``W`` then run together); inside
    :meth:`open`, each compiled graph's ``B`` appends its ``(graph, values)`` there.
    """

    pending: list[tuple[SplitBackward, list[Any]]] | None = None
    unsplit: int = 0
    split: int = 0

    def open(self) -> list[tuple[SplitBackward, list[Any]]]:
        self.pending = []
        return self.pending

    def close(self) -> None:
        self.pending = None


@dataclass
class _Cut:
    """The positions and values that connect the two halves of one backward graph."""

    b_positions: list[int]
    w_positions: list[int]
    num_outputs: int
    w_from_inputs: list[int]  # W reads these backward inputs, then what B returns after its
    # input gradients


def split_backward_graph(
    gm: fx.GraphModule, weight_positions: set[int]
) -> tuple[fx.GraphModule, fx.GraphModule, _Cut] | None:
    """``gm`` (a backward graph: one output per forward input) cut into ``B`` and ``W``.

    ``B`` takes ``gm``'s inputs and returns the outputs not in ``weight_positions``, then the
    values ``W`` reads that ``B`` computes; ``W`` takes the inputs of ``gm`` it reads, then
    those values, and returns the outputs at ``weight_positions``. None when there is nothing
    to defer (no weight gradient computed by nodes of its own).

    Only tensors cross the cut. An operator that computes several gradients at once under an
    ``output_mask`` (convolution, layer and batch norm backwards, as ``aot_eager`` and
    inductor's CPU fallbacks leave them) runs twice, masked: in ``B`` for the input gradient,
    in ``W`` for the weight and bias gradients. The parts of any other multi-output operator
    that ``W`` needs are taken in ``B``. Nodes with side effects (an in-place copy into an
    input, a shape assertion) have no users and stay in ``B``.
    """
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    outs = list(output.args[0])
    placeholders = [n for n in nodes if n.op == "placeholder"]
    b_pos = [i for i in range(len(outs)) if i not in weight_positions]
    w_pos = sorted(weight_positions)
    effects = [n for n in nodes if n.op == "call_function" and n.is_impure()]
    need_b = _ancestors([*(outs[i] for i in b_pos), *effects])
    need_w = _ancestors(outs[i] for i in w_pos)
    masked: dict[fx.Node, tuple[set[int], set[int]]] = {}  # node -> (B's parts, W's parts)
    for n in nodes:
        if n in need_b and n in need_w and _mask_arg(n) is not None:
            parts = [(u.args[1], u in need_b) for u in n.users if _is_getitem(u)]
            w_parts = {i for i, in_b in parts if not in_b}
            if w_parts and len(parts) == len(n.users):
                masked[n] = ({i for i, in_b in parts if in_b}, w_parts)
    for n in nodes:  # the W parts of other multi-output nodes of B are taken in B
        if (_is_getitem(n) and n in need_w and n not in need_b and n.args[0] in need_b
                and n.args[0] not in masked):
            need_b.add(n)
    w_only = [n for n in nodes if n in need_w and n not in need_b and n.op != "placeholder"]
    if not any(n.op == "call_function" and not _is_getitem(n) for n in w_only) and not masked:
        return None
    w_only_set = set(w_only)
    reads: list[fx.Node] = []

    def read(a: Any) -> None:
        if isinstance(a, fx.Node) and a not in w_only_set and a not in reads:
            reads.append(a)

    for n in w_only:
        for a in n.all_input_nodes:
            for b in (a.all_input_nodes if a in masked else [a]):
                read(b)
    for i in w_pos:
        if outs[i] not in w_only_set:
            read(outs[i])
    from_inputs = [n for n in reads if n.op == "placeholder"]
    from_b = [n for n in reads if n.op != "placeholder"]

    b_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" or (n in need_b and n.op != "output"):
            env[n] = b_graph.node_copy(n, lambda a: env[a])
            if n in masked:
                _restrict_mask(env[n], masked[n][0])
    b_graph.output(tuple(_mapped(outs[i], env) for i in b_pos) + tuple(env[n] for n in from_b))

    w_graph = fx.Graph()
    w_env: dict[fx.Node, fx.Node] = {}
    for n in [*from_inputs, *from_b]:
        p = w_graph.placeholder(n.name)
        p.meta = dict(n.meta)
        w_env[n] = p
    for n in nodes:
        if n in masked or n in w_only_set:
            w_env[n] = w_graph.node_copy(n, lambda a: w_env[a])
            if n in masked:
                _restrict_mask(w_env[n], masked[n][1])
    w_graph.output(tuple(_mapped(outs[i], w_env) for i in w_pos))

    cut = _Cut(b_pos, w_pos, len(outs), [placeholders.index(n) for n in from_inputs])
    return fx.GraphModule(gm, b_graph), fx.GraphModule(gm, w_graph), cut


def _is_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


def _mask_arg(n: fx.Node) -> tuple[str, int] | None:
    """Where ``n``'s ``output_mask`` argument is (("args", i) or ("kwargs", -1)), if any."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None:
        return None
    names = [a.name for a in schema.arguments]
    if "output_mask" not in names:
        return None
    if "output_mask" in n.kwargs:
        return "kwargs", -1
    i = names.index("output_mask")
    return ("args", i) if i < len(n.args) else None


def _restrict_mask(n: fx.Node, keep: set[int]) -> None:
    """``n`` computes only the outputs in ``keep`` (of those its mask asked for)."""
    where, i = _mask_arg(n)  # type: ignore[misc]
    mask = n.kwargs["output_mask"] if where == "kwargs" else n.args[i]
    new = [bool(m) and k in keep for k, m in enumerate(mask)]
    if where == "kwargs":
        n.kwargs = {**n.kwargs, "output_mask": new}
    else:
        n.args = (*n.args[:i], new, *n.args[i + 1:])
    val = n.meta.get("val")
    if isinstance(val, tuple | list):
        n.meta["val"] = type(val)(v if k in keep else None for k, v in enumerate(val))


def _ancestors(roots: Any) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _mapped(value: Any, env: dict[fx.Node, fx.Node]) -> Any:
    return env[value] if isinstance(value, fx.Node) else value


class SplitBackward:
    """One compiled backward as its two halves (boxed calling convention, as AOTAutograd
    calls a compiled backward: one list of inputs, which the call consumes)."""

    def __init__(self, b: Callable, w: Callable, cut: _Cut, params: list[nn.Parameter],
                 deferral: Deferral, graphs: tuple[fx.GraphModule, fx.GraphModule]) -> None:
        # an instance attribute: the wrappers AOTAutograd puts around it copy ``__dict__``
        self._boxed_call = True
        self.b, self.w, self.cut = b, w, cut
        self.params = params  # the parameter of each weight position
        self.deferral = deferral
        self.graphs = graphs  # what each half computes (B, W), for inspection

    def __call__(self, inputs: list[Any]) -> list[Any]:
        cut = self.cut
        w_inputs = [inputs[i] for i in cut.w_from_inputs]
        results = list(self.b(inputs))
        n = len(cut.b_positions)
        w_inputs += results[n:]
        grads: list[Any] = [None] * cut.num_outputs
        for pos, value in zip(cut.b_positions, results[:n], strict=True):
            grads[pos] = value
        if self.deferral.pending is not None:
            self.deferral.pending.append((self, w_inputs))
            return grads
        for pos, value in zip(cut.w_positions, self._weights(w_inputs), strict=True):
            grads[pos] = value
        return grads

    def _weights(self, w_inputs: list[Any]) -> list[Any]:
        # as AOTAutograd runs a compiled backward: no autograd, no autocast (the graph has
        # its casts; the executor's W runs inside the step's autocast region)
        with torch.no_grad(), torch._C._DisableAutocast():
            return list(self.w(w_inputs))

    def accumulate(self, w_inputs: list[Any]) -> None:
        """``W``: the weight gradients, accumulated into ``.grad`` by autograd."""
        pairs = [(p, g) for p, g in zip(self.params, self._weights(w_inputs), strict=True)
                 if g is not None and p.requires_grad]
        if pairs:
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


def split_backend(backend: str, deferral: Deferral, count: Callable[..., None]) -> Callable:
    """A ``torch.compile`` backend that compiles like ``backend`` with split backwards.

    ``count(gm, example_inputs)`` is called once per graph Dynamo hands over (the caller's
    compile counter).
    """
    if backend not in SPLIT_BACKENDS:
        raise ValueError(f"cannot split the backward of backend {backend!r}; "
                         f"splittable: {SPLIT_BACKENDS}")

    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        count(gm, example_inputs)
        params = {i: t for i, t in enumerate(example_inputs) if isinstance(t, nn.Parameter)}

        def splitting(whole: Callable, half: Callable) -> Callable:
            """The backward compiler: ``half`` compiles each half of a cut graph, ``whole`` a
            graph that stays whole (as the backend compiles any backward)."""

            def compile_backward(bw: fx.GraphModule, bw_inputs: Sequence[Any], **kw: Any):
                outs = next(n for n in bw.graph.nodes if n.op == "output").args[0]
                why = None
                if len(outs) != len(example_inputs):
                    why = (f"returns {len(outs)} gradients for {len(example_inputs)} forward "
                           "inputs")
                elif any(is_traceable_wrapper_subclass(t) for t in example_inputs):
                    why = "has tensor-subclass inputs (their gradients are wrapped outside it)"
                if why is not None:
                    deferral.unsplit += 1
                    warnings.warn(
                        f"compile: a backward graph {why}, so it cannot be cut into input and "
                        "weight gradients; it runs whole in B (correct, but this graph's "
                        "weight gradients do not fill the pipeline's bubbles)", stacklevel=2)
                    return whole(bw, bw_inputs, **kw)
                cut = split_backward_graph(bw, set(params))
                if cut is None:  # no weight gradient in this graph: nothing to defer
                    return whole(bw, bw_inputs, **kw)
                b_gm, w_gm, where = cut
                _keep_saved_activations()
                w_places = [n for n in w_gm.graph.nodes if n.op == "placeholder"]
                w_examples = [bw_inputs[i] for i in where.w_from_inputs] + [
                    n.meta["val"] for n in w_places[len(where.w_from_inputs):]]
                w_kw = dict(kw)
                if "static_input_idxs" in w_kw:  # they index bw's inputs, not W's
                    w_kw["static_input_idxs"] = []
                deferral.split += 1
                return SplitBackward(
                    half(b_gm, bw_inputs, **kw), half(w_gm, w_examples, **w_kw), where,
                    [params[i] for i in where.w_positions], deferral, (b_gm, w_gm),
                )

            return compile_backward

        # a cached compile would come back whole: each compile here cuts its own backward;
        # and no donated buffers: the backward may not write into the saved activations it
        # is given, since W reads some of them after B
        with torch._functorch.config.patch(enable_autograd_cache=False, donated_buffer=False):
            if backend == "inductor":
                from torch._inductor.compile_fx import (
                    compile_fx,
                    compile_fx_inner,
                    record_original_output_strides,
                )

                def halves(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
                    # B's outputs keep the strides of the traced graph (W is compiled for
                    # them), as inductor keeps a backward's user-visible outputs
                    out = next(n for n in g.graph.nodes if n.op == "output")
                    out.meta["user_visible_output_idxs"] = [
                        i for i, v in enumerate(out.args[0]) if isinstance(v, fx.Node)]
                    out.meta.pop("original_output_strides", None)
                    record_original_output_strides(g)
                    # the graph cache checks a cached entry's shape guards against the
                    # inputs of the graph Dynamo traced, which W's inputs are not
                    with torch._inductor.config.patch(fx_graph_cache=False):
                        return compile_fx_inner(g, ex, **kw)

                def inner(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
                    if kw.get("is_backward"):
                        return splitting(compile_fx_inner, halves)(g, ex, **kw)
                    return compile_fx_inner(g, ex, **kw)

                return compile_fx(gm, example_inputs, inner_compile=inner)
            from torch._dynamo.backends.debugging import aot_eager, boxed_nop

            return aot_eager(gm, example_inputs, bw_compiler=splitting(boxed_nop, boxed_nop))

    return compile_graph


def _keep_saved_activations() -> None:
    """No donated buffers for this backward (also when lowered lazily, after the patch in
    :func:`split_backend` has ended): a donated saved activation may be overwritten by ``B``,
    and ``W`` reads some of them afterwards (seen: a layer norm's weight gradient came out
    wrong under inductor)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and getattr(context, "fw_metadata", None) is not None:
        context.fw_metadata.bw_donated_idxs = []
