"""BatchNorm in a pipeline: running statistics over the whole mini-batch, buffers as DDP's.

A pipeline runs a replica's batch as micro-batches, and startup / drain slices smaller still.
In training, BatchNorm normalises each slice by that slice's own statistics (the activations
of a slice exist alone: that cannot change without a step-wide barrier per layer), but the
running statistics, which evaluation uses, would be updated once per slice with the slice's
statistics: a different model for every plan. As torchgpipe's ``deferred_batch_norm``,
:class:`WholeBatchStats` keeps each BatchNorm's running statistics untouched during the step,
accumulates the per-channel sum and sum of squares of every slice's input, and
:meth:`~WholeBatchStats.commit` updates the running statistics once per step from the whole
mini-batch (the same ``momentum`` update, unbiased variance, and ``num_batches_tracked``
count a single process makes for that batch), so they do not depend on the plan.

:func:`broadcast_buffers` then copies the BatchNorm buffers of the stage's first
data-parallel replica to the others after every step, as DDP's ``broadcast_buffers=True``
copies rank 0's before each forward: every replica evaluates and checkpoints the same model.
(DDP copies every buffer; the others of the models trained here are constants, see
:func:`batch_norm_buffers`.)

Only BatchNorm modules that the stage still holds as modules (torch.fx traced models) are
tracked; a model captured by ``torch.export`` has its normalisation inlined as operators and
keeps per-slice updates (the note says so).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["WholeBatchStats", "batch_norm_buffers", "batch_norm_note", "broadcast_buffers",
           "has_batch_norm"]


def has_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` holds a BatchNorm that tracks running statistics."""
    return any(isinstance(m, _BatchNorm) and m.track_running_stats for m in module.modules())


def _in_backward() -> bool:
    """True while autograd runs a backward (a checkpointed stage re-running its forward)."""
    return torch._C._current_graph_task_id() != -1


class _Sums:
    __slots__ = ("count", "sum", "sumsq")

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.sumsq: torch.Tensor | None = None
        self.count = 0


class WholeBatchStats:
    """Running statistics of a stage's BatchNorm modules tracked over the step's whole batch.

    Args:
        stage: the local stage; its BatchNorm modules (tracking running statistics) get a
            forward pre-hook and hook for as long as this object lives (:meth:`remove`).
    """

    def __init__(self, stage: nn.Module) -> None:
        self.modules = [m for m in stage.modules()
                        if isinstance(m, _BatchNorm) and m.track_running_stats
                        and m.running_mean is not None]
        self._sums = {id(m): _Sums() for m in self.modules}
        self._handles = []
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._before))
            self._handles.append(m.register_forward_hook(self._after))

    def _before(self, module: _BatchNorm, args: Any) -> None:
        if module.training:  # normalise by the slice, leave the running statistics alone
            module.track_running_stats = False

    def _after(self, module: _BatchNorm, args: Any, output: Any) -> None:
        if not module.training:
            return
        module.track_running_stats = True
        if _in_backward():  # a recomputed forward: its slice was counted the first time
            return
        x = args[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        x64 = x.to(torch.float64)
        sums = self._sums[id(module)]
        s, sq = x64.sum(dims), (x64 * x64).sum(dims)
        sums.sum = s if sums.sum is None else sums.sum + s
        sums.sumsq = sq if sums.sumsq is None else sums.sumsq + sq
        sums.count += x.numel() // max(x.shape[1], 1)

    def commit(self) -> None:
        """Update every tracked running statistic once from the step's whole batch."""
        with torch.no_grad():
            for m in self.modules:
                sums = self._sums[id(m)]
                if sums.count == 0 or sums.sum is None or sums.sumsq is None:
                    continue
                n = sums.count
                mean = sums.sum / n
                var = (sums.sumsq / n - mean * mean).clamp_min(0)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                assert m.num_batches_tracked is not None
                assert m.running_var is not None
                m.num_batches_tracked.add_(1)
                factor = (1.0 / float(m.num_batches_tracked) if m.momentum is None
                          else float(m.momentum))
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(unbiased.to(m.running_var.dtype),
                                                    alpha=factor)
                self._sums[id(m)] = _Sums()

    def discard(self) -> None:
        """Forget a step's sums without committing them (a step that failed half-way)."""
        self._sums = {id(m): _Sums() for m in self.modules}

    def remove(self) -> None:
        """Take the hooks off the stage's modules."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.modules:
            m.track_running_stats = True


def batch_norm_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics and counters of ``module``'s BatchNorm layers.

    These are the buffers training changes. Other buffers of the models trained here are
    constants every replica builds alike (causal masks, position ids); copying them too, as DDP
    does, would cost a collective per step and change nothing.
    """
    return [b for m in module.modules() if isinstance(m, _BatchNorm)
            for b in m.buffers(recurse=False) if b is not None]


def broadcast_buffers(module: nn.Module, group: Any, src: int) -> None:
    """Copy ``module``'s BatchNorm buffers from global rank ``src`` to every rank of ``group``.

    One flat broadcast per dtype (BatchNorm has float statistics and an int64 counter).
    """
    buffers = batch_norm_buffers(module)
    if not buffers or group is None or dist.get_world_size(group) < 2:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault((b.dtype, b.device), []).append(b)
    for (_, _), same in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        flat = _flatten_dense_tensors([b.detach() for b in same])
        dist.broadcast(flat, src=src, group=group)
        for b, value in zip(same, _unflatten_dense_tensors(flat, same)):
            b.data.copy_(value)


def batch_norm_note(replica_batch: int, num_microbatches: int, startup_slices: int,
                    drain_slices: int, replicas: int) -> str:
    """What BatchNorm normalises over under this plan, in words (logged once by rank 0)."""
    tracked = ("its running statistics (used in evaluation) are tracked once per step" + (
        f"; the first replica's buffers are copied to the other {replicas - 1} after every "
        "step (as DDP's broadcast_buffers)" if replicas > 1 else ""))
    if num_microbatches <= 1 and startup_slices <= 1:  # one unit: the whole replica batch
        return (f"BatchNorm: in training each layer normalises over the replica's whole batch "
                f"of {replica_batch} samples (one micro-batch, unsliced), as one process "
                f"does; {tracked}")
    micro = replica_batch // max(num_microbatches, 1)
    smallest = micro // max(startup_slices, drain_slices if num_microbatches > 1 else 1, 1)
    parts = [f"BatchNorm: in training each layer normalises over one unit of the pipeline "
             f"(a micro-batch of {micro} samples"]
    if startup_slices > 1 or (drain_slices > 1 and num_microbatches > 1):
        parts.append(f"; startup / drain slices down to {smallest}")
    parts.append(
        f"), not over the replica's batch of {replica_batch}; its running statistics (used in "
        f"evaluation) are tracked over the whole batch of each replica, once per step, and "
        f"the first replica's buffers are copied to the other {replicas - 1} after every step "
        "(as DDP's broadcast_buffers)" if replicas > 1 else
        f"), not over the replica's batch of {replica_batch}; its running statistics (used in "
        "evaluation) are tracked over the whole batch, once per step")
    parts.append(". Pin num_microbatches=1, startup_slices=1 and drain_slices=1 to normalise "
                 "over the whole batch (no pipelining within a step)")
    return "".join(parts)
