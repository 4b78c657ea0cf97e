"""Tracing front ends: capture a model as a torch.fx graph (fx, torch.export, or user-given).

The result, :class:`Traced`, hides which front end ran: it holds one ``GraphModule`` whose
placeholders are the model's *flattened* inputs and whose output node yields the flattened
outputs, plus the recipes to flatten user inputs and rebuild model-shaped outputs.

Both front ends, their fallbacks (torch.export when fx cannot trace, or when fx's graph fails
where the model runs) and the quiet-while-trying log handling stay in this one module (past
~400 lines): the choice between them is one decision with one error message.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from lightning_autopipe.errors import GraphRunError, InputError, OptionError, TraceError
from lightning_autopipe.graph import autograd_calls as calls
from lightning_autopipe.graph.fx_guard import Unrecorded, mode_difference, plain, watch_unrecorded
from lightning_autopipe.graph.modes import kept_mode, mode_nodes, mode_values

__all__ = ["TRACE_LOGS_ENV", "Inputs", "Traced", "buffers_kept", "has_meta", "normalize_inputs",
           "on_meta", "trace", "unfaithful_fx", "warn_kept_mode"]

Inputs = tuple[Any, ...] | dict[str, Any]
TRACERS = ("auto", "fx", "export")
_REMEDIES = (
    "Remedies: (1) rewrite data-dependent Python branches with torch.where / torch.cond so that "
    "torch.export can capture the model (AutoPipeStrategy and split_model's default "
    "tracer='auto' already try torch.export after torch.fx; give the module an "
    "example_input_array, or split_model example_inputs), or (2) with split_model, pass a "
    "pre-traced torch.fx.GraphModule (e.g. torch.fx.symbolic_trace(model, concrete_args=...)) "
    "instead of the model. The tracers' own logs were hidden while they were tried: set "
    "AUTOPIPE_TRACE_LOGS=1 to see them (and the chained torch exception)."
)
TRACE_LOGS_ENV = "AUTOPIPE_TRACE_LOGS"
"""Set to ``1`` to let torch.fx / torch.export print while they are tried (graph dumps,
symbolic-shape warnings) and to chain their exception to the ``TraceError``."""


def _show_tracer_logs() -> bool:
    return os.environ.get(TRACE_LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no")


@contextmanager
def _quiet_tracers() -> Iterator[None]:
    """Hide what the tracers print while they are tried: a failing ``torch.export`` prints
    its graph per attempt and logs symbolic-shape warnings (hundreds of lines for one Python
    branch on a tensor), burying the one ``TraceError`` that names the construct and the fix.
    """
    if _show_tracer_logs():
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _cause(exc: BaseException) -> BaseException | None:
    """The tracer's exception to chain to a ``TraceError``: only when its logs are asked for
    (its traceback runs hundreds of lines through torch internals)."""
    return exc if _show_tracer_logs() else None


@dataclass
class Traced:
    """A captured model.

    Attributes:
        gm: the graph module; run it on ``flatten(inputs)`` to get the flat outputs.
        tracer: ``"fx"``, ``"export"`` or ``"graph_module"`` (a user-given GraphModule).
        model: the module whose ``state_dict`` names are the original names.
        input_nodes: placeholders fed by the user's inputs, in flattened order.
        constant_inputs: placeholders specialised to a constant (unprovided defaults).
        output_leaves: flattened outputs (graph nodes or constants) of the output node.
        out_spec: pytree spec rebuilding the model-shaped output from ``output_leaves``.
        flatten: user inputs (tuple or dict) -> tuple of tensors, in ``input_nodes`` order.
        example_shapes: shapes of the flattened example inputs (batch dim 0 included).
        dynamic_batch: whether dim 0 of the inputs may differ from the example's.
        mode_line: (fx) where the forward computes differently in the other train/eval mode
            (the graph keeps the traced mode's code), or None.
    """

    gm: fx.GraphModule
    tracer: str
    model: nn.Module
    input_nodes: list[fx.Node]
    constant_inputs: dict[fx.Node, Any]
    output_leaves: list[Any]
    out_spec: pytree.TreeSpec
    flatten: Callable[[Inputs], tuple[torch.Tensor, ...]]
    example_shapes: list[tuple[int, ...]]
    dynamic_batch: bool = True
    notes: list[str] = field(default_factory=list)
    #: (fx) the first graph line that differs in the other train/eval mode, or None
    mode_line: str | None = None
    #: (export) node -> (argument index, its value in training, in evaluation): the constants
    #: by which train()/eval() changed the exported graph; stages read their mode there
    mode_values: dict[fx.Node, tuple[int, Any, Any]] = field(default_factory=dict)


def has_meta(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter or buffer on the meta device (built deferred)."""
    tensors = [*module.parameters(), *(b for b in module.buffers() if b is not None)]
    return any(t.device.type == "meta" for t in tensors)


class on_meta(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.device
    """Every tensor an op sees is moved to the meta device first: a model whose parameters
    are on the meta device (and whose buffers or inputs are not) runs on shapes alone, as the
    graph layer's example run needs (factories follow, since ``x.device`` answers ``meta``)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def meta(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                return v.to("meta")
            return v

        return func(*pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs or {}))


def normalize_inputs(example_inputs: Any) -> Inputs:
    """Accept a tensor, a tuple/list of positional inputs or a dict of keyword inputs."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list | tuple):
        values: Any = tuple(example_inputs)
        items = list(enumerate(values))
    elif isinstance(example_inputs, dict):
        values = dict(example_inputs)
        items = list(values.items())
    else:
        raise InputError(
            f"example_inputs must be a tuple of positional tensors or a dict of keyword tensors, "
            f"got {type(example_inputs).__name__}"
        )
    for key, value in items:
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"example input {key!r} is a {type(value).__name__}, not a tensor; only tensors "
                "cross pipeline stages: bake constants into the model (a wrapper module or "
                "functools.partial) and pass tensors only"
            )
    return values


def _bind(forward: Callable[..., Any], inputs: Inputs) -> inspect.Signature:
    sig = inspect.signature(forward)
    try:
        if isinstance(inputs, dict):
            sig.bind(**inputs)
        else:
            sig.bind(*inputs)
    except TypeError as exc:
        given = list(inputs) if isinstance(inputs, dict) else f"{len(inputs)} positional"
        raise InputError(
            f"example_inputs do not fit forward{sig}: {exc} (given: {given}); pass a tuple "
            "matching the positional parameters or a dict keyed by parameter names"
        ) from exc
    return sig


def _shapes(inputs: Inputs) -> str:
    items = inputs.items() if isinstance(inputs, dict) else enumerate(inputs)
    return ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in items)


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: usually the construct that failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(frames):
        if not frame.filename.startswith(torch_dir) and "lightning_autopipe" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown location>"


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


