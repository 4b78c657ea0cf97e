"""A wall clock that waits for the device: what every timing in the runtime reads.

Work on an accelerator is queued, so ``time.perf_counter()`` alone times the launch, not the
work; the profiler, the link calibration and the compiled-stage timing all read the clock after
the device has finished. It sits at the bottom of the runtime (it imports only torch) so any
module may time with it without importing the profiler.
"""

from __future__ import annotations

import time

import torch

__all__ = ["now", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()
