"""The schedule generators by name: what a Plan's ``schedule`` field may say."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.schedule import Schedule, gpipe, is_split, one_f_one_b
from lightning_autopipe.planner.zero_bubble import zb_h1

__all__ = ["SCHEDULES", "build_schedule", "schedule_generator", "splits_backward"]

#: ``(stages, micro-batches, startup slices, drain slices) -> compute-only schedule``.
SCHEDULES: dict[str, Callable[[int, int, int, int], Schedule]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "zb-h1": zb_h1,
}


def schedule_generator(name: str) -> Callable[[int, int, int, int], Schedule]:
    """The generator of :data:`SCHEDULES` called ``name``.

    Raises:
        ScheduleError: an unknown name, listing the known ones.
    """
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; use one of {sorted(SCHEDULES)}"
        ) from None


class _Shaped(Protocol):
    """What :func:`build_schedule` reads of a :class:`~.plan.Plan` (which imports this module,
    so the type is structural rather than imported)."""

    schedule: str
    num_microbatches: int
    startup_slices: int
    drain_slices: int

    @property
    def num_stages(self) -> int: ...


@functools.cache
def splits_backward(schedule: str) -> bool:
    """Whether the generator ``schedule`` splits backward into B and W (zero bubble)."""
    return is_split(schedule_generator(schedule)(1, 1, 1, 1))


def build_schedule(plan: _Shaped) -> Schedule:
    """The compute-only schedule a plan names (``plan.schedule``)."""
    gen = schedule_generator(plan.schedule)
    return gen(plan.num_stages, plan.num_microbatches, plan.startup_slices, plan.drain_slices)