# ----------------------------------------------------------------------------------- fx path
def _positional_names(sig: inspect.Signature) -> list[str]:
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [n for n, p in sig.parameters.items() if p.kind not in kinds]


#: what a forward's output may hold besides tensors (passed through as constants)
_CONSTANT_OUTPUTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def _check_output_leaves(leaves: list[Any]) -> None:
    """Refuse an output the stages could not carry: a ``@dataclass`` the forward builds
    (torch.fx records its construction as one node, so the tensors inside it would be no
    block's outputs and profiling found none) or an object torch's pytree cannot look into."""
    for leaf in leaves:
        made = leaf.target if isinstance(leaf, fx.Node) and leaf.op == "call_function" else None
        if isinstance(made, type) and dataclasses.is_dataclass(made):
            kind = made
        elif isinstance(leaf, (fx.Node, *_CONSTANT_OUTPUTS)):
            continue
        else:
            kind = type(leaf)
        raise TraceError(
            f"forward returns a {kind.__module__}.{kind.__qualname__}, whose tensors cannot be "
            "followed through the stages: return a dict or a tuple from forward (build the "
            "object in training_step from them if the steps want it)"
        )


def _from_graph_module(
    gm: fx.GraphModule, model: nn.Module, inputs: Inputs, sig: inspect.Signature, tracer: str
) -> Traced:
    names = _positional_names(sig)
    provided = list(inputs) if isinstance(inputs, dict) else names[: len(inputs)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        raise TraceError(
            f"the traced graph has {len(placeholders)} placeholders but forward{sig} has "
            f"{len(names)} parameters; *args/**kwargs forwards are not supported. {_REMEDIES}"
        )
    by_name = dict(zip(names, placeholders))
    input_nodes = [by_name[n] for n in provided]
    constants = {}
    for name, node in by_name.items():
        if name not in provided:
            default = sig.parameters[name].default
            constants[node] = None if default is inspect.Parameter.empty else default
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(plain(output.args[0]))
    _check_output_leaves(leaves)
    order = list(provided)

    def flatten(values: Inputs) -> tuple[torch.Tensor, ...]:
        values = normalize_inputs(values)
        if not isinstance(values, dict):  # positional: bind to the leading parameter names
            if len(values) > len(names):
                raise InputError(
                    f"got {len(values)} positional inputs but forward takes {len(names)} "
                    f"({names}); pass the inputs example_inputs had ({order})"
                )
            values = dict(zip(names, values))
        if set(values) != set(order):
            raise InputError(
                f"inputs bind to {sorted(values)} but the model was traced with {sorted(order)}; "
                "pass the same inputs as example_inputs (positionally or by name)"
            )
        return tuple(values[k] for k in order)

    flat = flatten(inputs)
    return Traced(
        gm=gm,
        tracer=tracer,
        model=model,
        input_nodes=input_nodes,
        constant_inputs=constants,
        output_leaves=leaves,
        out_spec=spec,
        flatten=flatten,
        example_shapes=[tuple(t.shape) for t in flat],
    )


def _trace_fx(model: nn.Module, inputs: Inputs, sig: inspect.Signature) -> Traced:
    names = _positional_names(sig)
    provided = set(inputs) if isinstance(inputs, dict) else set(names[: len(inputs)])
    concrete = {
        n: sig.parameters[n].default
        for n in names
        if n not in provided and sig.parameters[n].default is not inspect.Parameter.empty
    }
    def capture() -> fx.GraphModule:
        with calls.own_functions_as_calls():
            return fx.symbolic_trace(model, concrete_args=concrete or None)

    with watch_unrecorded(model):
        gm = capture()
    traced = _from_graph_module(gm, model, inputs, sig, "fx")
    try:  # the guard restores what the second trace changed (buffers)
        with watch_unrecorded(model):
            traced.mode_line = mode_difference(model, gm, capture)
    except Unrecorded:  # only the other mode's forward switches modes: its values are alike
        traced.mode_line = None
    return traced


# ------------------------------------------------------------------------------- export path
def _batch_size(inputs: Inputs) -> int | None:
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    dims = [v.shape[0] for v in values if v.dim() > 0]
    return dims[0] if dims else None


@contextmanager
def _all_on_meta(model: nn.Module) -> Iterator[None]:
    """A model built deferred (parameters on the meta device, buffers real) with its buffers on
    the meta device too, for the block: torch.export's fake tensors keep their devices, so a
    meta weight meeting a real input, or a real BatchNorm statistic meeting a meta activation,
    fails the export. The graph needs shapes only; the real buffers are back after it."""
    real = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()
            if b is not None and b.device.type != "meta"]
    for m, name, b in real:
        m._buffers[name] = b.to("meta")
    try:
        yield
    finally:
        for m, name, b in real:
            m._buffers[name] = b


