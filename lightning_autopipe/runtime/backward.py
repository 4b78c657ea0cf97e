"""How one unit's backward runs on a stage: whole, or split into ``B`` (input gradients) and ``W``.

A zero-bubble schedule splits each backward: ``B`` computes the gradient with respect to the
stage's inputs only (sent on at once), keeping the autograd state the weights need, and ``W``
later accumulates the parameter gradients from it (``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight``, which split the graph at the nodes where
the input and weight paths meet, so nothing is computed twice). A compiled stage's backward is
one autograd node, so it is split inside, into compiled input- and weight-gradient graphs
(:mod:`~lightning_autopipe.runtime.compiled_split`). The rule for the first stage is
:func:`splits_backward_at`, the one place the runtime states it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_autopipe.errors import PipelineRuntimeError

__all__ = [
    "backward_input",
    "backward_weight",
    "backward_whole",
    "input_grads",
    "output_pairs",
    "split_needs",
    "splits_backward_at",
    "weights_off_the_input_path",
    "weights_reached_twice",
]


def splits_backward_at(stage: int, split: bool) -> bool:
    """Whether pipeline stage ``stage`` runs its backward in two parts under a schedule that
    splits backwards (``split``).

    The first stage has no input gradient to send: under a split schedule its ``B`` does
    nothing and its ``W`` is the whole backward. The executor, the compiled stage (whose
    backward graph is then not cut) and the profiler (a block whose inputs take no gradient)
    follow this rule; the planner prices the first stage's ``B`` as empty and its ``W`` as the
    whole backward the same way (``planner/costmodel.py``, ``planner/simulate.py``).
    """
    return split and stage > 0


def output_pairs(
    what: Any, outputs: Sequence[Tensor], grads: Sequence[Tensor | None]
) -> tuple[list[Tensor], list[Tensor]]:
    """The stage outputs that take a gradient and the gradients the next stage sent for them.

    ``what`` (an action) names the unit in the error when the counts differ.
    """
    if len(grads) != len(outputs):
        raise PipelineRuntimeError(
            f"{what}: received {len(grads)} gradients for {len(outputs)} stage outputs"
        )
    keep = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    return [o for o, _ in keep], [g for _, g in keep]  # type: ignore[misc]


def backward_whole(what: Any, result: Any, grads: Sequence[Tensor | None] | None) -> None:
    """The whole backward of a unit: from the (weighted) loss ``result`` when ``grads`` is None
    (the last stage), else from the stage outputs ``result`` with the gradients the next stage
    sent."""
    if grads is None:
        result.backward()
        return
    outs, out_grads = output_pairs(what, result, grads)
    if outs:
        torch.autograd.backward(outs, out_grads)


def input_grads(inputs: Sequence[Any]) -> list[Tensor | None]:
    """What a whole backward left in the stage inputs' ``.grad`` (sent to the previous stage)."""
    return [t.grad if t is not None and t.requires_grad else None for t in inputs]


def backward_input(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor] | None,
    inputs: Sequence[Any],
    params: Sequence[Tensor],
    *,
    whole: bool = False,
    off_path: Sequence[Tensor] = (),
) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]]]:
    """``B`` of a split backward: the gradients of ``inputs`` from ``outputs`` (given their
    ``grads``; None: the outputs are the loss), and the state :func:`backward_weight` resumes.
    ``whole``: the whole backward runs here and ``W`` finds nothing left to do (a stage whose
    weights the input path reaches twice, :func:`weights_reached_twice`). ``off_path``: those
    of ``params`` whose gradients ``B`` computes with the input gradients, as if inputs
    (:func:`weights_off_the_input_path`: ``W`` would not compute them).

    torch pipelining's ``stage_backward_input`` detaches the outputs it is given in place, to
    free the graph behind them. A stage output that the stage itself also consumes (a skip
    tensor sent on and fed to a later layer of the same stage) is saved by that layer for its
    weight gradient, and ``W`` then failed ("Trying to use a saved tensor that has been
    detached in-place"). So it is given fresh copies: the copy's backward hands the gradient
    through unchanged, and only the copies are detached (the executor drops the outputs
    after ``B`` anyway).
    """
    if whole:
        torch.autograd.backward(list(outputs), list(grads) if grads is not None else None)
        return tuple(input_grads(inputs)), []
    outs = [o.clone() for o in outputs] if grads is not None else list(outputs)
    off = {id(p) for p in off_path}
    dinputs, groups = _split_backward().stage_backward_input(
        outs, list(grads) if grads is not None else None, [*inputs, *off_path],
        iter([p for p in params if id(p) not in off]))
    return dinputs[:len(inputs)], groups


