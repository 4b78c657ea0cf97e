"""``compile=True``: each local stage runs as one ``torch.compile`` graph, whatever the unit size.

Why one graph: a stage sees units of several sizes in every step (startup and drain slices,
full micro-batches, the short last batch of an epoch), and a compile per size would recompile
constantly. :class:`CompiledStage` marks dim 0 (the batch) of every input *unbacked*
(``torch._dynamo.decorators.mark_unbacked``): Dynamo then traces the batch as a symbol with
no guard on its value, so one graph serves every size, size 1 included (a merely dynamic,
"backed" batch is specialised at 0 and 1, so one-sample slices would get a second graph).
What a run compiles, counted in :attr:`CompiledStage.compilations` (graphs handed to the
backend):

* the first training step: one graph per stage (train mode, autograd on; AOTAutograd derives
  its backward from it);
* the first evaluation step: one more (eval mode under ``no_grad`` is another graph);
* every later step, of any unit sizes: none. A stage whose code branches on the batch size
  graph-breaks there and compiles its pieces once per branch taken (still bounded).

Some graphs fail with an unbacked batch: the backward of ``p.repeat(x.size(0), 1)`` (DeBERTa's
relative attention, learned queries or tokens repeated per sample) must know whether the batch
is 0 or 1, and AOTAutograd fails on that guard while it traces the joint graph; and torch 2.14's
inductor fails its own stride check on a convolution's output at the graph's first run. Such a
stage compiles again with a backed dynamic batch (one warning per stage): one graph for sizes
of 2 and more, and one each for the sizes 0 and 1 that it meets.

Zero bubble: a compiled stage's backward is one autograd node that computes the input and the
weight gradients together, so ZB-H1's split into ``B`` and ``W`` has no autograd nodes to
split at. Under a schedule that splits, the stage compiles through
:mod:`~lightning_autopipe.runtime.compiled_split`, which cuts the compiled backward graph into
an input-gradient graph and a weight-gradient graph; the executor runs ``B`` inside
:meth:`CompiledStage.deferring_weights` and ``W`` with :meth:`CompiledStage.backward_weight`.
That works for the backends in ``SPLIT_BACKENDS`` (inductor, aot_eager); other backends run
1F1B (``AutoPipeOptions`` plans ``"auto"`` as 1F1B for them and refuses a pinned
``"zb-h1"``). The first stage has no input gradient to send, so its backward stays whole.

Profiles: blocks are profiled eagerly (compiling every block on its own would cost a compile
per block). :func:`compiled_profile` then times the whole model eagerly and compiled at the
profile's sample count and at half of it, splits both into a fixed and a per-sample part as
the profiler does, and scales every block's fixed and per-sample parts by the compiled/eager
ratios (forward and backward apart): the planner prices the stages as they will run. The loss
on the last block (eager in training too) is scaled with it; it is a small part of that block.
Memory the same way: what the whole model saves for backward compiled over what it saves
eagerly (a compiled graph keeps what its partitioner chooses, recomputing cheap intermediates)
scales what every block saves, the loss's share apart (it runs eagerly).
"""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from lightning_autopipe.errors import OptionError, PlanError
from lightning_autopipe.options import SPLIT_BACKENDS
from lightning_autopipe.planner.compiled import splits_backward
from lightning_autopipe.profile import Profile, fit_affine
from lightning_autopipe.runtime.backward import splits_backward_at
from lightning_autopipe.runtime.clock import now
from lightning_autopipe.runtime.compiled_split import Deferral, split_backend
from lightning_autopipe.runtime.log import global_rank
from lightning_autopipe.runtime.profiler import saved_activation_bytes

__all__ = ["CompileCorrection", "CompiledStage", "check_backend", "compiled_profile",
           "compiled_stage", "with_ratios"]


