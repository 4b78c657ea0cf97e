"""Each rank's peak memory in training, measured and logged beside the plan's prediction.

The plan predicts a stage's peak as parameter bytes x (weights + gradients + optimizer state)
plus the activations of the micro-batches it holds in flight
(:func:`~lightning_autopipe.planner.pricing.peak_memory_bytes`). A :class:`MemoryMeter` measures
the same figure on the rank during one training step (the second: the optimizer's state exists
only after its first step):

* **CUDA**: the caching allocator's peak over the step (``torch.cuda.max_memory_allocated``,
  reset when the step starts): everything the step held, temporaries and message buffers too.
* **CPU** (no allocator statistics): the tensor bytes held, counted by storage, each storage
  once: the stage's parameters, their gradients and the optimizer state at the end of the step,
  plus the peak of the activations autograd saved for backward. Those are counted with
  saved-tensor hooks around every forward (stage and loss): a saved storage counts from the
  moment it is saved until the autograd graph lets it go, which is what the profiler's
  ``memory_bytes`` measures per block, so prediction and measurement count alike. The hook
  keeps a detached alias: a saved output kept with its ``grad_fn`` would make a reference
  cycle through autograd that outlives a split backward's W. A recomputing stage
  (:mod:`~lightning_autopipe.runtime.recompute`) saves only its inputs in the forward: those
  are counted there; what its backward re-creates is counted by
  :meth:`MemoryMeter.recompute_contexts`, the recompute context it hands
  ``torch.utils.checkpoint``: each storage the recomputed forward saves counts from the
  recomputation until checkpoint's cache and the backward let it go (a storage counted
  already, such as the stage's saved input, once). Not seen: temporaries freed within an op,
  the messages in transit and the gradients a split backward's B keeps for its W.

After the measured step every rank's reading is gathered (a collective inside the step, which
every rank runs) and rank 0 logs one table; :attr:`MemoryMeter.readings` keeps it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["MemoryMeter", "MemoryReading", "format_readings", "reset_resident_peak",
           "resident_peak_bytes"]

GiB = 2**30
#: The innermost saved-tensor hooks (pack, unpack), or None; checkpoint reads them the same way.
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


@dataclass(frozen=True)
class MemoryReading:
    """One rank's measured peak beside its predicted one (bytes)."""

    rank: int
    stage: int
    device: str
    predicted: int
    measured: int
    params: int
    grads: int
    optimizer: int
    activations: int  # CPU: peak saved activations; CUDA: measured minus the three above
    how: str

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


