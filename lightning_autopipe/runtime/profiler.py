"""Measure a :class:`~lightning_autopipe.profile.Profile`: time every block of a split model.

Each block runs as its own stage on the real values that reach it, forward then backward, on
the device it will train on; the data type it fills lives in ``lightning_autopipe.profile`` so
that reading a profile (the planner does) needs no torch.

A model built on the meta device (:mod:`lightning_autopipe.runtime.materialize`) is profiled
block by block: a block's parameters are materialised on the device (by the model's
initialisers; random values would do for timing, these keep activations in range), the block
is timed alone and its parameters go back to the meta device before the next one, so
profiling never holds more than one block's parameters, gradients and activations.

Over ~400 lines because the timing passes (chained forward/backward, the split B/W pass, the
fixed-cost half-batch pass, activation memory) share one per-block run record and its
materialisation: split apart they would pass that private state across modules.
"""

from __future__ import annotations

import copy
import io
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_autopipe.errors import InputError, OptionError
from lightning_autopipe.profile import BlockProfile, Profile, fit_affine
from lightning_autopipe.runtime.backward import (
    backward_input,
    backward_weight,
    split_needs,
)
from lightning_autopipe.runtime.clock import now

__all__ = ["LossFn", "profile_blocks", "saved_activation_bytes"]

LossFn = Callable[[tuple[Any, ...], int], Tensor]
"""``loss_fn(last_block_outputs, n) -> scalar``: the training loss of the first ``n`` samples."""


# Timer floor: a block whose work is below the clock's resolution (a reshape, a residual add)
# can measure 0 ms, but planners divide by and compare costs, so every cost stays positive.
_MIN_MS = 1e-3



def _prepare(values: tuple[Any, ...], grads: list[bool]) -> tuple[Any, ...]:
    """Fresh leaves like those a pipeline stage receives: detached, grad where it flows."""
    out = []
    for v, g in zip(values, grads):
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if g and v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return tuple(out)


