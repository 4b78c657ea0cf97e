"""Runs one rank's lowered action list for a training or validation step.

The executor is the runtime half of the schedule IR: it performs exactly the actions the planner
produced for this rank (``lower_communication(build_schedule(plan))[stage]``), which the
simulator replays too, and records them in :attr:`PipelineExecutor.trace`.

A zero-bubble schedule splits each backward: ``B`` computes the gradient with respect to the
stage's inputs only (sent on at once), keeping the autograd state the weights need, and ``W``
later accumulates the parameter gradients from it (``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight``, which split the graph at the nodes where
the input and weight paths meet, so nothing is computed twice). A compiled stage's backward is
one autograd node, so it is split inside, into compiled input- and weight-gradient graphs
(:mod:`~lightning_autopipe.runtime.compiled_split`). The first stage has no input gradient to
send: its ``B`` does nothing and its ``W`` is the whole backward.

Numerics: the replica's batch of ``B`` samples is cut into micro-batches (micro-batch 0 into
startup slices); each unit's loss on the last stage is weighted by ``unit_samples / B``, so the
gradients summed over units are those of the replica's mean loss. Averaging over the
data-parallel group then gives the gradients of the global-batch mean loss, and summing tied
copies across their stages gives what a single process would compute for the shared weight.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.runtime.checks import check_batch_sizes
from lightning_autopipe.runtime.comm import recv_tensors, send_tensors
from lightning_autopipe.runtime.failure import FailureBoard, pipeline_failure
from lightning_autopipe.runtime.gradsync import GradientSync
from lightning_autopipe.runtime.groups import ProcessGroups, RankLayout
from lightning_autopipe.runtime.units import Unit, fit_units, slice_batch, unit_bounds

__all__ = ["PipelineExecutor", "TiedParameter"]

_BACKWARD_KINDS = (Kind.SEND_B, Kind.RECV_B, Kind.BACKWARD)
_COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)


@dataclass(frozen=True)
class TiedParameter:
    """A local copy of a parameter shared with other stages (e.g. GPT's embedding / LM head).

    ``tie`` indexes the tie sets given to :func:`~lightning_autopipe.runtime.groups.build_groups`;
    ``counted`` is True on exactly one stage of the set, so the global norm counts it once.
    """

    tie: int
    param: nn.Parameter
    counted: bool


class PipelineExecutor:
    """Executes this rank's schedule for one stage of one data-parallel replica.

    Args:
        stage: the local stage module; ``stage(*tensors)`` returns a tuple of tensors.
        layout: this rank's place in the grid.
        groups: process groups from :func:`build_groups` (None only for a 1-rank world).
        num_microbatches: micro-batches per replica and step (the plan's ``m``).
        startup_slices: slices of micro-batch 0 (the plan's ``k``).
        train_schedule: ``(m, k, j) -> lowered action list`` of this stage for a training step.
        eval_schedule: ``m -> lowered action list`` of this stage for a forward-only step.
        inputs_fn: batch -> model inputs (positional tuple or keyword dict).
        flatten_inputs: model inputs -> tuple of tensors (the first stage's inputs).
        unflatten_outputs: last stage outputs -> model-shaped output for ``loss_fn``.
        loss_fn: ``(model outputs, batch slice) -> mean loss of that slice``.
        device: where this stage runs and where received tensors are put.
        tied: local copies of parameters tied across stages.
        bucket_bytes: size of the flat buffers gradients are all-reduced in.
        failures: where this rank posts its failure and reads a peer's (see ``failure.py``).
        check_batch: every tensor of a batch must hold the inputs' sample count.
        timeout_s: the process groups' timeout (quoted in failure messages).
        drain_slices: slices of the last micro-batch (the plan's ``j``).
        memory: measures this rank's peak memory in a training step
            (:class:`~lightning_autopipe.runtime.memory.MemoryMeter`); None measures nothing.

    Attributes:
        loss_scale: None, or ``loss -> scaled loss`` applied to each unit's weighted loss on
            the last stage before its backward (fp16 loss scaling: ``scaler.scale`` of a
            :class:`~lightning_autopipe.runtime.scaler.PipelineGradScaler`); every gradient
            of the step then carries the scale. The returned loss stays unscaled.
    """

    def __init__(
        self,
        stage: nn.Module,
        layout: RankLayout,
        groups: ProcessGroups | None,
        *,
        num_microbatches: int,
        startup_slices: int,
        train_schedule: Callable[[int, int, int], list[Action]],
        eval_schedule: Callable[[int], list[Action]],
        inputs_fn: Callable[[Any], Any],
        flatten_inputs: Callable[[Any], Sequence[Tensor]],
        unflatten_outputs: Callable[[tuple[Tensor, ...]], Any],
        loss_fn: Callable[[Any, Any], Tensor],
        device: torch.device,
        tied: Sequence[TiedParameter] = (),
        bucket_bytes: int = 25 * 2**20,
        failures: FailureBoard | None = None,
        check_batch: bool = True,
        timeout_s: float | None = None,
        drain_slices: int = 1,
        memory: Any = None,
    ) -> None:
        if layout.world_size > 1 and groups is None:
            raise PipelineRuntimeError("a multi-rank pipeline needs its process groups")
        self.stage = stage
        self.layout = layout
        self.groups = groups
        self.num_microbatches = num_microbatches
        self.startup_slices = startup_slices
        self.drain_slices = drain_slices
        self._train_schedule = train_schedule
        self._eval_schedule = eval_schedule
        self._inputs_fn = inputs_fn
        self._flatten = flatten_inputs
        self._unflatten = unflatten_outputs
        self._loss_fn = loss_fn
        self.device = device
        self.tied = sorted(tied, key=lambda t: t.tie)  # same all-reduce order on every rank
        self.bucket_bytes = bucket_bytes
        self.failures = failures
        self.check_batch = check_batch
        self.timeout_s = timeout_s
        self.step: int | None = None  # the caller's step number, quoted in failure messages
        self._training = True
        # the sum of every floating output of this step: non-finite iff some element was, or the
        # float32 sum overflowed (finite values summing past 3.4e38: activations blowing up
        # anyway; then an earlier stage may be named). One reduce per output costs ~1/50 of
        # ``~isfinite(o).all()``, which re-reads the tensor three times. float64 sums float64.
        self._output_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._closed = False
        self.trace: list[Action] = []
        self.timeline: list[tuple[Action, float, float]] = []
        self._schedules: dict[tuple[bool, int, int, int], list[Action]] = {}
        self._params = [p for p in stage.parameters() if p.requires_grad]
        # a compiled stage that splits its own backward graphs (compiled_split)
        self._deferral = getattr(stage, "deferral", None)
        self.memory = memory
        self.loss_scale: Callable[[Tensor], Tensor] | None = None
        self._dp_sync: GradientSync | None = None
        if layout.num_replicas > 1 and self._params:
            assert groups is not None
            self._dp_sync = GradientSync(self._params, groups.dp, layout.num_replicas, bucket_bytes)

    # ------------------------------------------------------------------------- public steps
    @property
    def parameters(self) -> list[nn.Parameter]:
        """The stage's trainable parameters (what this rank's optimizer must hold)."""
        return list(self._params)

    def train_step(self, batch: Any, step: int | None = None) -> Tensor:
        """Forward and backward of every unit, then gradient sync; returns the global mean loss.

        Gradients accumulate into ``.grad`` (the caller zeroes them, as Lightning's closure does).
        ``step`` only labels failure messages.
        """
        self.step, self._training = step, True
        self.stage.train()
        if self.memory is not None:
            self.memory.begin_step()
        loss = self._run(batch, train=True)
        with self._watch("gradient all-reduce", None, communication=True):
            self._sync_gradients()
        if self.memory is not None:
            self.memory.end_step()
        return loss

    @torch.no_grad()
    def eval_step(self, batch: Any, step: int | None = None) -> Tensor:
        """Forward-only pipeline; returns the global mean loss."""
        self.step, self._training = step, False
        self.stage.eval()
        return self._run(batch, train=False)

    def close(self) -> None:
        """Remove the gradient hooks this executor put on the stage's parameters.

        Call before the process groups are destroyed: a hook keeps the all-reduce group alive
        through the parameters, and a gloo group that outlives ``destroy_process_group`` can
        abort the process at interpreter exit ("terminate called without an active exception").
        """
        if self._dp_sync is not None:
            self._dp_sync.remove()
            self._dp_sync = None
        self._closed = True

    def nonfinite_origin(self) -> tuple[int, list[int]]:
        """After a step with a non-finite loss: the first stage whose outputs were non-finite.

        Collective over the world (call it on every rank). Returns ``(stage, ranks of that stage
        that saw it)``; the last stage when every stage's outputs were finite (the loss itself).
        """
        lay = self.layout
        bad = not bool(torch.isfinite(self._output_sum))
        mine = torch.tensor([float(bad), float(lay.stage)], device=self.device)
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and lay.world_size > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        flags = [(int(r[1]), rank) for rank, r in enumerate(rows) if r[0] > 0]
        if not flags:
            return lay.num_stages - 1, list(lay.grid[-1])
        first = min(s for s, _ in flags)
        return first, [rank for s, rank in flags if s == first]

    def global_grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """Norm of the whole model's gradient (every stage, tied copies counted once)."""
        skip = {id(t.param) for t in self.tied if not t.counted}
        grads = [p.grad for p in self.parameters if p.grad is not None and id(p) not in skip]
        inf = math.isinf(norm_type)
        if grads:
            norms = torch.stack([g.detach().float().norm(norm_type) for g in grads])
            local = norms.max() if inf else norms.pow(norm_type).sum()
        else:
            local = torch.zeros((), device=self.device)
        local = local.to(self.device, torch.float32)
        if self.layout.num_stages > 1:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=self.groups.pipeline)
        return local if inf else local.pow(1.0 / norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole pipeline (same formula and eps)."""
        total = self.global_grad_norm(norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p in self.parameters:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    # ---------------------------------------------------------------------------- internals
    def _actions(self, train: bool, m: int, k: int, j: int) -> list[Action]:
        key = (train, m, k, j)
        if key not in self._schedules:
            acts = self._train_schedule(m, k, j) if train else self._eval_schedule(m)
            wrong = [a for a in acts if a.stage != self.layout.stage]
            if wrong:
                raise PipelineRuntimeError(
                    f"rank {self.layout.rank} runs stage {self.layout.stage} but its schedule "
                    f"holds actions of other stages: {[str(a) for a in wrong[:4]]}"
                )
            self._schedules[key] = acts
        return self._schedules[key]

    @contextmanager
    def _watch(self, what: str, peer: int | None, communication: bool) -> Iterator[None]:
        """Turn any failure into a PipelineRuntimeError naming this rank (or the first failure)."""
        try:
            yield
        except PipelineRuntimeError:
            raise
        except Exception as exc:
            lay = self.layout
            kind = "training" if self._training else "validation"
            raise pipeline_failure(
                self.failures,
                exc,
                where=f"rank {lay.rank} (stage {lay.stage}, replica {lay.replica})",
                what=what,
                when=f"{kind} step {self.step}" if self.step is not None else f"a {kind} step",
                peer=peer,
                communication=communication,
                timeout_s=self.timeout_s,
            ) from exc

    def _run(self, batch: Any, train: bool) -> Tensor:
        if self._closed:  # its replicas would no longer average gradients
            raise PipelineRuntimeError("this PipelineExecutor was closed; build a new one")
        layout = self.layout
        flat = tuple(self._flatten(self._inputs_fn(batch)))
        if not flat:
            raise PipelineRuntimeError("the model's flattened inputs hold no tensor")
        size = int(flat[0].shape[0]) if flat[0].dim() else 0
        if self.check_batch:
            check_batch_sizes(batch, flat, size)
        self._output_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if train:
            m, k, j = fit_units(size, self.num_microbatches, self.startup_slices, self.drain_slices)
        else:
            m, k, j = min(self.num_microbatches, size), 1, 1
        bounds = unit_bounds(size, m, k, j)
        order = {u: i for i, u in enumerate(bounds)}
        actions = self._actions(train, m, k, j)
        if train and self._dp_sync is not None:
            self._dp_sync.prepare()  # gradients accumulate straight into the all-reduce buffers

        received: dict[Unit, list[Tensor | None]] = {}
        saved: dict[Unit, tuple[list[Tensor | None], Any]] = {}
        out_grads: dict[Unit, list[Tensor | None]] = {}
        in_grads: dict[Unit, list[Tensor | None]] = {}
        outputs: dict[Unit, tuple[Tensor, ...]] = {}
        outbox = _Outbox(
            acks=_in_unit_order(actions, Kind.RECV_B, order),
            releases=_in_unit_order(actions, Kind.SEND_B, order),
        )
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        trace: list[Action] = []
        timeline: list[tuple[Action, float, float]] = []
        split = any(a.kind is Kind.WEIGHT for a in actions)
        # the action after which gradients are final: the last backward, or the last W
        final = Kind.WEIGHT if split else Kind.BACKWARD
        last_b = max((i for i, a in enumerate(actions) if a.kind is final), default=-1)
        weight_state: dict[Unit, Any] = {}

        for idx, a in enumerate(actions):
            t0 = time.perf_counter()
            unit = a.unit
            if unit not in bounds:
                raise PipelineRuntimeError(f"action {a} names a unit outside {list(bounds)}")
            tag = 2 * order[unit] + (a.kind in _BACKWARD_KINDS)
            start, stop = bounds[unit]
            peer = layout.prev_rank if a.kind in (Kind.RECV_F, Kind.SEND_B) else layout.next_rank
            with self._watch(_action_name(a), peer, a.kind not in _COMPUTE_KINDS):
                if a.kind is Kind.RECV_F:
                    received[unit], ack = recv_tensors(layout.prev_rank, tag, self.device)
                    outbox.acknowledged(ack)
                elif a.kind is Kind.FORWARD:
                    if layout.is_first:
                        inputs: list[Tensor | None] = [t[start:stop] for t in flat]
                    else:
                        inputs = received.pop(unit)
                    with self._saving(train):  # what the forward saves for backward
                        outs = self.stage(*inputs)
                    outs = tuple(outs) if isinstance(outs, list | tuple) else (outs,)
                    for o in outs:
                        if o.is_floating_point():
                            wide = o.dtype == torch.float64
                            self._output_sum += o.detach().sum(
                                dtype=torch.float64 if wide else torch.float32
                            )
                    if layout.is_last:
                        part = slice_batch(batch, start, stop, size)
                        with self._saving(train):
                            loss = self._loss_fn(self._unflatten(outs), part) * (
                                (stop - start) / size)
                        loss_sum += loss.detach().float()
                        if train:
                            scale = self.loss_scale
                            saved[unit] = (inputs, loss if scale is None else scale(loss))
                    else:
                        outputs[unit] = outs
                        if train:
                            saved[unit] = (inputs, outs)
                elif a.kind is Kind.SEND_F:
                    outs = outputs.pop(unit)
                    works = send_tensors(outs, layout.next_rank, tag, self.device, outbox.ack)
                    outbox.forward[unit] = works
                elif a.kind is Kind.RECV_B:
                    out_grads[unit], _ = recv_tensors(layout.next_rank, tag, self.device)
                    outbox.gradient_arrived(unit)
                elif a.kind is Kind.BACKWARD and split:
                    inputs, result = saved.pop(unit)
                    grads = None if layout.is_last else out_grads.pop(unit)
                    if layout.is_first:  # no input gradient: W runs the whole backward
                        weight_state[unit] = (result, grads, None)
                    else:
                        dinputs, groups = self._backward_input(a, result, grads, inputs)
                        in_grads[unit] = list(dinputs)
                        weight_state[unit] = (None, None, groups)
                elif a.kind is Kind.WEIGHT:
                    if idx == last_b and self._dp_sync is not None and layout.is_first:
                        self._dp_sync.arm()  # a whole backward: the buckets launch as they fill
                    result, grads, groups = weight_state.pop(unit)
                    if groups is None:
                        self._backward_full(a, result, grads)
                    elif self._deferral is not None:
                        self.stage.backward_weight(groups)
                    else:
                        backward_weight(self._params, groups)
                elif a.kind is Kind.BACKWARD:
                    if idx == last_b and self._dp_sync is not None:
                        self._dp_sync.arm()  # gradients become final during this backward
                    inputs, result = saved.pop(unit)
                    self._backward_full(a, result, None if layout.is_last else out_grads.pop(unit))
                    if not layout.is_first:
                        in_grads[unit] = _input_grads(inputs)
                elif a.kind is Kind.SEND_B:
                    grads = in_grads.pop(unit)
                    outbox.backward.append(send_tensors(grads, layout.prev_rank, tag, self.device))
            trace.append(a)
            timeline.append((a, t0, time.perf_counter()))
        with self._watch("waiting for sends", None, communication=True):
            outbox.wait_all()
        self.trace = trace
        self.timeline = timeline
        with self._watch("loss broadcast", layout.last_stage_rank, communication=True):
            return self._global_loss(loss_sum)

    def _saving(self, train: bool) -> Any:
        return self.memory.saving() if train and self.memory is not None else nullcontext()

    @staticmethod
    def _backward_full(a: Action, result: Any, grads: list[Tensor | None] | None) -> None:
        """The whole backward of a unit: from the (weighted) loss, or from the stage outputs
        with the gradients the next stage sent (``grads``)."""
        if grads is None:
            result.backward()
            return
        if len(grads) != len(result):
            raise PipelineRuntimeError(
                f"{a}: received {len(grads)} gradients for {len(result)} stage outputs"
            )
        pairs = [(o, g) for o, g in zip(result, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _backward_input(
        self, a: Action, result: Any, grads: list[Tensor | None] | None, inputs: list[Any]
    ) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]]]:
        """``B`` of a split backward: the input gradients, and the state ``W`` resumes from.

        A compiled stage (``deferral``) defers the weight halves of its compiled backward
        graphs: the whole autograd backward runs, and computes only the input gradients."""
        if self._deferral is not None:
            with self.stage.deferring_weights() as pending:
                self._backward_full(a, result, grads)
            return tuple(_input_grads(inputs)), pending
        if grads is None:  # the last stage: from its loss
            outs, out_grads = [result], None
        else:
            if len(grads) != len(result):
                raise PipelineRuntimeError(
                    f"{a}: received {len(grads)} gradients for {len(result)} stage outputs"
                )
            keep = [(o, g) for o, g in zip(result, grads) if g is not None and o.requires_grad]
            outs, out_grads = [o for o, _ in keep], [g for _, g in keep]
        return backward_input(outs, out_grads, inputs, self._params)

    def _global_loss(self, loss_sum: Tensor) -> Tensor:
        """Replica mean from the last stage to the whole replica, then averaged over replicas."""
        layout = self.layout
        if layout.num_stages > 1:
            dist.broadcast(loss_sum, src=layout.last_stage_rank, group=self.groups.pipeline)
        if layout.num_replicas > 1:
            dist.all_reduce(loss_sum, group=self.groups.dp)
            loss_sum /= layout.num_replicas
        return loss_sum

    def _sync_gradients(self) -> None:
        """Average gradients over the stage's replicas (overlapped, bucketed), sum tied copies."""
        if self._dp_sync is not None:
            self._dp_sync.finish()
        for t in self.tied:
            group = self.groups.ties.get(t.tie) if self.groups is not None else None
            if group is None:
                continue
            if t.param.grad is None:
                t.param.grad = torch.zeros_like(t.param)
            dist.all_reduce(t.param.grad, group=group)


class _Outbox:
    """This step's sends, released as soon as they are proven received.

    A send keeps its buffer alive until waited (gloo marks it complete only then), and holding
    a step's worth of sent activations and gradients to its end would break 1F1B's memory
    bound. A unit's forward send is proven received when that unit's gradient arrives. Backward
    sends are proven received by the previous stage's next message, whose header acknowledges
    how many gradient messages it has taken: that count names our first sends only when both
    sides take them in unit order, as every generated schedule does (``acks`` / ``releases``;
    otherwise they are waited at the end of the step, as any leftover is).
    """

    def __init__(self, acks: bool, releases: bool) -> None:
        self.forward: dict[Unit, list[tuple[Any, Tensor]]] = {}
        self.backward: list[list[tuple[Any, Tensor]]] = []
        self._acks, self._releases = acks, releases
        self._gradients = 0  # gradient messages received this step
        self._released = 0  # backward sends waited so far

    @property
    def ack(self) -> int:
        """What this rank's next activation message acknowledges to the next stage."""
        return self._gradients if self._acks else 0

    def gradient_arrived(self, unit: Unit) -> None:
        self._gradients += 1
        _wait(self.forward.pop(unit, ()))

    def acknowledged(self, count: int) -> None:
        while self._releases and self._released < min(count, len(self.backward)):
            _wait(self.backward[self._released])
            self.backward[self._released] = []
            self._released += 1

    def wait_all(self) -> None:
        for works in [*self.forward.values(), *self.backward]:
            _wait(works)
        self.forward, self.backward = {}, []


def _wait(works: Sequence[tuple[Any, Tensor]]) -> None:
    for work, _buf in works:
        work.wait()


def _in_unit_order(actions: Sequence[Action], kind: Kind, order: dict[Unit, int]) -> bool:
    """Whether this rank's ``kind`` actions come in the step's unit order."""
    seq = [order[a.unit] for a in actions if a.kind is kind and a.unit in order]
    return seq == sorted(seq)


def _action_name(a: Action) -> str:
    """``forward 1F0.1`` style label of an action for failure messages."""
    words = {
        Kind.FORWARD: "forward",
        Kind.BACKWARD: "backward",
        Kind.WEIGHT: "weight backward",
        Kind.SEND_F: "send of activations",
        Kind.RECV_F: "receive of activations",
        Kind.SEND_B: "send of gradients",
        Kind.RECV_B: "receive of gradients",
    }
    return f"{words.get(a.kind, 'action')} {a}"


def _input_grads(inputs: Sequence[Any]) -> list[Tensor | None]:
    """What a whole backward left in the stage inputs' ``.grad`` (sent to the previous stage)."""
    return [t.grad if t is not None and t.requires_grad else None for t in inputs]


def backward_input(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor] | None,
    inputs: Sequence[Any],
    params: Sequence[Tensor],
) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]]]:
    """``B`` of a split backward: the gradients of ``inputs`` from ``outputs`` (given their
    ``grads``; None: the outputs are the loss), and the state :func:`backward_weight` resumes.

    torch pipelining's ``stage_backward_input`` detaches the outputs it is given in place, to
    free the graph behind them. A stage output that the stage itself also consumes (a skip
    tensor sent on and fed to a later layer of the same stage) is saved by that layer for its
    weight gradient, and ``W`` then failed ("Trying to use a saved tensor that has been
    detached in-place"). So it is given fresh copies: the copy's backward hands the gradient
    through unchanged, and only the copies are detached (this executor drops the outputs
    after ``B`` anyway).
    """
    outs = [o.clone() for o in outputs] if grads is not None else list(outputs)
    return _split_backward().stage_backward_input(outs, list(grads) if grads is not None
                                                  else None, list(inputs), iter(params))


def backward_weight(params: Sequence[Tensor], state: list[dict[str, Any]]) -> None:
    """``W`` of a split backward: accumulate the weight gradients from :func:`backward_input`'s
    state into ``.grad``."""
    _split_backward().stage_backward_weight(iter(params), state)


def _split_backward() -> Any:
    """``torch.distributed.pipelining``'s split backward, imported when a schedule splits one
    (importing the package costs seconds, paid by every rank of every run otherwise)."""
    from torch.distributed.pipelining import _backward

    return _backward
