"""Bucketed data-parallel gradient averaging that starts while the last backward still runs.

Gradients are final once the stage's last backward of the step has accumulated them. A
post-accumulate hook counts final gradients per bucket; a full bucket's all-reduce is launched
asynchronously, in fixed bucket order on every rank (collectives on a group must be issued in
the same order everywhere), so communication overlaps the rest of that backward.
:meth:`GradientSync.finish` launches what is left, waits, and scales by ``1 / replicas``.

Every bucket owns one flat buffer and, for the step, each parameter's ``.grad`` is a view into
it (:meth:`GradientSync.prepare`), so the all-reduce runs on the gradients where backward left
them: no flatten before and no copy back after (on a CPU those two copies of a 26 MB GPT's
gradients took as long as the all-reduce itself).

A parameter no replica gave a gradient this step (a branch not taken, a head kept for later)
ends the step with ``.grad`` None, as in one process and under DDP (its used-map), not with an
averaged zero that an optimizer would step (weight decay, momentum): one small all-reduce of
per-parameter flags at :meth:`GradientSync.finish`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["GradientSync", "make_buckets", "step_gradients_only"]


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
        self._flats: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        for bucket in self.buckets:
            flat = torch.zeros(
                sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device
            )
            self._flats.append(flat)
            self._views.append(_unflatten_dense_tensors(flat, [p.detach() for p in bucket]))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._params = list(params)
        self._view_of = {id(p): v for b, vs in zip(self.buckets, self._views)
                         for p, v in zip(b, vs)}
        self._used: set[int] = set()  # gradients this step (or held from before it)
        self._armed = False
        self._seen: set[int] = set()
        self._left: list[int] = []
        self._next = 0
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def prepare(self) -> None:
        """Make every ``.grad`` a view into its bucket; call before the step's first backward.

        A gradient that is None (zeroed with ``set_to_none``) starts from zero; one that holds
        values (accumulated by the caller) is moved into the view, so accumulation semantics
        are kept. Backward then accumulates into the views in place.
        """
        for bucket, views in zip(self.buckets, self._views):
            for p, view in zip(bucket, views):
                g = p.grad
                if g is not None:
                    self._used.add(id(p))
                if g is view:
                    continue
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
                p.grad = view

    def arm(self, done: Sequence[nn.Parameter] = ()) -> None:
        """Count the gradients accumulated from now on as final; those of ``done`` (another
        chunk's, whose last backward has run) already are."""
        self._armed = True
        self._seen = set()
        self._left = [len(b) for b in self.buckets]
        self._next = 0
        self._works = []
        for p in done:
            if id(p) in self._bucket_of and id(p) not in self._seen:
                self._seen.add(id(p))
                self._left[self._bucket_of[id(p)]] -= 1
        self._launch_ready()

    def finish(self) -> None:
        """Launch the remaining buckets (unused parameters count as zero), wait, average."""
        if not self._armed:
            self.arm()
        self._left = [0] * len(self.buckets)
        self._launch_ready()
        device = self._flats[0].device if self._flats else None
        used = torch.tensor([float(self._was_used(p)) for p in self._params], device=device)
        unused = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        for work, flat, grads in self._works:
            work.wait()
            flat /= self.size
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                if g.data_ptr() != synced.data_ptr():  # not a view (prepare was not called)
                    g.copy_(synced)
        self._works = []
        self._armed = False
        unused.wait()
        for p, flag in zip(self._params, used.tolist()):
            if not flag:  # no replica's backward reached it
                p.grad = None
        self._used = set()

    def _was_used(self, p: nn.Parameter) -> bool:
        """A backward reached ``p`` this step, or it held a gradient before (accumulation).
        A gradient that is no bucket view was put there by the caller's own backward; a split
        backward's ``W`` adds into the view in place, which fires no hook: a view holding
        anything but zeros was reached too."""
        if id(p) in self._used:
            return True
        g = p.grad
        if g is None:
            return False
        return g is not self._view_of[id(p)] or bool(g.any())

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, p: nn.Parameter) -> None:
        self._used.add(id(p))
        if not self._armed or id(p) in self._seen:
            return
        self._seen.add(id(p))
        self._left[self._bucket_of[id(p)]] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            bucket = self.buckets[self._next]
            views = self._views[self._next]
            for p, view in zip(bucket, views):
                if p.grad is None:
                    view.zero_()
                    p.grad = view
            grads = [p.grad for p in bucket]
            if all(g is v for g, v in zip(grads, views)):
                flat = self._flats[self._next]
            else:  # some gradient was replaced after prepare(): fall back to a copy
                flat = _flatten_dense_tensors(grads)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._works.append((work, flat, grads))
            self._next += 1


@contextmanager
def step_gradients_only(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Inside: ``params`` start the step without gradients; after: what they held before is
    added back.

    A weight tied across ranks sums its copies' gradients, and every copy already holds the
    earlier steps' sum when steps accumulate into ``.grad``: summed again it would count once
    per copy. Only this step's gradients are summed.
    """
    own = list({id(p): p for p in params}.values())
    held = [p.grad for p in own]
    for p in own:
        p.grad = None
    yield
    for p, g in zip(own, held):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g

