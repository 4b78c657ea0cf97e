"""The one representation of a pipeline training step, shared by the simulator and the runtime.

A schedule is ``dict[int, list[Action]]``: for each pipeline stage (equivalently, each rank of
one data-parallel replica) the ordered actions it performs in one training step. All
data-parallel replicas of a stage run the same list on their own shard of the batch.

An :class:`Action` prints and parses as short text, ``"<stage><kind><microbatch>.<slice>"``:

* ``2F0.1``  stage 2 runs forward of micro-batch 0, slice 1
* ``2B3.0``  stage 2 runs backward of micro-batch 3 (slice 0: unsliced micro-batches have one)
* ``2SF0.1`` stage 2 sends the activations of (0, 1) to stage 3; ``3RF0.1`` receives them
* ``3SB0.1`` stage 3 sends the input gradients of (0, 1) to stage 2; ``2RB0.1`` receives them

Compute-only schedules (``F``/``B``) come from the generators; :func:`lower_communication`
inserts the send/receive actions the runtime executes and the simulator prices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from lightning_autopipe.errors import ScheduleError

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "format_actions",
    "parse_actions",
    "lower_communication",
    "slice_sizes",
    "units",
]


class Kind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD)


_ACTION_RE = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B)(\d+)\.(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: compute or point-to-point transfer of one (micro-batch, slice)."""

    stage: int
    kind: Kind
    microbatch: int
    slice: int = 0

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}.{self.slice}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def unit(self) -> tuple[int, int]:
        """The (micro-batch, slice) this action works on."""
        return (self.microbatch, self.slice)

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ScheduleError(
                f"cannot parse action {text!r}; expected '<stage><F|B|SF|RF|SB|RB><mb>.<slice>',"
                " e.g. '2F0.1'"
            )
        return cls(int(m[1]), Kind(m[2]), int(m[3]), int(m[4]))


Schedule = dict[int, list[Action]]


def format_actions(actions: list[Action]) -> str:
    """Space-separated text form of one rank's action list."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    """Inverse of :func:`format_actions`."""
    return [Action.parse(t) for t in text.split()]


def lower_communication(schedule: Schedule) -> Schedule:
    """Insert the point-to-point actions around each compute action.

    Each receive is placed right before the compute that consumes it and each send right after
    the compute that produces it; sends are non-blocking in the runtime, receives block. Stage
    ``s`` receives activations from ``s - 1`` and gradients from ``s + 1``.
    """
    last = max(schedule)
    out: Schedule = {}
    for stage, actions in schedule.items():
        lowered: list[Action] = []
        for a in actions:
            if not a.kind.is_compute:
                raise ScheduleError(f"lower_communication expects compute actions only, got {a}")
            mb, sl = a.microbatch, a.slice
            if a.kind is Kind.FORWARD:
                if stage > 0:
                    lowered.append(Action(stage, Kind.RECV_F, mb, sl))
                lowered.append(a)
                if stage < last:
                    lowered.append(Action(stage, Kind.SEND_F, mb, sl))
            else:
                if stage < last:
                    lowered.append(Action(stage, Kind.RECV_B, mb, sl))
                lowered.append(a)
                if stage > 0:
                    lowered.append(Action(stage, Kind.SEND_B, mb, sl))
        out[stage] = lowered
    return out


def slice_sizes(microbatch_size: int, startup_slices: int) -> list[int]:
    """Sizes of the ``startup_slices`` even slices of one micro-batch (they differ by at most 1).

    Only micro-batch 0 is sliced; every later micro-batch is one unit of ``microbatch_size``.
    """
    if startup_slices < 1:
        raise ScheduleError(f"startup_slices must be >= 1, got {startup_slices}")
    if startup_slices > microbatch_size:
        raise ScheduleError(
            f"cannot split a micro-batch of {microbatch_size} samples into {startup_slices} "
            f"startup slices; use startup_slices <= {microbatch_size} or a larger micro-batch"
        )
    base, extra = divmod(microbatch_size, startup_slices)
    return [base + (1 if i < extra else 0) for i in range(startup_slices)]


def units(num_microbatches: int, startup_slices: int) -> list[tuple[int, int]]:
    """The (micro-batch, slice) units of one step in the order they enter the pipeline."""
    return [(0, s) for s in range(startup_slices)] + [(m, 0) for m in range(1, num_microbatches)]