def backward_weight(params: Sequence[Tensor], state: list[dict[str, Any]]) -> None:
    """``W`` of a split backward: accumulate the weight gradients from :func:`backward_input`'s
    state into ``.grad``."""
    _split_backward().stage_backward_weight(iter(params), state)


def weights_reached_twice(
    outputs: Sequence[Tensor], inputs: Sequence[Any], params: Sequence[Tensor]
) -> bool:
    """Whether some weight feeds the path from ``outputs`` back to ``inputs`` at two points: a
    module applied twice in one stage (ALBERT's shared layer), a weight used twice.

    torch's split computes ``W`` one group of weights at a time, each from the points where
    its weights feed the input path; from the later point its pass runs back along the input
    path to the earlier one and frees what that path saved, so the next group's pass fails
    ("backward through the graph a second time"); kept, every group's pass redoes that part
    of ``B`` (a layer applied 4 times: ``W`` took 3.4x ``B``). Such a stage runs its whole
    backward in ``B`` and its ``W`` is empty (``backward_input(..., whole=True)``), as the
    planner prices a stage holding two blocks that share weights."""
    return split_needs(outputs, inputs, params)[0]


def split_needs(
    outputs: Sequence[Tensor], inputs: Sequence[Any], params: Sequence[Tensor]
) -> tuple[bool, list[Tensor]]:
    """What a stage's split backward needs to know, found once from its first unit's graph:
    whether its weights feed the input path twice (:func:`weights_reached_twice`) and which
    weights are off that path (:func:`weights_off_the_input_path`)."""
    meetings = _meetings(outputs, inputs, params)
    return any(n > 1 for n in meetings), [p for p, n in zip(params, meetings) if n == 0]


def weights_off_the_input_path(
    outputs: Sequence[Tensor], inputs: Sequence[Any], params: Sequence[Tensor]
) -> list[Tensor]:
    """The weights whose gradient path from ``outputs`` never meets the path back to
    ``inputs``: a branch of the stage fed only by values that take no gradient (a later
    stage's decoder embedding in an encoder-decoder model, fed by token ids; a position bias).

    torch's split groups each weight with the points where its path meets the input path and
    ``W`` computes each group from there, so such a weight is in no group and ``W`` dropped its
    gradient (BART under ZB-V trained its decoder embeddings on no gradient). ``B`` computes
    theirs with the input gradients (``backward_input(..., off_path=...)``): the weight work
    of that branch moves into ``B``, where the profiler times it too."""
    return split_needs(outputs, inputs, params)[1]


def _meetings(
    outputs: Sequence[Tensor], inputs: Sequence[Any], params: Sequence[Tensor]
) -> list[int]:
    """Per weight, at how many points its gradient path from ``outputs`` meets the path back
    to ``inputs`` (torch's closure helpers; -1: the weight takes no gradient)."""
    split = _split_backward()
    grad_fn = split._get_grad_fn_or_grad_acc
    ends = [f for f in map(grad_fn, outputs) if f is not None]
    starts = [f for f in (grad_fn(t) for t in inputs if isinstance(t, Tensor)) if f is not None]
    reverse = split.construct_reverse_graph(ends)
    path, _ = split.reverse_closure(starts, set(), reverse)
    out = []
    for p in params:
        node = grad_fn(p)
        out.append(-1 if node is None else len(split.reverse_closure([node], path, reverse)[1]))
    return out


def _split_backward() -> Any:
    """``torch.distributed.pipelining``'s split backward, imported when a schedule splits one
    (importing the package costs seconds, paid by every rank of every run otherwise)."""
    from torch.distributed.pipelining import _backward

    return _backward
