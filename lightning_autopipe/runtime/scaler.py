"""``PipelineGradScaler``: fp16 loss scaling whose overflow check spans every stage and replica.

A pipeline's parameters live on several ranks, each with its own optimizer. With one
``torch.amp.GradScaler`` per rank, an fp16 overflow inside one stage's backward makes only that
rank skip its step and back off its scale: the other stages step, the scales part ways and the
stages' weights drift apart without any error. This scaler reduces its inf/NaN flag over a
process group (by default the whole world: every stage of every replica) inside ``unscale_``,
so every rank sees the same flag and takes the same decision: skip or step, then grow or back
off the scale by the same factor. That is one all-reduce of one element per optimizer and step
(one per step for the usual single optimizer), issued from ``unscale_`` (which ``step`` calls
when the caller did not), so clipping after ``unscale_`` sees unscaled gradients.

The loss is scaled where backward starts, on the last stage (the executor's ``loss_scale``
hook: ``executor.loss_scale = scaler.scale``); the gradients sent between stages and the
parameter gradients on every stage then carry the same factor, which ``unscale_`` divides out
on each rank. Every rank starts from the same settings and sees the same flags, so the scale
itself stays identical everywhere and a checkpoint's single copy of it
(``GradScaler.state_dict``, plain numbers) restores into any layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp import GradScaler

__all__ = ["PipelineGradScaler"]


class PipelineGradScaler(GradScaler):
    """A ``torch.amp.GradScaler`` whose skip decision is taken over ``group`` (None: the world).

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled:
            ``torch.amp.GradScaler``'s.
        group: the process group the inf/NaN flag is reduced over; None is the default group
            (every rank of the job). Without ``torch.distributed`` the scaler acts alone.

    After each ``unscale_``, :attr:`local_found_inf` says whether this rank's own gradients
    held an inf/NaN and :attr:`found_inf` whether any rank's did (the decision taken); both
    are read lazily, so a CUDA run pays no extra synchronisation unless they are read.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        group: Any = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.group = group
        self._local_flag: torch.Tensor | None = None
        self._flag: torch.Tensor | None = None

    @property
    def local_found_inf(self) -> bool | None:
        """Whether this rank's own gradients held an inf/NaN at the last ``unscale_``."""
        return None if self._local_flag is None else bool(self._local_flag > 0)

    @property
    def found_inf(self) -> bool | None:
        """Whether any rank's did at the last ``unscale_``: the step was skipped everywhere."""
        return None if self._flag is None else bool(self._flag > 0)

    @classmethod
    def from_scaler(
        cls, scaler: GradScaler, device: str, group: Any = None
    ) -> PipelineGradScaler:
        """The same settings and state as ``scaler`` (e.g. the one Lightning built), reduced
        over ``group``."""
        new = cls(
            device,
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
            group=group,
        )
        if scaler.is_enabled():
            new.load_state_dict(scaler.state_dict())
        return new

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_``, then the inf/NaN flag reduced (max) over the group."""
        if not self._enabled:
            return
        if self._scale is None:  # only the last stage scaled a loss: start where it started
            self._lazy_init_scale_growth_tracker(_device_of(optimizer, self._device))
        super().unscale_(optimizer)
        assert self._scale is not None
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        home = self._scale.device
        flag = torch.zeros((), dtype=torch.float32, device=home)
        for value in per_device.values():
            flag = torch.maximum(flag, value.to(home))
        self._local_flag = flag.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        # A rank whose optimizer got no gradient still records the decision (``step`` requires
        # a flag per optimizer, and ``update`` must see the same flags on every rank).
        per_device.setdefault(home, flag.clone())
        for value in per_device.values():
            value.copy_(flag.to(value.device))
        self._flag = flag


def _device_of(optimizer: torch.optim.Optimizer, default: str) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device(default)