def _export(model: nn.Module, inputs: Inputs, dynamic: bool) -> Any:
    if not has_meta(model):
        return _export_as_given(model, inputs, dynamic)
    with _all_on_meta(model):
        meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), inputs)
        ep = _export_as_given(model, meta, dynamic)
    # the graph holds the model's own buffers again, as an export of it would
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.device.type == "meta":
            continue
        for held in (ep.state_dict, ep.constants):
            if name in held:
                held[name] = buffer
    return ep


def _export_as_given(model: nn.Module, inputs: Inputs, dynamic: bool) -> Any:
    from torch.export import Dim, export

    batch = _batch_size(inputs)
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    if not dynamic or batch is None:
        return export(model, args, kwargs or None, strict=False)
    if batch == 1:
        # A size-1 example would be specialised (0/1 specialisation); trace on a doubled batch.
        def grow(v: torch.Tensor) -> torch.Tensor:
            return torch.cat([v, v]) if v.dim() > 0 and v.shape[0] == 1 else v

        args = tuple(grow(v) for v in args)
        kwargs = {k: grow(v) for k, v in kwargs.items()}
        batch = 2
    dim = Dim("batch", min=1, max=1 << 20)

    def spec(v: torch.Tensor) -> dict[int, Any] | None:
        return {0: dim} if v.dim() > 0 and v.shape[0] == batch else None

    shapes: Any = {k: spec(v) for k, v in kwargs.items()} if kwargs else _positional_shapes(
        model, tuple(map(spec, args)))
    return export(model, args, kwargs or None, strict=False, dynamic_shapes=shapes)


