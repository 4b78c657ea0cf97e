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
A backward run outside a deferral runs ``B`` and ``W`` at once: the same gradients.

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

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from lightning_autopipe.options import SPLIT_BACKENDS

__all__ = ["SPLIT_BACKENDS", "Deferral", "SplitBackward", "accumulate_deferred",
           "split_backend", "split_backward_graph"]


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
    w_from_inputs: list[int] = field(default_factory=list)  # W reads these backward inputs
    num_from_b: int = 0  # ...then these values B returns after its input gradients


def split_backward_graph(
    gm: fx.GraphModule, weight_positions: set[int]
) -> tuple[fx.GraphModule, fx.GraphModule, _Cut] | None:
    """``gm`` (a backward graph: one output per forward input) cut into ``B`` and ``W``.

    ``B`` takes ``gm``'s inputs and returns the outputs not in ``weight_positions``, then the
    values ``W`` reads that ``B`` computes; ``W`` takes the inputs of ``gm`` it reads, then
    those values, and returns the outputs at ``weight_positions``. None when there is nothing
    to defer (no weight gradient computed by nodes of its own).
    """
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    outs = list(output.args[0])
    placeholders = [n for n in nodes if n.op == "placeholder"]
    b_pos = [i for i in range(len(outs)) if i not in weight_positions]
    w_pos = sorted(weight_positions)
    need_b = _ancestors(outs[i] for i in b_pos)
    need_w = _ancestors(outs[i] for i in w_pos)
    w_only = [n for n in nodes if n in need_w and n not in need_b and n.op != "placeholder"]
    if not w_only:
        return None
    w_only_set = set(w_only)
    reads: list[fx.Node] = []
    for n in [*w_only, *(outs[i] for i in w_pos)]:
        for a in (n.all_input_nodes if n in w_only_set else [n]):
            if isinstance(a, fx.Node) and a not in w_only_set and a not in reads:
                reads.append(a)
    from_inputs = [n for n in reads if n.op == "placeholder"]
    from_b = [n for n in reads if n.op != "placeholder"]

    b_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" or (n in need_b and n.op != "output"):
            env[n] = b_graph.node_copy(n, lambda a: env[a])
    b_graph.output(tuple(_mapped(outs[i], env) for i in b_pos) + tuple(env[n] for n in from_b))

    w_graph = fx.Graph()
    w_env: dict[fx.Node, fx.Node] = {}
    for n in [*from_inputs, *from_b]:
        p = w_graph.placeholder(n.name)
        p.meta = dict(n.meta)
        w_env[n] = p
    for n in w_only:
        w_env[n] = w_graph.node_copy(n, lambda a: w_env[a])
    w_graph.output(tuple(_mapped(outs[i], w_env) for i in w_pos))

    cut = _Cut(b_pos, w_pos, len(outs), [placeholders.index(n) for n in from_inputs],
               len(from_b))
    return fx.GraphModule(gm, b_graph), fx.GraphModule(gm, w_graph), cut


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
                 deferral: Deferral) -> None:
        # an instance attribute: the wrappers AOTAutograd puts around it copy ``__dict__``
        self._boxed_call = True
        self.b, self.w, self.cut = b, w, cut
        self.params = params  # the parameter of each weight position
        self.deferral = deferral

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
        with torch.no_grad():
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
        weights = {i for i, t in enumerate(example_inputs) if isinstance(t, nn.Parameter)}
        params = {i: t for i, t in enumerate(example_inputs) if i in weights}

        def splitting(inner: Callable) -> Callable:
            def compile_backward(bw: fx.GraphModule, bw_inputs: Sequence[Any], **kw: Any):
                outs = next(n for n in bw.graph.nodes if n.op == "output").args[0]
                if len(outs) != len(example_inputs):  # not one gradient per forward input
                    deferral.unsplit += 1
                    warnings.warn(
                        f"compile: a backward graph returns {len(outs)} gradients for "
                        f"{len(example_inputs)} forward inputs, so it cannot be cut into input "
                        "and weight gradients; it runs whole in B (correct, but this graph's "
                        "weight gradients do not fill the pipeline's bubbles)", stacklevel=2)
                    return inner(bw, bw_inputs, **kw)
                cut = split_backward_graph(bw, weights)
                if cut is None:  # no weight gradient in this graph: nothing to defer
                    return inner(bw, bw_inputs, **kw)
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
                    inner(b_gm, bw_inputs, **kw), inner(w_gm, w_examples, **w_kw), where,
                    [params[i] for i in where.w_positions], deferral,
                )
            return compile_backward

        # a cached compile would come back whole: each compile here cuts its own backward;
        # and no donated buffers: the backward may not write into the saved activations it
        # is given, since W reads some of them after B
        with torch._functorch.config.patch(enable_autograd_cache=False, donated_buffer=False):
            if backend == "inductor":
                from torch._inductor.compile_fx import compile_fx, compile_fx_inner

                def halves(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
                    # the graph cache checks a cached entry's shape guards against the
                    # inputs of the graph Dynamo traced, which W's inputs are not
                    with torch._inductor.config.patch(fx_graph_cache=False):
                        return compile_fx_inner(g, ex, **kw)

                def inner(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
                    if kw.get("is_backward"):
                        return splitting(halves)(g, ex, **kw)
                    return compile_fx_inner(g, ex, **kw)

                return compile_fx(gm, example_inputs, inner_compile=inner)
            from torch._dynamo.backends.debugging import aot_eager, boxed_nop

            return aot_eager(gm, example_inputs, bw_compiler=splitting(boxed_nop))

    return compile_graph


def _keep_saved_activations() -> None:
    """No donated buffers for this backward (also when lowered lazily, after the patch in
    :func:`split_backend` has ended): a donated saved activation may be overwritten by ``B``,
    and ``W`` reads some of them afterwards (seen: a layer norm's weight gradient came out
    wrong under inductor)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and getattr(context, "fw_metadata", None) is not None:
        context.fw_metadata.bw_donated_idxs = []


def accumulate_deferred(pending: Sequence[tuple[SplitBackward, list[Any]]]) -> None:
    """``W`` of one unit: every weight half its ``B`` deferred, in the order they ran."""
    for graph, w_inputs in pending:
        graph.accumulate(w_inputs)
