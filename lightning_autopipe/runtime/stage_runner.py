"""One chunk of this rank inside one step: the per-unit state and one method per action kind.

The executor walks the lowered action list and calls, for each action, the method that
:func:`action_table` maps its kind to; every method takes the action alone and reads or writes
only the state of the action's unit (what it received, saved for backward, must send on). So
each action's meaning is one short method, and a new action kind is one more method and one
more table entry, not another branch of a loop.

A rank holding several chunks has one runner per chunk. Between two consecutive chunks on the
same rank the schedule has no send or receive: the forward hands its outputs to the next
chunk's runner as detached leaves (what a receive would have made of them) and the backward
hands its input gradients to the previous chunk's runner, so each chunk's backward stays its
own autograd graph, run when the schedule says, exactly as across ranks.

Numerics: the replica's batch of ``B`` samples is cut into micro-batches (micro-batch 0 into
startup slices); each unit's loss on the last stage is weighted by ``unit_samples / B``, so the
gradients summed over units are those of the replica's mean loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.runtime import comm
from lightning_autopipe.runtime.backward import (
    backward_input,
    backward_weight,
    backward_whole,
    input_grads,
    output_pairs,
    split_needs,
    splits_backward_at,
)
from lightning_autopipe.runtime.groups import ChunkLayout
from lightning_autopipe.runtime.outbox import Outbox
from lightning_autopipe.runtime.units import Unit, slice_batch

__all__ = ["ActionTable", "StageRunner", "action_table"]

_BACKWARD_KINDS = (Kind.SEND_B, Kind.RECV_B, Kind.BACKWARD)


class StageRunner:
    """One chunk's forward, ``backward_input`` and ``backward_weight`` (and its receives and
    sends) over the units of a step.

    Args:
        module: the chunk's module; ``module(*tensors)`` returns a tuple of tensors.
        layout: the chunk's place (first / last of the model, neighbours, local ones).
        params: the chunk's trainable parameters (what a split ``W`` accumulates into).
        loss_fn: ``(model outputs, batch slice) -> mean loss of that slice`` (last stage).
        unflatten_outputs: last stage outputs -> model-shaped output for ``loss_fn``.
        device: where received tensors are put.
        memory: a :class:`~lightning_autopipe.runtime.memory.MemoryMeter` whose ``saving()``
            wraps what the forward saves for backward; None measures nothing.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: ChunkLayout,
        params: Sequence[nn.Parameter],
        loss_fn: Callable[[Any, Any], Tensor],
        unflatten_outputs: Callable[[tuple[Tensor, ...]], Any],
        device: torch.device,
        memory: Any = None,
    ) -> None:
        self.module = module
        self.layout = layout
        self.params = list(params)
        self.device = device
        self.memory = memory
        self._loss_fn = loss_fn
        self._unflatten = unflatten_outputs
        # a compiled stage that splits its own backward graphs (compiled_split)
        self._deferral = getattr(module, "deferral", None)
        # without an input gradient (the first stage) a split backward's W is the whole one
        self._splits = splits_backward_at(layout.stage, split=True)
        # whether this chunk's weights feed its input path twice (the whole backward in B),
        # and its weights off that path (their gradients in B), found at its first split
        # backward
        self._whole_in_b: bool | None = None
        self._off_path: list[Tensor] = []
        # the runners of the neighbour chunks on this rank (set by the executor), if local
        self.local_prev: StageRunner | None = None
        self.local_next: StageRunner | None = None
        self.output_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.begin(None, (), 0, {}, train=False, outbox=Outbox(False, False))

    def take_params(self, params: Sequence[nn.Parameter]) -> None:
        """The chunk's trainable parameters changed (a layer unfrozen): what ``W`` accumulates
        into, and the split backward's findings over them, anew."""
        self.params = list(params)
        self._whole_in_b, self._off_path = None, []

    def begin(
        self,
        batch: Any,
        flat: Sequence[Tensor],
        size: int,
        bounds: dict[Unit, tuple[int, int]],
        *,
        train: bool,
        outbox: Outbox,
        loss_scale: Callable[[Tensor], Tensor] | None = None,
        per: float | None = None,
    ) -> None:
        """Start a step over ``batch`` (``flat``: its flattened model inputs, ``size`` samples)
        cut into ``bounds`` (unit -> ``[start, stop)``); every unit's state starts empty.
        A unit's loss is weighted by its samples over ``per`` (default ``size``; under uneven
        replica batches the even share, :mod:`~.replica_share`).

        ``loss_scale`` scales each unit's weighted loss before its backward (fp16); the
        summed loss stays unscaled.
        """
        self._batch, self._flat, self._size = batch, tuple(flat), size
        self._per = float(size if per is None else per)
        self._bounds = bounds
        self._order = {u: i for i, u in enumerate(bounds)}
        self._train = train
        self._scale = loss_scale
        self.outbox = outbox
        self._received: dict[Unit, list[Tensor | None]] = {}
        self._saved: dict[Unit, tuple[list[Tensor | None], Any]] = {}
        self._outputs: dict[Unit, tuple[Tensor, ...]] = {}
        self._out_grads: dict[Unit, list[Tensor | None]] = {}
        self._in_grads: dict[Unit, list[Tensor | None]] = {}
        self._weight_state: dict[Unit, tuple[Any, Any, Any]] = {}
        # the sum of every floating output of this step: non-finite iff some element was, or
        # the float32 sum overflowed (finite values summing past 3.4e38: activations blowing up
        # anyway; then an earlier stage may be named). One reduce per output costs ~1/50 of
        # ``~isfinite(o).all()``, which re-reads the tensor three times. float64 sums float64.
        self.output_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)

    # -------------------------------------------------------------------------- receives
    def receive_activations(self, a: Action) -> None:
        """``RECV_F``: the unit's inputs from the previous stage (its header acknowledges how
        many of our gradient messages it has taken)."""
        self._received[a.unit], ack = comm.recv_tensors(
            self.layout.prev_rank, self._tag(a), self.device)
        self.outbox.acknowledged(ack)

    def receive_gradients(self, a: Action) -> None:
        """``RECV_B``: the gradients of the unit's outputs from the next stage."""
        self._out_grads[a.unit], _ = comm.recv_tensors(
            self.layout.next_rank, self._tag(a), self.device)
        self.outbox.gradient_arrived(a.unit)

    # ---------------------------------------------------------------------------- compute
    def forward(self, a: Action) -> None:
        """``F``: the stage on the unit's inputs; on the last stage also its weighted loss."""
        unit = a.unit
        start, stop = self._bounds[unit]
        if self.layout.is_first:
            inputs: list[Tensor | None] = [t[start:stop] for t in self._flat]
        else:
            inputs = self._received.pop(unit)
        with self._saving():  # what the forward saves for backward
            outs = self.module(*inputs)
        outs = tuple(outs) if isinstance(outs, list | tuple) else (outs,)
        # the last stage's outputs are the model's own structure (a named tuple, a dict)
        for o in outs if not self.layout.is_last else pytree.tree_leaves(outs):
            if isinstance(o, Tensor) and o.is_floating_point():
                wide = o.dtype == torch.float64
                self.output_sum += o.detach().sum(dtype=torch.float64 if wide else torch.float32)
        if not self.layout.is_last:
            if self.local_next is not None:  # the next chunk is here: its "receive" at once
                self.local_next.take_activations(unit, outs)
            else:
                self._outputs[unit] = outs
            if self._train:
                self._saved[unit] = (inputs, outs)
            return
        part = slice_batch(self._batch, start, stop, self._size)
        with self._saving():
            loss = self._loss_fn(self._unflatten(outs), part) * ((stop - start) / self._per)
        self.loss_sum += loss.detach().double()  # a float64 model's loss stays float64
        if self._train:
            self._saved[unit] = (inputs, loss if self._scale is None else self._scale(loss))

    def backward(self, a: Action) -> None:
        """``B`` of a schedule that does not split backwards: the unit's whole backward; the
        input gradients it leaves are what ``SEND_B`` sends."""
        inputs, result = self._saved.pop(a.unit)
        backward_whole(a, result, self._take_out_grads(a.unit))
        if not self.layout.is_first:
            self._hand_back(a.unit, input_grads(inputs))

    def backward_input(self, a: Action) -> None:
        """``B`` of a split backward: only the input gradients (sent on at once), keeping what
        ``W`` resumes from; on the first stage nothing (its ``W`` is the whole backward).

        A compiled stage (``deferral``) defers the weight halves of its compiled backward
        graphs: the whole autograd backward runs, and computes only the input gradients."""
        inputs, result = self._saved.pop(a.unit)
        grads = self._take_out_grads(a.unit)
        if not self._splits:
            self._weight_state[a.unit] = (result, grads, None)
            return
        if not any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
            # no input takes a gradient (the layers before are frozen): there is nothing to
            # split off, and an input-gradient pass would find no weights behind the inputs
            # (leaving none for W): W runs the whole backward, as on the first stage
            self._weight_state[a.unit] = (result, grads, None)
            self._hand_back(a.unit, input_grads(inputs))
            return
        if self._deferral is not None:
            with self.module.deferring_weights() as pending:
                backward_whole(a, result, grads)
            dinputs: Sequence[Tensor | None] = input_grads(inputs)
        else:
            if grads is None:  # the last stage: from its loss
                outs, out_grads = [result], None
            else:
                outs, out_grads = output_pairs(a, result, grads)
            if self._whole_in_b is None:
                self._whole_in_b, self._off_path = split_needs(outs, inputs, self.params)
            dinputs, pending = backward_input(outs, out_grads, inputs, self.params,
                                              whole=self._whole_in_b, off_path=self._off_path)
        self._hand_back(a.unit, list(dinputs))
        self._weight_state[a.unit] = (None, None, pending)

    def backward_weight(self, a: Action) -> None:
        """``W``: accumulate the unit's weight gradients from what its ``B`` kept (on the
        first stage: the whole backward)."""
        result, grads, pending = self._weight_state.pop(a.unit)
        if pending is None:
            backward_whole(a, result, grads)
        elif self._deferral is not None:
            self.module.backward_weight(pending)
        else:
            backward_weight(self.params, pending)

    # ------------------------------------------------------------------------------ sends
    def send_activations(self, a: Action) -> None:
        """``SEND_F``: the unit's outputs to the next stage (held until proven received)."""
        outs = self._outputs.pop(a.unit)
        self.outbox.forward[a.unit] = comm.send_tensors(
            outs, self.layout.next_rank, self._tag(a), self.device, self.outbox.ack)

    def send_gradients(self, a: Action) -> None:
        """``SEND_B``: the unit's input gradients to the previous stage."""
        grads = self._in_grads.pop(a.unit)
        self.outbox.backward.append(
            comm.send_tensors(grads, self.layout.prev_rank, self._tag(a), self.device))

    # ------------------------------------------------------------------ local hand-offs
    def take_activations(self, unit: Unit, outs: Sequence[Tensor]) -> None:
        """The previous chunk (on this rank) produced ``unit``'s inputs of this chunk: kept as
        detached leaves that take a gradient where the output did, as a receive makes them."""
        self._received[unit] = [
            o.detach().requires_grad_(o.requires_grad) if o.is_floating_point() else o.detach()
            for o in outs
        ]

    def take_gradients(self, unit: Unit, grads: list[Tensor | None]) -> None:
        """The next chunk (on this rank) computed the gradients of ``unit``'s outputs."""
        self._out_grads[unit] = grads

    def _hand_back(self, unit: Unit, grads: list[Tensor | None]) -> None:
        """The input gradients of ``unit``: to the previous chunk if it is here, else kept for
        ``SEND_B``."""
        if self.local_prev is not None:
            self.local_prev.take_gradients(unit, grads)
        else:
            self._in_grads[unit] = grads

    # -------------------------------------------------------------------------- internals
    def _tag(self, a: Action) -> int:
        """The message tag of a unit's transfer: two per unit, activations then gradients,
        per lane (boundaries between the same two ranks, several chunks per rank)."""
        back = a.kind in _BACKWARD_KINDS
        incoming = a.kind in (Kind.RECV_F, Kind.SEND_B)
        lane = self.layout.lane_in if incoming else self.layout.lane_out
        return 2 * (self._order[a.unit] + lane * len(self._order)) + back

    def _take_out_grads(self, unit: Unit) -> list[Tensor | None] | None:
        """The gradients the next stage sent for ``unit`` (None on the last stage: the loss)."""
        return None if self.layout.is_last else self._out_grads.pop(unit)

    def _saving(self) -> Any:
        return self.memory.saving() if self._train and self.memory is not None else nullcontext()


