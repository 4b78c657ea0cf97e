"""Bucketed data-parallel gradient averaging that starts while the last backward still runs.

Gradients are final once the stage's last backward of the step has accumulated them. A
post-accumulate hook counts final gradients per bucket; a full bucket is flattened and its
all-reduce launched asynchronously, in fixed bucket order on every rank (collectives on a group
must be issued in the same order everywhere), so communication overlaps the rest of that
backward. :meth:`GradientSync.finish` launches what is left, waits, and writes the averages back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["GradientSync", "make_buckets"]


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Parameters in reverse order (their gradients are ready first), cut by size and dtype."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    used = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (used + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, used = [], 0
        current.append(p)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


class GradientSync:
    """Averages the gradients of ``params`` over ``group`` (``size`` ranks).

    Call :meth:`arm` right before the step's last backward and :meth:`finish` after it.
    """

    def __init__(self, params: list[nn.Parameter], group: Any, size: int, bucket_bytes: int):
        self.group = group
        self.size = size
        self.buckets = make_buckets(params, bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._armed = False
        self._seen: set[int] = set()
        self._left: list[int] = []
        self._next = 0
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def arm(self) -> None:
        self._armed = True
        self._seen = set()
        self._left = [len(b) for b in self.buckets]
        self._next = 0
        self._works = []

    def finish(self) -> None:
        """Launch the remaining buckets (unused parameters count as zero), wait, average."""
        if not self._armed:
            self.arm()
        self._left = [0] * len(self.buckets)
        self._launch_ready()
        for work, flat, grads in self._works:
            work.wait()
            flat /= self.size
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self._works = []
        self._armed = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed or id(p) in self._seen:
            return
        self._seen.add(id(p))
        self._left[self._bucket_of[id(p)]] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            bucket = self.buckets[self._next]
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in bucket]
            flat = _flatten_dense_tensors(grads)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._works.append((work, flat, grads))
            self._next += 1
