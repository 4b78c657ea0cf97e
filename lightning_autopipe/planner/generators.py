"""The schedule generators by name: what a Plan's ``schedule`` field may say.

:data:`SCHEDULES` holds the one-chunk-per-rank generators ``(stages, m, k, j) -> schedule``
(1F1B, GPipe, ZB-H1), which the fast model and the runtime call directly. :data:`GENERATORS`
describes every schedule, those with several stage chunks per rank (:mod:`~.placement`)
included: the placement it needs, the chunk counts it takes and whether it splits the
backward; :func:`generate` builds any of them for ``p`` ranks and ``v`` chunks per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.interleaved import interleaved_1f1b
from lightning_autopipe.planner.placement import check_placement
from lightning_autopipe.planner.schedule import Schedule, gpipe, is_split, one_f_one_b
from lightning_autopipe.planner.zbv import zbv
from lightning_autopipe.planner.zero_bubble import zb_h1

__all__ = ["AUTO_SCHEDULES", "SCHEDULES", "GENERATORS", "Generator", "build_schedule",
           "check_schedule", "generate", "schedule_generator", "splits_backward"]

#: ``(stages, micro-batches, startup slices, drain slices) -> compute-only schedule``, for the
#: schedules with one chunk per rank.
SCHEDULES: dict[str, Callable[[int, int, int, int], Schedule]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "zb-h1": zb_h1,
}


@dataclass(frozen=True)
class Generator:
    """One schedule family: ``build(ranks, m, k, j, v)``, the placement its chunks need and
    the chunk counts ``v`` it takes (None: any)."""

    name: str
    build: Callable[[int, int, int, int, int], Schedule]
    placement: str = "looped"
    chunks: tuple[int, ...] | None = (1,)

    def takes(self, chunks_per_rank: int) -> bool:
        return self.chunks is None or chunks_per_rank in self.chunks


def _one(fn: Callable[[int, int, int, int], Schedule]):
    def build(p: int, m: int, k: int, j: int, v: int) -> Schedule:
        return fn(p, m, k, j)

    return build


GENERATORS: dict[str, Generator] = {
    **{name: Generator(name, _one(fn)) for name, fn in SCHEDULES.items()},
    "interleaved-1f1b": Generator("interleaved-1f1b", interleaved_1f1b, "looped", None),
    "zbv": Generator("zbv", zbv, "v", (2,)),
}

#: what ``schedule="auto"`` considers: one chunk per rank (1F1B, zero-bubble ZB-H1) and several
#: (interleaved 1F1B, ZB-V). GPipe (1F1B's step with every micro-batch's activations held at
#: once) is left to those who pin it.
AUTO_SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "zbv")


def _known(name: str) -> Generator:
    try:
        return GENERATORS[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; use one of {sorted(GENERATORS)}"
        ) from None


def schedule_generator(name: str) -> Callable[[int, int, int, int], Schedule]:
    """The one-chunk-per-rank generator called ``name`` (``(stages, m, k, j)``; a chunked
    schedule's with its default chunks per rank).

    Raises:
        ScheduleError: an unknown name, listing the known ones.
    """
    gen = _known(name)
    if name in SCHEDULES:
        return SCHEDULES[name]
    v = 2 if gen.chunks is None else gen.chunks[0]
    return lambda p, m, k=1, j=1: gen.build(p, m, k, j, v)


def check_schedule(name: str, chunks_per_rank: int = 1, placement: str = "looped") -> Generator:
    """The generator ``name``, checked against a plan's chunks per rank and placement.

    Raises:
        ScheduleError: unknown name, or a chunk count / placement the schedule cannot run
            (the message says which schedules can).
    """
    gen = _known(name)
    check_placement(1, chunks_per_rank, placement)
    if not gen.takes(chunks_per_rank):
        fit = sorted(n for n, g in GENERATORS.items() if g.takes(chunks_per_rank))
        raise ScheduleError(
            f"schedule {name!r} runs {list(gen.chunks or ())} chunk(s) per rank, not "
            f"{chunks_per_rank}; with {chunks_per_rank} chunks per rank use one of {fit}"
        )
    if chunks_per_rank > 1 and placement != gen.placement:
        raise ScheduleError(
            f"schedule {name!r} needs the {gen.placement!r} placement of its chunks, not "
            f"{placement!r}"
        )
    return gen


def generate(name: str, num_ranks: int, num_microbatches: int, startup_slices: int = 1,
             drain_slices: int = 1, chunks_per_rank: int = 1) -> Schedule:
    """The compute-only schedule ``name`` for ``p`` ranks of ``v`` chunks (keyed by rank,
    ``Action.stage`` the chunk)."""
    gen = check_schedule(name, chunks_per_rank, _known(name).placement)
    return gen.build(num_ranks, num_microbatches, startup_slices, drain_slices, chunks_per_rank)


class _Shaped(Protocol):
    """What :func:`build_schedule` reads of a :class:`~.plan.Plan` (which imports this module,
    so the type is structural rather than imported)."""

    schedule: str
    num_microbatches: int
    startup_slices: int
    drain_slices: int
    chunks_per_rank: int
    placement: str

    @property
    def num_ranks(self) -> int: ...


@functools.cache
def splits_backward(schedule: str) -> bool:
    """Whether the generator ``schedule`` splits backward into B and W (zero bubble)."""
    return is_split(schedule_generator(schedule)(1, 1, 1, 1))


def build_schedule(plan: _Shaped) -> Schedule:
    """The compute-only schedule a plan names (``plan.schedule``) for its ranks and chunks."""
    v = plan.chunks_per_rank
    gen = check_schedule(plan.schedule, v, plan.placement)
    return gen.build(plan.num_ranks, plan.num_microbatches, plan.startup_slices,
                     plan.drain_slices, v)