#: Action kind -> the :class:`StageRunner` method that performs it.
ActionTable = dict[Kind, Callable[[StageRunner, Action], None]]

_WHOLE: ActionTable = {
    Kind.RECV_F: StageRunner.receive_activations,
    Kind.FORWARD: StageRunner.forward,
    Kind.SEND_F: StageRunner.send_activations,
    Kind.RECV_B: StageRunner.receive_gradients,
    Kind.BACKWARD: StageRunner.backward,
    Kind.SEND_B: StageRunner.send_gradients,
}
_SPLIT: ActionTable = {
    **_WHOLE,
    Kind.BACKWARD: StageRunner.backward_input,
    Kind.WEIGHT: StageRunner.backward_weight,
}


def action_table(split: bool) -> ActionTable:
    """The methods a step runs its actions with: under a schedule that splits backwards
    (``split``: it holds ``W`` actions) ``B`` is :meth:`StageRunner.backward_input` and ``W``
    :meth:`StageRunner.backward_weight`, else ``B`` is the whole :meth:`StageRunner.backward`.
    """
    return _SPLIT if split else _WHOLE


def check_action(a: Action, table: ActionTable, bounds: dict[Unit, tuple[int, int]]) -> None:
    """Refuse an action this step cannot run: an unknown kind or a unit outside the batch."""
    if a.unit not in bounds:
        raise PipelineRuntimeError(f"action {a} names a unit outside {list(bounds)}")
    if a.kind not in table:
        raise PipelineRuntimeError(
            f"action {a} of kind {a.kind.name} has no runner in this step (a W action in a "
            "schedule without split backwards?)"
        )