def _grad_targets(outputs: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors of ``outputs`` that take a gradient, inside any structure the model returns
    (the last block's output is the model's: a named tuple such as torchvision GoogLeNet's
    ``GoogLeNetOutputs``, a dict, a Hugging Face ``ModelOutput``)."""
    leaves = pytree.tree_leaves(outputs)
    return [o for o in leaves if isinstance(o, torch.Tensor) and o.requires_grad]


def _scalar_loss(loss_fn: LossFn | None, outputs: tuple[Any, ...], n: int) -> Tensor | None:
    """``loss_fn(outputs, n)``, checked to be a scalar tensor (None without a loss)."""
    if loss_fn is None:
        return None
    loss = loss_fn(outputs, n)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise InputError(
            f"profile_blocks: loss_fn must return a scalar tensor (the mean loss of the "
            f"{n} samples), got {shape}"
        )
    return loss


def _run_backward(outputs: tuple[Any, ...], loss: Tensor | None) -> None:
    """Back-propagate as training does: from the loss on the last block, else ones."""
    if loss is not None:
        if loss.requires_grad:
            loss.backward()
        return
    targets = _grad_targets(outputs)
    if targets:
        torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])


def _saved_bytes(
    stage: Any, inputs: tuple[Any, ...], skip: set[int], loss_fn: LossFn | None, n: int,
    storages: dict[int, int] | None = None,
) -> tuple[int, tuple, Tensor | None, int]:
    """Bytes of the distinct storages autograd saves for backward (parameters excluded), and
    of them the bytes only the loss saves.

    With a loss, what the loss saves (e.g. cross-entropy's log-probabilities and targets) is
    counted too: the last stage holds it from a micro-batch's forward until its backward, or
    under a split backward until its ``B`` (the loss's autograd nodes lie above every weight,
    so the input-gradient pass frees them). ``storages`` (given) receives the saved storages,
    data pointer -> bytes.
    """
    storages = {} if storages is None else storages
    by_loss: dict[int, int] = {}
    into = storages

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            into[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = stage(*inputs)
        into = by_loss
        loss = _scalar_loss(loss_fn, outputs, n)
    loss_only = {ptr: nbytes for ptr, nbytes in by_loss.items() if ptr not in storages}
    storages.update(loss_only)
    return sum(storages.values()), outputs, loss, sum(loss_only.values())


def saved_activation_bytes(stage: Any, inputs: tuple[Any, ...]) -> int:
    """Bytes of the distinct storages ``stage`` saves for backward on ``inputs``, its
    parameters excluded (what a unit in flight holds, as the memory meter counts it)."""
    skip = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    return _saved_bytes(stage, inputs, skip, None, 0)[0]


def _time_block(
    stage: Any,
    values: tuple[Any, ...],
    grads: list[bool],
    device: torch.device,
    runs: int,
    loss_fn: LossFn | None = None,
    n: int = 0,
) -> tuple[list[float], list[float], tuple[Any, ...]]:
    fwd, bwd = [], []
    outputs: tuple[Any, ...] = ()
    for _ in range(runs):
        inputs = _prepare(values, grads)
        t0 = now(device)
        outputs = stage(*inputs)
        loss = _scalar_loss(loss_fn, outputs, n)
        t1 = now(device)
        _run_backward(outputs, loss)
        t2 = now(device)
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
    return fwd, bwd, outputs



@dataclass
class _BlockRun:
    """One block while it is profiled: its stage module, its inputs, and what was measured."""

    stage: Any
    grads: list[bool]
    values: tuple[Any, ...]
    loss: LossFn | None
    memory: int
    out_bytes: int  # what the block's outputs hold (what crosses a cut after it)
    f_ms: float = 0.0
    b_ms: float = 0.0
    f_fix: float = 0.0
    b_fix: float = 0.0
    b_in: float | None = None  # the backward split into input and weight gradients
    b_w: float | None = None
    param_bytes: int = 0
    shared: int = 0  # of ``memory``: inputs the previous block saves too
    loss_memory: int = 0  # of ``memory``: what only the loss saves (the last block)
    # its weights feed its input path twice (its split backward runs whole in B), and its
    # weights off that path (their gradients in B), once known
    whole_in_b: bool | None = None
    off_path: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        params = {id(p): p for p in self.stage.parameters()}
        self.param_bytes = sum(p.numel() * p.element_size() for p in params.values())


def _split_backward(
    run: _BlockRun, args: tuple[Any, ...], outputs: tuple[Any, ...], loss: Tensor | None,
    dev: torch.device,
) -> tuple[float, float]:
    """Milliseconds of the backward's input part (B) and weight part (W), timed one after the
    other as a zero-bubble schedule runs them (the runtime's split, :mod:`.backward`). A block
    whose inputs take no gradient (the model's first) has no input part: its whole backward is
    the weight part, as on the pipeline's first stage; one whose weights feed its input path
    twice runs its whole backward as the input part, as a stage does."""
    params = [p for p in run.stage.parameters() if p.requires_grad]
    wants = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not wants:
        t0 = now(dev)
        _run_backward(outputs, loss)
        return 0.0, (now(dev) - t0) * 1e3
    if loss is not None:
        outs = [loss]
    else:  # backward of ones, from one scalar: an output that is a view cannot be detached
        targets = _grad_targets(outputs)
        if not targets:  # nothing it returns takes a gradient: it has no backward to split
            return 0.0, 0.0
        outs = [torch.stack([t.sum() for t in targets]).sum()]
    if run.whole_in_b is None:
        run.whole_in_b, run.off_path = split_needs(outs, args, params)
    t0 = now(dev)
    _, groups = backward_input(outs, None, list(args), params, whole=run.whole_in_b,
                               off_path=run.off_path)
    t1 = now(dev)
    backward_weight(params, groups)
    return (t1 - t0) * 1e3, (now(dev) - t1) * 1e3


def _split_pass(runs: list[_BlockRun], dev: torch.device, n: int) -> list[tuple[float, float]]:
    """Every block's forward in order, then every split backward in reverse (untimed forward)."""
    held = []
    for run in runs:
        args = _prepare(run.values, run.grads)
        outputs = run.stage(*args)
        held.append((args, outputs, _scalar_loss(run.loss, outputs, n)))
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(runs)
    for b in range(len(runs) - 1, -1, -1):
        args, outputs, loss = held[b]
        out[b] = _split_backward(runs[b], args, outputs, loss, dev)
        held[b] = None  # type: ignore[call-overload]
    return out


def _time_split(runs: list[_BlockRun], dev: torch.device, repeats: int, n: int) -> None:
    """Median input and weight parts of every block's backward over ``repeats`` passes."""
    _split_pass(runs, dev, n)  # warm-up
    passes = [_split_pass(runs, dev, n) for _ in range(repeats)]
    parts = [(statistics.median(p[b][0] for p in passes),
              statistics.median(p[b][1] for p in passes)) for b in range(len(runs))]
    factor = _preemption_factor([[sum(t) for t in p] for p in passes], [sum(t) for t in parts])
    for run, (b_in, b_w) in zip(runs, parts):
        run.b_in = b_in * factor
        run.b_w = max(b_w * factor, _MIN_MS)


@contextmanager
def _quiet() -> Iterator[None]:
    """A probe that may fail by design (a block whose inputs only look batched): an fx
    ``GraphModule`` prints its generated code and the failing line to stderr before raising,
    which would show a traceback on every rank of a healthy run."""
    with redirect_stderr(io.StringIO()):
        yield


def _half(values: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    """The first half of every tensor batched along dim 0 (for the fixed-cost fit)."""
    half = batch // 2
    return tuple(
        v[:half].clone()
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch
        else v
        for v in values
    )


def _time_isolated(
    run: _BlockRun, dev: torch.device, warmup: int, repeats: int, batch: int, fit_fixed: bool
) -> None:
    """Time one block alone, again and again (its weights stay hot in cache between runs)."""
    args = (run.stage, run.values, run.grads, dev)
    _time_block(*args, max(warmup - 1, 0), run.loss, batch)
    fwd, bwd, _ = _time_block(*args, repeats, run.loss, batch)
    run.f_ms = max(statistics.median(fwd), _MIN_MS)
    run.b_ms = max(statistics.median(bwd), _MIN_MS)
    if fit_fixed and batch >= 2:
        small = (run.stage, _half(run.values, batch), run.grads, dev)
        try:
            with _quiet():
                _time_block(*small, max(warmup, 1), run.loss, batch // 2)
            sf, sb, _ = _time_block(*small, repeats, run.loss, batch // 2)
        except (RuntimeError, ValueError, IndexError):
            return  # inputs not batched along dim 0: keep linear costs
        run.f_fix = fit_affine(batch // 2, statistics.median(sf), batch, run.f_ms)
        run.b_fix = fit_affine(batch // 2, statistics.median(sb), batch, run.b_ms)


def _chain_pass(
    runs: list[_BlockRun], inputs: list[tuple[Any, ...] | None], dev: torch.device, n: int
) -> list[tuple[float, float] | None]:
    """One training-like pass: every block's forward in order, then every backward in reverse.

    Blocks whose ``inputs`` are None are skipped (their inputs could not be halved).
    """
    held: list[tuple[tuple[Any, ...], Tensor | None] | None] = []
    times: list[list[float] | None] = []
    for run, vals in zip(runs, inputs):
        if vals is None:
            held.append(None)
            times.append(None)
            continue
        args = _prepare(vals, run.grads)
        t0 = now(dev)
        outputs = run.stage(*args)
        loss = _scalar_loss(run.loss, outputs, n)
        times.append([(now(dev) - t0) * 1e3])
        held.append((outputs, loss))
    for b in range(len(runs) - 1, -1, -1):
        entry, t = held[b], times[b]
        if entry is None or t is None:
            continue
        t0 = now(dev)
        _run_backward(*entry)
        t.append((now(dev) - t0) * 1e3)
        held[b] = None
    return [(t[0], t[1]) if t is not None else None for t in times]


def _chain_medians(
    runs: list[_BlockRun],
    inputs: list[tuple[Any, ...] | None],
    dev: torch.device,
    warmup: int,
    repeats: int,
    n: int,
) -> list[tuple[float, float] | None]:
    for _ in range(warmup):
        _chain_pass(runs, inputs, dev, n)
    passes = [_chain_pass(runs, inputs, dev, n) for _ in range(repeats)]
    out: list[tuple[float, float] | None] = []
    for b in range(len(runs)):
        got = [p[b] for p in passes if p[b] is not None]
        out.append(
            (statistics.median(g[0] for g in got), statistics.median(g[1] for g in got))
            if got
            else None
        )
    factor = _preemption_factor([[sum(t) for t in p if t is not None] for p in passes],
                                [sum(t) for t in out if t is not None])
    return [None if t is None else (t[0] * factor, t[1] * factor) for t in out]


def _preemption_factor(passes: list[list[float]], medians: list[float]) -> float:
    """How much longer a whole pass takes than the sum of its blocks' median times: the median
    over passes of each pass's summed block times, over the sum of the block medians.

    On a core shared with another process the scheduler hands out time slices of a few
    milliseconds, so most short block timings run uninterrupted and their medians say "full
    speed", while the preemptions land in a few blocks of every pass. A pass spans many slices,
    so its summed time is the core share the rank really gets (the share training sees); its
    median over passes still ignores one disturbed pass. On an unshared device the two agree
    (the factor is about 1)."""
    total = sum(medians)
    sums = [sum(p) for p in passes if p]
    if total <= 0 or not sums:
        return 1.0
    return statistics.median(sums) / total


def _time_chain(
    runs: list[_BlockRun], dev: torch.device, warmup: int, repeats: int, batch: int,
    fit_fixed: bool,
) -> None:
    """Time every block inside whole forward-then-backward passes, as training runs them.

    On a CPU a block timed alone keeps its weights and activations in cache between repeats,
    which training never does (every other block of the stage runs in between): measured on
    the development machines, a 4-sample GPT micro-batch took 10-15% longer in training than
    the sum of its isolated block times. Timing inside the chain removes that bias.
    """
    full = _chain_medians(runs, [r.values for r in runs], dev, warmup, repeats, batch)
    for run, t in zip(runs, full):
        assert t is not None
        run.f_ms, run.b_ms = max(t[0], _MIN_MS), max(t[1], _MIN_MS)
    if not (fit_fixed and batch >= 2):
        return
    halves: list[tuple[Any, ...] | None] = []
    for run in runs:  # a block whose inputs cannot be halved keeps linear costs
        small = _half(run.values, batch)
        try:
            with torch.no_grad(), _quiet():
                run.stage(*small)
        except (RuntimeError, ValueError, IndexError):
            halves.append(None)
        else:
            halves.append(small)
    try:
        part = _chain_medians(runs, halves, dev, max(warmup, 1), repeats, batch // 2)
    except (RuntimeError, ValueError, IndexError):
        return
    for run, t in zip(runs, part):
        if t is not None:
            run.f_fix = fit_affine(batch // 2, t[0], batch, run.f_ms)
            run.b_fix = fit_affine(batch // 2, t[1], batch, run.b_ms)


def _deferred(model: Any) -> bool:
    from lightning_autopipe.graph.trace import has_meta

    return has_meta(model)


@contextmanager
def _materialized(model: Any, stage: Any, dev: torch.device) -> Iterator[None]:
    """A meta-device block's parameters (and meta buffers) on ``dev`` while it is profiled;
    its real buffers are moved there too and back afterwards."""
    from lightning_autopipe.runtime.materialize import Materializer, retarget_devices

    retarget_devices(stage, dev)
    buffers = [t for t in stage.buffers() if t is not None]
    moved = [(t, t.to(dev)) for t in buffers if t.device.type not in ("meta", dev.type)]
    for t, there in moved:
        torch.utils.swap_tensors(t, there)
    try:
        with Materializer(model, seed=0, strict=False).holding(
            [*stage.parameters(), *buffers], dev
        ):
            yield
    finally:
        for t, here in moved:
            torch.utils.swap_tensors(t, here)


def _ties(blocks: Any) -> list[tuple[int, int]]:
    """Per block, the nearest earlier block using a parameter it uses too (-1: none) and the
    bytes of the parameters it shares with that block (a head tied to the embedding; a
    module applied in several places: each use names the one before, so that a stage
    holding any run of them counts the module once), read from the blocks' own stage modules
    before any is copied to a device."""
    last: dict[int, int] = {}  # id(parameter) -> the latest block using it so far
    out = []
    for b in range(len(blocks)):
        params = {id(p): p for p in blocks.stage(b, b + 1).parameters()}
        to = max((last[pid] for pid in params if pid in last), default=-1)
        nbytes = sum(p.numel() * p.element_size() for pid, p in params.items()
                     if last.get(pid) == to)
        out.append((to, nbytes) if to >= 0 and nbytes else (-1, 0))
        last.update(dict.fromkeys(params, b))
    return out


def _measure_block(
    blocks: Any, b: int, stage: Any, values: tuple[Any, ...], dev: torch.device, batch: int,
    loss_fn: LossFn | None, before: set[int] = frozenset(),
) -> tuple[_BlockRun, tuple[Any, ...], set[int]]:
    """Block ``b``'s saved-activation memory on ``values``; its run, the next block's inputs
    (detached: nothing of this block's autograd graph is kept) and the storages of its outputs
    it saved itself.

    ``before``: the storages of ``values`` the previous block saved; what of them this block
    saves again is its ``shared`` bytes (one storage that a stage holding both blocks holds
    once). Only input storages are compared: they stay alive, so no pointer is reused.
    """
    grads = [v.requires_grad for v in blocks.boundary(b)]
    skip = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    loss = loss_fn if b == len(blocks) - 1 else None
    saved: dict[int, int] = {}
    memory, outputs, scalar, by_loss = _saved_bytes(stage, _prepare(values, grads), skip, loss,
                                                    batch, saved)
    shared = sum(nbytes for ptr, nbytes in saved.items() if ptr in before)
    outs = {o.untyped_storage().data_ptr() for o in outputs if isinstance(o, torch.Tensor)}
    _run_backward(outputs, scalar)  # free the graph of the memory run
    out_bytes = sum(o.numel() * o.element_size() for o in outputs if isinstance(o, torch.Tensor))
    nxt = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
    run = _BlockRun(stage, grads, values, loss, int(memory), out_bytes, shared=int(shared),
                    loss_memory=int(by_loss))
    return run, nxt, outs & set(saved)


def profile_blocks(
    blocks: Any,
    example_inputs: Any,
    device: str = "cpu",
    warmup: int = 1,
    repeats: int = 3,
    model_name: str | None = None,
    fit_fixed: bool = True,
    loss_fn: LossFn | None = None,
    in_chain: bool | None = None,
    split_backward: bool = True,
) -> Profile:
    """Measure every block of a split model on ``device`` for one micro-batch.

    Each block runs as its own stage on the real values that reach it when the chain runs on
    ``example_inputs`` (their batch size is the micro-batch size). Its inputs are fresh leaves
    (gradients flow into them, as in a pipeline), its outputs are back-propagated with ones --
    except the last block's when ``loss_fn`` is given: training's last stage also computes the
    loss and back-propagates from it, so its timed forward includes ``loss_fn`` and its timed
    backward starts at the loss (a large-vocabulary cross-entropy is a visible part of that
    stage, and a planner blind to it puts too much work on the last stage).

    Args:
        blocks: a :class:`~lightning_autopipe.graph.BlockGraph` from ``split_model``.
        example_inputs: one micro-batch (tuple of positional or dict of keyword tensors).
        device: where to run; off the CPU each block runs on a copy of its parameters, so the
            user's model stays where it is.
        warmup: untimed runs per block (the first also measures saved-activation memory).
        repeats: timed runs per block; the median is reported.
        model_name: recorded in the profile (default: the model's class name).
        fit_fixed: also time each block at half the micro-batch (when it is >= 2) and record
            the part of its time that does not scale with samples (:func:`fit_affine`) as
            ``forward_fixed_ms`` / ``backward_fixed_ms``. A block whose inputs cannot be cut
            along dim 0 keeps purely linear costs.
        loss_fn: ``loss_fn(outputs, n) -> scalar tensor``, the mean training loss of the last
            block's ``outputs`` (its output tuple, before any unflattening) for the first ``n``
            samples of the batch the example came from. ``n`` is the micro-batch size, or half
            of it in the ``fit_fixed`` timing. The sample count, not a batch, is passed because
            only the caller knows the batch's structure (which tensors are per-sample, what
            the loss wants); it cuts its targets to ``[:n]`` (e.g. with the runtime's
            ``slice_batch``), exactly as the executor slices a batch for a micro-batch. What
            the loss saves for backward is counted in the last block's ``memory_bytes``.
        in_chain: time every block inside whole forward-then-backward passes over all blocks
            (as training runs them) instead of repeating each block alone. Default: on the
            CPU, where caches make the difference (see ``_time_chain``); elsewhere each block
            is copied to the device and timed alone, so a model larger than one device can
            still be profiled.
        split_backward: also time each block's backward as its input-gradient and its
            weight-gradient parts, run one after the other (``backward_input_ms`` /
            ``backward_weight_ms``), which zero-bubble schedules execute as two actions.

    A model whose parameters are on the meta device is profiled one block at a time (see the
    module docstring), each block alone, whatever ``in_chain`` says: a chain pass would hold
    every block's parameters at once.

    Returns:
        A :class:`Profile` with ``fingerprint = blocks.fingerprint``. Parameter gradients and
        buffers (e.g. batch-norm statistics) of the model are restored afterwards.
    """
    if warmup < 0 or repeats < 1:
        raise OptionError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, {repeats=}")
    dev = torch.device(device)
    flat = blocks.flatten_inputs(example_inputs)
    batch = next((int(t.shape[0]) for t in flat if t.dim() > 0), 1)
    model = blocks.model
    deferred = _deferred(model)
    saved_grads = [(p, p.grad) for p in model.parameters()]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # copies: a saved input counts its whole storage, and an example sliced from a larger
    # batch would count the batch
    values: tuple[Any, ...] = tuple(t.to(dev, copy=True) for t in flat)
    chain = (dev.type == "cpu" if in_chain is None else in_chain) and not deferred
    runs: list[_BlockRun] = []
    out: list[BlockProfile] = []
    # storages of the values that the last block saved; for block 0, the model's inputs (a
    # stage holds its slices of the batch once, whatever the units in flight)
    kept: set[int] = {t.untyped_storage().data_ptr() for t in values if isinstance(t, Tensor)}
    ties = _ties(blocks)
    try:
        for b in range(len(blocks)):
            stage = blocks.stage(b, b + 1)
            holding = _materialized(model, stage, dev) if deferred else nullcontext()
            if dev.type != "cpu" and not deferred:
                stage = copy.deepcopy(stage).to(dev)
            with holding:
                run, values, kept = _measure_block(blocks, b, stage, values, dev, batch,
                                                   loss_fn, kept)
                if not chain:  # one block on the device at a time: time it now, then let it go
                    _time_isolated(run, dev, warmup, repeats, batch, fit_fixed)
                    if split_backward:
                        _time_split([run], dev, repeats, batch)
                    run.stage, run.values = None, ()
            runs.append(run)
        if chain:
            _time_chain(runs, dev, warmup, repeats, batch, fit_fixed)
            if split_backward:
                _time_split(runs, dev, repeats, batch)
        for b, run in enumerate(runs):
            params = run.param_bytes
            out.append(
                BlockProfile(
                    name=blocks.names[b],
                    forward_ms=run.f_ms,
                    backward_ms=run.b_ms,
                    param_bytes=params,
                    activation_bytes=run.out_bytes,
                    memory_bytes=run.memory,
                    forward_fixed_ms=run.f_fix,
                    backward_fixed_ms=run.b_fix,
                    backward_input_ms=run.b_in,
                    backward_weight_ms=run.b_w,
                    shared_input_bytes=run.shared,
                    loss_bytes=run.loss_memory,
                    tied_to=ties[b][0],
                    tied_bytes=ties[b][1],
                )
            )
    finally:
        with torch.no_grad():
            for buf, old in saved_buffers:
                buf.copy_(old)
        for p, g in saved_grads:
            p.grad = g
    return Profile(
        model=model_name or type(model).__name__,
        micro_batch_size=batch,
        device=str(dev),
        blocks=out,
        fingerprint=blocks.fingerprint,
    )