def _positional_shapes(model: nn.Module, specs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The positional inputs' specs shaped like ``forward``'s signature: torch.export matches
    the specs to its parameters, so the inputs a ``*args`` parameter takes are one tuple
    there (``forward(self, *args)``, a wrapper's signature)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return specs
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL and i < len(specs):  # it takes some of the inputs
            return (*specs[:i], specs[i:])
    return specs


def _forget_real_tensors(gm: fx.GraphModule) -> None:
    """Drop the export's fake-tensor caches keyed by the model's tensors.

    The fake mode stays alive through the graph's ``meta["val"]`` and keeps a weak reference
    to every parameter it saw; a weakly referenced tensor cannot later be given storage in
    place (``torch.utils.swap_tensors``), which is how a meta-device model is materialised.
    The caches only speed up converting the same tensors again, which never happens.
    """
    from torch.utils.weak import WeakIdKeyDictionary

    modes = {id(m): m for n in gm.graph.nodes
             if (m := getattr(n.meta.get("val"), "fake_mode", None)) is not None}
    for mode in modes.values():
        converter = getattr(mode, "fake_tensor_converter", None)
        describer = getattr(getattr(converter, "meta_converter", None), "describer", None)
        for holder, name in ((describer, "lookup_tensor"), (describer, "lookup_storage"),
                              (converter, "tensor_memo")):
            if holder is not None and isinstance(getattr(holder, name, None),
                                                 WeakIdKeyDictionary):
                setattr(holder, name, WeakIdKeyDictionary())


def _trace_export(model: nn.Module, inputs: Inputs) -> Traced:
    notes = []
    with calls.own_functions_met() as functions:
        try:
            ep = _export(model, inputs, dynamic=True)
            dynamic = True
        except Exception as exc:  # noqa: BLE001 - retried statically, reported if that fails too
            notes.append(f"dynamic batch export failed ({_short(exc, 150)}); exported statically")
            ep = _export(model, inputs, dynamic=False)
            dynamic = False
    gm = ep.module()
    if functions:
        notes.extend(_check_own_functions(model, gm, inputs, functions))
    if has_meta(model):
        _forget_real_tensors(gm)
    in_spec = gm._in_spec
    out_spec = gm._out_spec
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = list(pytree.tree_flatten(output.args[0])[0])
    kind = "kwargs" if isinstance(inputs, dict) else "args"
    keys = list(inputs) if isinstance(inputs, dict) else None

    def flatten(values: Inputs) -> tuple[torch.Tensor, ...]:
        values = normalize_inputs(values)
        if (kind == "kwargs") != isinstance(values, dict):
            raise InputError(
                f"the model was traced with {kind}; pass inputs the same way "
                f"(got {type(values).__name__})"
            )
        if isinstance(values, dict):
            if set(values) != set(keys or ()):
                raise InputError(
                    f"inputs have keys {sorted(values)} but the model was traced with "
                    f"{sorted(keys or ())}; pass the same keys as example_inputs"
                )
            kw_spec = in_spec.child(1) if hasattr(in_spec, "child") else in_spec.children_specs[1]
            ordered = {k: values[k] for k in kw_spec.context}
            flat, spec = pytree.tree_flatten(((), ordered))
        else:
            flat, spec = pytree.tree_flatten((tuple(values), {}))
        if spec != in_spec:
            raise InputError(
                f"inputs flatten to {spec} but the exported model expects {in_spec}; pass "
                "inputs with the structure of example_inputs"
            )
        return tuple(flat)

    flat = flatten(inputs)
    if len(flat) != len(placeholders):
        raise TraceError(
            f"exported graph has {len(placeholders)} inputs but example_inputs flatten to "
            f"{len(flat)}. {_REMEDIES}"
        )
    return Traced(
        gm=gm,
        tracer="export",
        model=model,
        input_nodes=placeholders,
        constant_inputs={},
        output_leaves=leaves,
        out_spec=out_spec,
        flatten=flatten,
        example_shapes=[tuple(t.shape) for t in flat],
        dynamic_batch=dynamic,
        notes=notes,
    )


def _check_own_functions(model: nn.Module, gm: fx.GraphModule, inputs: Inputs,
                         functions: list[str]) -> list[str]:
    """Refuse an exported graph that drops the backward of the model's own autograd functions
    (:mod:`~.autograd_calls`); a model on the meta device cannot be run: the capture's note
    says so (returned)."""
    what = (f"{type(model).__name__} applies its own torch.autograd.Function "
            f"({', '.join(functions)}), whose backward a torch.export graph cannot keep")
    fixes = ("Make the model traceable by torch.fx, which keeps such a call as one node with its "
             "backward (split_model(..., tracer='fx') shows why it fails now), or register the "
             "operation as a torch.library custom op with register_autograd, which torch.export "
             "keeps")
    if has_meta(model):
        return [f"{what}; on the meta device the split model's gradients cannot be checked "
                f"against the model's. {fixes}"]

    def run(module: nn.Module) -> Any:
        return module(**inputs) if isinstance(inputs, dict) else module(*inputs)

    with buffers_kept(model, gm):
        where = calls.gradient_difference(model, gm, run)
    if where is not None:
        raise TraceError(f"{what}: the split model would train with the gradient of the "
                         f"function's forward operations instead ({where}). {fixes}")
    return []


def _warn_mode(traced: Traced, model: nn.Module) -> None:
    """Warn that the graph computes as in the mode it was traced in, whatever the mode later
    (:func:`~.fx_guard.mode_difference`): validation, test and prediction would run the
    training-mode code (dropout on, the training branch taken)."""
    if traced.mode_line is None:
        return
    mode = "training" if model.training else "evaluation"
    warnings.warn(
        f"{type(model).__name__}.forward computes differently in training and evaluation "
        f"mode through a Python value (self.training), at `{traced.mode_line}`; the traced "
        f"graph keeps the {mode}-mode code, so the split model runs it in every mode "
        "(validation, test and prediction included). Use modules whose behaviour follows "
        "train()/eval() (nn.Dropout rather than F.dropout(..., training=self.training)) or move "
        "the branch into training_step",
        UserWarning, stacklevel=4)


@contextmanager
def buffers_kept(*modules: nn.Module) -> Iterator[None]:
    """Run a check that must leave no trace: the modules' buffers (BatchNorm's running
    statistics and batch count) are put back as they were, whatever happens inside."""
    saved = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def _follow_mode(traced: Traced, model: nn.Module, inputs: Inputs) -> None:
    """Let the stages of an exported graph follow ``train()``/``eval()``.

    torch.export records the model's mode as constants (``dropout(x, 0.1, True)``,
    ``batch_norm(..., training=True, ...)``, attention's dropout probability). When the
    captured graph has such nodes, the model is exported once more in the other mode and the
    constants that differ are kept in :attr:`Traced.mode_values`: a stage reads its own
    ``training`` flag there (:mod:`~.stage`). A capture the other mode changes in any other way
    keeps its captured mode, with a warning (:func:`_warn_export_mode`).
    """
    if not mode_nodes(traced.gm) or not model.training:
        return
    modes = [(m, m.training) for m in model.modules()]
    try:
        with buffers_kept(model), _quiet_tracers():
            model.eval()
            other = _export(model, inputs, traced.dynamic_batch).module()
            if has_meta(model):
                _forget_real_tensors(other)
    except Exception:  # noqa: BLE001 - the graph keeps its mode, and the warning says so
        return
    finally:
        for m, mode in modes:
            m.training = mode
    values = mode_values(traced.gm, other)
    if values is not None:
        traced.mode_values = values


def _warn_export_mode(traced: Traced, model: nn.Module) -> None:
    """Warn that an exported graph keeps the mode it was captured in (:func:`~.modes.kept_mode`
    says what that does and how to avoid it), unless :func:`_follow_mode` placed its mode."""
    nodes = [n for n in mode_nodes(traced.gm) if n not in traced.mode_values]
    if nodes and model.training:
        warnings.warn(kept_mode(type(model).__name__, nodes), UserWarning, stacklevel=4)


def warn_kept_mode(traced: Traced) -> None:
    """Warn that the graph the stages are built from keeps the train/eval mode it was captured
    in somewhere (fx: a Python branch on ``self.training``; export: what :func:`_follow_mode`
    could not place). Called once that graph is settled (an fx graph may still be replaced by
    an export, :func:`unfaithful_fx`), so the warning is of the graph that runs."""
    if traced.tracer == "fx":
        _warn_mode(traced, traced.model)
    elif traced.tracer == "export":
        _warn_export_mode(traced, traced.model)


def _eager_check(model: nn.Module, inputs: Inputs) -> None:
    """Tell bad inputs apart from an untraceable model: run the model itself once."""
    try:
        with buffers_kept(model), torch.no_grad(), (
                on_meta() if has_meta(model) else nullcontext()):
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    except Exception as exc:  # noqa: BLE001 - re-raised as InputError with context
        raise InputError(
            f"the model fails on the given example_inputs ({_shapes(inputs)}): {_short(exc)} "
            f"at {_user_frame(exc)}; pass inputs of the shape/dtype the model expects"
        ) from exc


def trace(model: nn.Module, example_inputs: Any, tracer: str = "auto") -> Traced:
    """Capture ``model`` as a graph, trying ``torch.fx`` first and ``torch.export`` second.

    The model's own reentrant activation checkpointing is captured as plain computation, its
    own autograd functions as calls (:mod:`~.autograd_calls`: traced as they run, their
    backward would be lost).

    Raises:
        TraceError: neither front end could capture the model; the message names the failing
            construct and the remedies.
        InputError: ``example_inputs`` do not fit the model's forward signature or shapes.
    """
    with calls.reentrant_checkpoints_traced_plain(type(model).__name__):
        return _trace(model, example_inputs, tracer)


def _trace(model: nn.Module, example_inputs: Any, tracer: str) -> Traced:
    if tracer not in TRACERS:
        raise OptionError(f"tracer must be one of {TRACERS}, got {tracer!r}; pass one of them "
                          "(\"auto\" tries torch.fx, then torch.export)")
    if example_inputs is None:
        raise InputError(
            "split_model needs example_inputs (a tuple of positional tensors or a dict of keyword "
            "tensors) to trace, check and profile the model"
        )
    inputs = normalize_inputs(example_inputs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or fx.GraphModule, got {type(model)}")
    sig = _bind(model.forward, inputs)
    if isinstance(model, fx.GraphModule):
        return _from_graph_module(model, model, inputs, sig, "graph_module")
    fx_error: BaseException | None = None
    if tracer in ("auto", "fx"):
        try:
            with _quiet_tracers():
                return _trace_fx(model, inputs, sig)
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - fx failing is the common case for HF models
            fx_error = exc
        if tracer == "fx" and isinstance(fx_error, Unrecorded):
            raise TraceError(
                f"torch.fx cannot capture {type(model).__name__}: {fx_error} (the split model "
                "would compute without it); pass tracer='export' (or 'auto', which tries "
                "torch.export after torch.fx)"
            )
        if tracer == "fx":
            raise TraceError(
                f"torch.fx.symbolic_trace failed on {type(model).__name__}: {_short(fx_error)} "
                f"at {_user_frame(fx_error)}. {_REMEDIES}"
            ) from _cause(fx_error)
    try:
        return _export_following_mode(model, inputs)
    except (InputError, TraceError):
        raise
    except Exception as exc:  # noqa: BLE001 - converted into a TraceError naming both failures
        export_error = exc
    cache = _returns_cache(export_error) and _cache_configs(model)
    if cache:  # training never reads the cache: capture the model without it
        try:
            with _without_cache(cache):
                traced = _export_following_mode(model, inputs)
            traced.notes.append(
                f"{type(model).__name__} returns a Hugging Face key/value "
                "cache, which torch.export cannot return; captured with use_cache=False (the "
                "split model's outputs hold no past_key_values; the model's config is as it was)")
            return traced
        except (InputError, TraceError):
            raise
        except Exception as exc:  # noqa: BLE001 - as above
            export_error = exc
    _eager_check(model, inputs)
    parts = [f"torch.export failed: {_short(export_error)} at {_user_frame(export_error)}"]
    if _returns_cache(export_error):
        parts.append("the model returns a Hugging Face key/value cache: build or call it "
                     "with use_cache=False (model.config.use_cache = False)")
    if fx_error is not None:
        parts.insert(0, f"torch.fx failed: {_short(fx_error, 200)} at {_user_frame(fx_error)}")
    raise TraceError(
        f"cannot capture {type(model).__name__} as a graph. {'; '.join(parts)}. {_REMEDIES}"
    ) from _cause(export_error)


def _export_following_mode(model: nn.Module, inputs: Inputs) -> Traced:
    with _quiet_tracers():
        traced = _trace_export(model, inputs)
    _follow_mode(traced, model, inputs)
    return traced


def _returns_cache(error: BaseException) -> bool:
    """Whether torch.export failed on a Hugging Face key/value cache among the outputs."""
    return "cache_utils" in str(error) or "DynamicCache" in str(error)


def _cache_configs(model: nn.Module) -> list[Any]:
    """The Hugging Face configs under ``model`` that make it return a key/value cache."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            found.setdefault(id(config), config)
    return list(found.values())


@contextmanager
def _without_cache(configs: list[Any]) -> Iterator[None]:
    """``use_cache=False`` on ``configs`` while a capture runs, then as they were."""
    try:
        for config in configs:
            config.use_cache = False
        yield
    finally:
        for config in configs:
            config.use_cache = True


def unfaithful_fx(model: nn.Module, example_inputs: Any, tracer: str,
                  failure: GraphRunError) -> Traced:
    """The torch.fx graph of ``model`` failed on ``example_inputs`` (``failure``): capture the
    model again with torch.export when the model itself runs on them.

    torch.fx traces with proxies, so Python that inspects a traced value records the branch a
    proxy takes, not the one real values take: ``hasattr(out, "logits")`` is true of every
    proxy, ``isinstance`` and ``len`` see a proxy. The graph then fails where the model does
    not, and the inputs are not at fault. torch.export traces with fake tensors, which take the
    real branch; so ``tracer="auto"`` falls back to it as it does when fx cannot trace at all.

    Raises:
        GraphRunError: ``failure`` itself, when the model fails on the inputs as well (they are
            at fault after all, and the failure names the node that took them).
        TraceError: ``tracer="fx"`` (asked for fx only), or torch.export fails as well.
    """
    try:
        _eager_check(model, normalize_inputs(example_inputs))
    except InputError:  # the inputs' fault: the graph's error names the node that took them
        raise failure from failure.__cause__
    name = type(model).__name__
    what = (f"the torch.fx graph of {name} fails on example_inputs where {name} itself runs "
            f"(at {failure.node}: {failure.reason}); Python that inspects a traced value "
            "(hasattr, isinstance, len, an `if` on a shape) took the branch a tracing proxy "
            "takes, not the real one")
    if tracer == "fx":
        raise TraceError(f"{what}. Pass tracer='export' (or 'auto', which then captures the "
                         "model with torch.export) or make forward take one branch")
    try:
        traced = trace(model, example_inputs, "export")
    except TraceError as exc:
        raise TraceError(f"{what}; and {exc}") from exc
    traced.notes.append(f"{what}: captured with torch.export instead")
    return traced