def _storage_key(t: Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (e.g. a sparse tensor)
        return None
    return storage.data_ptr(), storage.nbytes()


class _Saved:
    """A tensor autograd saved, counted until the graph drops it."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, tensor: Tensor, ptr: int, meter: MemoryMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        # torch.compile may trace the pack hook and rebuild this object without ``__init__``
        # (dropped again with nothing counted): only an object the hook made counts
        meter = getattr(self, "meter", None)
        if meter is not None:
            meter._drop(self.ptr)


class MemoryMeter:
    """Measures this rank's peak in its ``measure_step``-th training step and reports it.

    Args:
        params: the stage's parameters.
        device: the stage's device (CUDA: the allocator's peak; else tensor bytes).
        predicted: the plan's peak for this rank's device.
        rank, stage: quoted in the report.
        measure_step: which training step (1-based) to measure; the second by default, when
            the optimizer holds its state.
        report: called on rank 0 with the report text (default: Lightning's rank-0 info).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        device: torch.device,
        *,
        predicted: int,
        rank: int,
        stage: int,
        measure_step: int = 2,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.params = list(params)
        self.device = torch.device(device)
        self.predicted = int(predicted)
        self.rank, self.stage = rank, stage
        self.measure_step = measure_step
        self._report = report
        self.readings: list[MemoryReading] | None = None
        self._step = 0
        self._active = False
        self._held: dict[int, list[int]] = {}  # storage ptr -> [bytes, saves alive]
        self._current = self._peak = 0
        self._skip: set[int] = set()
        self._optimizer_bytes = 0
        ids = {id(p) for p in self.params}
        self._hook = register_optimizer_step_post_hook(
            lambda opt, args, kwargs: self._optimizer_stepped(opt, ids)
        )

    # --------------------------------------------------------------------------- the step
    @property
    def measuring(self) -> bool:
        return self._active

    def begin_step(self) -> None:
        """A training step starts (the executor calls this)."""
        self._step += 1
        self._active = self.readings is None and self._step == self.measure_step
        if not self._active:
            return
        self._held, self._current, self._peak = {}, 0, 0
        self._skip = {k[0] for p in self.params if (k := _storage_key(p)) is not None}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a forward: count what autograd saves for backward (CPU accounting)."""
        if not self._active or self.device.type == "cuda":
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    @property
    def counts_recomputation(self) -> bool:
        """Whether a recomputing stage should hand checkpoint :meth:`recompute_contexts` now
        (while measuring, on the CPU: the CUDA allocator sees the recomputation itself)."""
        return self._active and self.device.type != "cuda"

    def recompute_contexts(self) -> tuple[AbstractContextManager, AbstractContextManager]:
        """``context_fn`` of ``torch.utils.checkpoint``: (forward context, recompute context).

        The forward needs nothing (:meth:`saving` counts the inputs checkpoint saves); the
        recompute context counts what the recomputation saves (:class:`_Recounting`)."""
        return nullcontext(), _Recounting(self)

    def end_step(self) -> None:
        """The step's gradients are final: take the reading and report it (collective)."""
        if not self._active:
            return
        self._active = False
        params, grads, optimizer = self._state_bytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            measured = int(torch.cuda.max_memory_allocated(self.device))
            how = "CUDA allocator peak over the step"
            activations = max(measured - params - grads - optimizer, 0)
        else:
            activations = self._peak
            measured = params + grads + optimizer + activations
            how = ("tensor bytes held: parameters + gradients + optimizer state + peak saved "
                   "activations (saved-tensor hooks)")
        mine = MemoryReading(self.rank, self.stage, str(self.device), self.predicted, measured,
                             params, grads, optimizer, activations, how)
        readings: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            readings = [None] * dist.get_world_size()
            dist.all_gather_object(readings, mine)
        self.readings = list(readings)
        self.close()
        if self.rank == 0:
            text = format_readings(self.readings, self.measure_step)
            if self._report is not None:
                self._report(text)
            else:
                from lightning_autopipe.runtime.log import rank_zero_info

                rank_zero_info(text)

    def close(self) -> None:
        """Remove the optimizer hook (a meter that never reports must not outlive its run)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ---------------------------------------------------------------------------- internals
    def _pack(self, t: Tensor) -> Any:
        if not self._count(t):
            return t
        ptr = t.untyped_storage().data_ptr()
        return _Saved(t.detach(), ptr, self)  # no cycle through a saved output's grad_fn

    def _count(self, t: Tensor) -> bool:
        """Count ``t``'s storage as held (once however many saves share it); False when it is
        not counted (a parameter, no storage, empty): then nothing is to be dropped."""
        key = _storage_key(t)
        if key is None or key[0] in self._skip or key[1] == 0:
            return False
        ptr, nbytes = key
        entry = self._held.get(ptr)
        if entry is None:
            self._held[ptr] = [nbytes, 1]
            self._current += nbytes
            self._peak = max(self._peak, self._current)
        else:
            entry[1] += 1
        return True

    def _drop(self, ptr: int) -> None:
        entry = self._held.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._current -= entry[0]
            del self._held[ptr]

    def _optimizer_stepped(self, optimizer: Any, ids: set[int]) -> None:
        mine = [p for g in optimizer.param_groups for p in g["params"] if id(p) in ids]
        if not mine:
            return
        seen: dict[int, int] = {}
        for p in mine:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, Tensor) and (k := _storage_key(value)) is not None:
                    seen[k[0]] = k[1]
        self._optimizer_bytes = sum(seen.values())

    def _state_bytes(self) -> tuple[int, int, int]:
        storages: dict[int, int] = {}
        for p in self.params:
            if (k := _storage_key(p)) is not None:
                storages[k[0]] = k[1]
        params = sum(storages.values())
        grads: dict[int, int] = {}
        for p in self.params:
            if p.grad is not None and (k := _storage_key(p.grad)) is not None:
                grads[k[0]] = k[1]
        return params, sum(grads.values()), self._optimizer_bytes


class _Recounting:
    """Around a recomputed forward (checkpoint enters it inside the backward): counts each
    tensor the recomputation saves until it is let go.

    Checkpoint saves them with its own saved-tensor hook, pushed just before this context is
    entered, which keeps each in a cache until the backward unpacks it; a hook of the meter's
    in its place would take the tensors from that cache. So the context wraps that hook: each
    saved tensor goes to it as a fresh detached alias, which checkpoint keeps as it is (it
    needs no grad), and the count is released when that alias dies, when checkpoint's cache
    and the backward are both done with it. Outside a recomputation, or once the measured
    step has ended, it does nothing; so too under a torch without the function that reads
    the innermost saved-tensor hooks (``torch._C._autograd._top_saved_tensors_default_hooks``,
    which checkpoint itself uses), where the recomputation goes uncounted.
    """

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> _Recounting:
        top = _top_hooks(False) if _top_hooks is not None else None
        if top is None or not self.meter.counts_recomputation:
            return self
        pack, unpack = top
        meter = self.meter

        def counting(t: Tensor) -> Any:
            alias = t.detach()
            if meter._count(alias):
                weakref.finalize(alias, meter._drop, alias.untyped_storage().data_ptr())
            return pack(alias)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(counting, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None


def _unpack(saved: Any) -> Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


def format_readings(readings: Sequence[MemoryReading], step: int) -> str:
    """The report: one row per rank, predicted and measured peak side by side."""
    how = readings[0].how if readings else ""
    head = (f"{'rank':>4} {'stage':>5} {'device':<8} {'predicted':>10} {'measured':>10} "
            f"{'meas/pred':>9} {'params':>9} {'grads':>9} {'optimizer':>9} {'activations':>11}")
    lines = [f"peak memory per rank in training step {step}, predicted by the plan and "
             f"measured ({how}), GiB:", head, "-" * len(head)]
    for r in sorted(readings, key=lambda x: x.rank):
        lines.append(
            f"{r.rank:>4} {r.stage:>5} {r.device:<8} {r.predicted / GiB:>10.4f} "
            f"{r.measured / GiB:>10.4f} {r.ratio:>9.3f} {r.params / GiB:>9.4f} "
            f"{r.grads / GiB:>9.4f} {r.optimizer / GiB:>9.4f} {r.activations / GiB:>11.4f}"
        )
    return "\n".join(lines)


def resident_peak_bytes() -> int:
    """This process's peak resident set in bytes since it started or since the last
    :func:`reset_resident_peak` (``VmHWM`` of Linux ``/proc/self/status``): everything the
    process touched, not only tensors.

    Raises:
        RuntimeError: the status file has no ``VmHWM`` (not Linux).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def reset_resident_peak() -> int:
    """Make the peak resident set the current one (Linux ``/proc/self/clear_refs``); returns
    it, the base a later :func:`resident_peak_bytes` grows from."""
    Path("/proc/self/clear_refs").write_text("5")
    return resident_peak_bytes()