class CompiledStage(nn.Module):
    """``stage`` compiled once with an unbacked batch dimension (see the module docstring).

    Its parameters and buffers are the stage's own (``self.stage``), so optimizers, gradient
    hooks and ``state_dict`` names are those of the eager stage.

    Args:
        stage: the module to compile (``stage(*tensors)``).
        backend: a ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``...).
        split_backward: compile each backward as separate input- and weight-gradient graphs
            (zero-bubble schedules; ``backend`` one of ``SPLIT_BACKENDS``).

    Attributes:
        compilations: graphs compiled so far (Dynamo's first compile and every recompile).
        compiled_shapes: the input shapes each graph was compiled for (``u``-symbols print as
            the sizes seen first).
        unbacked: the batch dimension is unbacked (one graph for every size); False once a
            graph failed so and the stage compiled with a dynamic batch (module docstring).
        deferral: with ``split_backward``, where the deferred weight halves wait, and how many
            backward graphs were split (``split``) or had to stay whole (``unsplit``).
    """

    def __init__(self, stage: nn.Module, backend: str = "inductor",
                 split_backward: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self.backend = backend
        self.compilations = 0
        self.compiled_shapes: list[list[tuple[int, ...]]] = []
        self.deferral: Deferral | None = Deferral() if split_backward else None

        def count(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
            self.compilations += 1
            self.compiled_shapes.append(
                [tuple(t.shape) for t in example_inputs if isinstance(t, Tensor)]
            )

        if self.deferral is not None:
            compiler = split_backend(backend, self.deferral, count)
        else:
            inner = torch._dynamo.lookup_backend(backend)

            def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
                count(gm, example_inputs)
                return inner(gm, example_inputs)

        # kept out of the module tree: its parameters are the stage's, registered once
        object.__setattr__(self, "_compiler", compiler)
        object.__setattr__(self, "_compiled", torch.compile(stage, backend=compiler))
        self.unbacked = True
        # the layers whose forward in training updates buffers (their running statistics)
        object.__setattr__(self, "_norms", [
            m for m in stage.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats])

    def forward(self, *inputs: Any) -> Any:
        if not self.unbacked:
            return self._compiled(*inputs)
        batched = [t for t in inputs if isinstance(t, Tensor) and t.dim() > 0]
        for t in batched:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        # a compile can fail after a graph break has run the graph before it (also when a size
        # met later recompiles): the running statistics it updated are undone before the stage
        # runs again (copied in one multi-tensor operation: a few vectors per norm layer)
        stats = [b for m in self._norms if m.training for b in m.buffers(recurse=False)]
        kept = torch._foreach_mul(stats, 1) if stats else []
        try:
            return self._compiled(*inputs)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is the batch guard
            failure = _unbacked_failure(exc)
            if failure is None:
                raise
        if stats:
            with torch.no_grad():
                torch._foreach_copy_(stats, kept)
        for t in batched:
            t._dynamo_unbacked_indices.discard(0)
        self.unbacked = False
        object.__setattr__(self, "_compiled",
                           torch.compile(self.stage, backend=self._compiler, dynamic=True))
        warnings.warn(
            f"rank {global_rank()}: compile ({self.backend}): this stage's graph cannot serve "
            f"every batch size at once ({failure}); it is compiled with a dynamic batch "
            "instead (units of 0 or 1 samples compile a graph of their own)", stacklevel=2)
        return self._compiled(*inputs)

    @contextmanager
    def deferring_weights(self) -> Iterator[list[Any]]:
        """A backward run inside computes the input gradients only; the weight halves it
        defers are collected in the list given, for :meth:`backward_weight`."""
        if self.deferral is None:
            raise RuntimeError("this stage was compiled without split_backward")
        pending = self.deferral.open()
        try:
            yield pending
        finally:
            self.deferral.close()

    @staticmethod
    def backward_weight(pending: list[Any]) -> None:
        """``W``: accumulate the weight gradients a deferred backward left in ``pending``
        (every weight half its ``B`` deferred, in the order they ran)."""
        for graph, w_inputs in pending:
            graph.accumulate(w_inputs)


def check_backend(compile: bool | str) -> None:
    """A ``compile`` option naming a backend must name one torch.compile knows (checked when
    the strategy is made, not when every rank compiles its stage after profiling).

    Raises:
        OptionError: naming the close backend and the known ones.
    """
    if not isinstance(compile, str):
        return
    import difflib

    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if compile not in backends:
        close = difflib.get_close_matches(compile, backends, n=1)
        raise OptionError(f"compile={compile!r} names no torch.compile backend"
                          + (f" (did you mean {close[0]!r}?)" if close else "")
                          + f"; the backends are {backends}, or compile=True (inductor)")


def _unbacked_failure(exc: BaseException) -> str | None:
    """What failed, when ``exc`` (or what it wraps) is one of the two ways torch fails a graph
    for its unbacked batch (the only size marked so), else None: the tracer cannot guard on
    the size (``GuardOnDataDependentSymNode``), or an inductor graph's first run fails its
    own check of an output's strides (torch 2.14, a convolution's output)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        message = str(exc)
        if isinstance(exc, GuardOnDataDependentSymNode):
            expression = message.splitlines()[0].removeprefix(
                "Could not guard on data-dependent expression ")
            return "it guards on " + expression.split(" (unhinted")[0].strip()
        if (isinstance(exc, AssertionError) and message.startswith("expected size ")
                and " stride " in message):
            return "inductor's stride check failed: " + message.split(";")[0]
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def compiled_stage(stage: nn.Module, schedule: str, backend: str, *,
                   stage_index: int) -> CompiledStage:
    """``stage`` compiled for a run under ``schedule`` as the pipeline's stage ``stage_index``
    (its backward graph is cut where :func:`~lightning_autopipe.runtime.backward.splits_backward_at`
    says: not on the first stage, whose backward stays whole even when the schedule splits).

    Raises:
        PlanError: the schedule splits the backward and ``backend`` cannot be split.
    """
    split = splits_backward(schedule)
    if split and backend not in SPLIT_BACKENDS:
        raise PlanError(
            f"schedule {schedule!r} splits each backward into input and weight gradients, "
            f"which a stage compiled with {backend!r} computes together (one graph); the "
            f"backward can be split for {SPLIT_BACKENDS}: compile with one of them, re-plan "
            "with schedule='auto', '1f1b' or 'interleaved-1f1b', or pass compile=False"
        )
    return CompiledStage(stage, backend, split_backward=splits_backward_at(stage_index, split))


class CompileCorrection:
    """The profile the planner should use, for one fit: an eager profile itself (``backend``
    None) or for a model on the meta device (it cannot run whole; its eager costs are kept,
    with a warning), else as the compiled stages will run (:func:`compiled_profile`, the ratios
    logged on rank 0).

    Measuring the ratios compiles the whole model, so they are measured on the first profile
    only and applied to any later one of the same blocks (discovery's confirming profile,
    :func:`~lightning_autopipe.runtime.measure._confirmed`)."""

    def __init__(self, backend: str | None, blocks: Any, example: Any, device: torch.device,
                 repeats: int = 3) -> None:
        self.backend, self.blocks, self.example = backend, blocks, example
        self.device, self.repeats = device, repeats
        self.ratios: dict[str, float] | None = None

    def __call__(self, profile: Profile) -> Profile:
        if self.backend is None:
            return profile
        if self.ratios is not None:
            return with_ratios(profile, self.ratios)
        from lightning_autopipe.runtime.log import rank_zero_info, rank_zero_warn

        blocks = self.blocks
        if any(p.is_meta for p in blocks.stage(0, len(blocks)).parameters()):
            rank_zero_warn("compile: a model on the meta device is planned from its eager "
                           "profile (its whole forward cannot be timed compiled)")
            return profile
        corrected, r = compiled_profile(profile, blocks, self.example, self.device,
                                        self.backend, self.repeats)
        self.ratios = r
        rank_zero_info(
            f"compile ({self.backend}): block costs scaled by the whole model's compiled/eager "
            f"time, forward x{r['forward']:.2f} (fixed x{r['forward_fixed']:.2f}, per sample "
            f"x{r['forward_per_sample']:.2f}), backward x{r['backward']:.2f} (fixed "
            f"x{r['backward_fixed']:.2f}, per sample x{r['backward_per_sample']:.2f}); saved "
            f"activations x{r['memory']:.2f}"
        )
        return corrected


def compiled_profile(
    profile: Profile,
    blocks: Any,
    example: Any,
    device: torch.device,
    backend: str = "inductor",
    repeats: int = 3,
) -> tuple[Profile, dict[str, float]]:
    """``profile`` (measured eagerly) as the compiled stages will run: see the module docstring.

    Compiles the whole model once (a copy of its blocks, so the stages compile afresh later).
    Returns the corrected profile and the ratios applied (compiled / eager time of the fixed
    and per-sample parts of forward and backward).
    """
    whole = copy.deepcopy(blocks.stage(0, len(blocks))).to(device)
    flat = tuple(blocks.flatten_inputs(example))
    n = next((int(t.shape[0]) for t in flat if isinstance(t, Tensor) and t.dim() > 0), 1)
    sizes = [n, n // 2] if n >= 2 else [n]
    compiled = CompiledStage(whole, backend)
    times = {}
    for name, fn in (("eager", whole), ("compiled", compiled)):
        for size in sizes:
            inputs = tuple(t[:size] if isinstance(t, Tensor) and t.dim() > 0 else t
                           for t in flat)
            times[name, size] = _timed(fn, inputs, device, repeats)
    ratios = {}
    for k, part in enumerate(("forward", "backward")):
        e_full, c_full = times["eager", n][k], times["compiled", n][k]
        if len(sizes) == 2:
            half = sizes[1]
            e_fix = fit_affine(half, times["eager", half][k], n, e_full)
            c_fix = fit_affine(half, times["compiled", half][k], n, c_full)
        else:
            e_fix = c_fix = 0.0
        whole_ratio = c_full / e_full
        ratios[f"{part}_fixed"] = c_fix / e_fix if e_fix > 0 else whole_ratio
        ratios[f"{part}_per_sample"] = (
            (c_full - c_fix) / (e_full - e_fix) if e_full > e_fix else whole_ratio
        )
        ratios[part] = whole_ratio
    # what a unit in flight holds: a compiled graph saves what its partitioner keeps for the
    # backward (it recomputes cheap intermediates and fuses), not what each eager op saves
    eager_saved = saved_activation_bytes(whole, flat)
    ratios["memory"] = (saved_activation_bytes(compiled, flat) / eager_saved
                        if eager_saved else 1.0)
    return with_ratios(profile, ratios), ratios


def with_ratios(profile: Profile, ratios: dict[str, float]) -> Profile:
    """``profile`` with :func:`compiled_profile`'s ``ratios`` applied to every block: times,
    and what the blocks save for backward (the loss's share stays: the loss runs eagerly)."""
    kept = ratios.get("memory", 1.0)
    out = [
        replace(
            b,
            **_scaled(b.forward_ms, b.forward_fixed_ms, ratios, "forward"),
            **_scaled(b.backward_ms, b.backward_fixed_ms, ratios, "backward"),
            backward_input_ms=_times(b.backward_input_ms, ratios["backward"]),
            backward_weight_ms=_times(b.backward_weight_ms, ratios["backward"]),
            memory_bytes=b.loss_bytes + round((b.memory_bytes - b.loss_bytes) * kept),
            shared_input_bytes=round(b.shared_input_bytes * kept),
        )
        for b in profile.blocks
    ]
    return replace(profile, blocks=out)


def _scaled(ms: float, fixed: float, ratios: dict[str, float], part: str) -> dict[str, float]:
    new_fixed = fixed * ratios[f"{part}_fixed"]
    return {f"{part}_ms": new_fixed + (ms - fixed) * ratios[f"{part}_per_sample"],
            f"{part}_fixed_ms": new_fixed}


def _times(value: float | None, ratio: float) -> float | None:
    return None if value is None else value * ratio


def _timed(fn: Callable, inputs: tuple[Any, ...], device: torch.device,
           repeats: int) -> tuple[float, float]:
    """Median (forward ms, backward ms) of ``fn`` on ``inputs``, after one untimed pass."""
    fwd, bwd = [], []
    for i in range(repeats + 1):
        t0 = now(device)
        outs = fn(*inputs)
        t1 = now(device)
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        floats = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
        torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
        t2 = now(device)
        if i:  # the first pass compiles (and warms the caches)
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return statistics.median(fwd), statistics.median(bwd)

