"""The one representation of a pipeline training step, shared by the simulator and the runtime.

A schedule is ``dict[int, list[Action]]``: for each rank position of one data-parallel replica
the ordered actions it performs in one training step. All data-parallel replicas of a rank
position run the same list on their own shard of the batch. A rank may hold several stage
chunks (:mod:`~.placement`): ``Action.stage`` is then the chunk (``0..S-1`` in model order,
``S = p v``) and the dict stays keyed by rank; with one chunk per rank, chunk == rank.

An :class:`Action` prints and parses as short text, ``"<stage><kind><microbatch>.<slice>"``:

* ``2F0.1``  stage 2 runs forward of micro-batch 0, slice 1
* ``2B3.0``  stage 2 runs backward of micro-batch 3 (slice 0: unsliced micro-batches have one);
  in a zero-bubble schedule that is the input gradient only and ``2W3.0`` the weight gradient
* ``2SF0.1`` stage 2 sends the activations of (0, 1) to stage 3; ``3RF0.1`` receives them
* ``3SB0.1`` stage 3 sends the input gradients of (0, 1) to stage 2; ``2RB0.1`` receives them

Compute-only schedules (``F``/``B``/``W``) come from the generators (:func:`one_f_one_b` with
split startup micro-batch, :func:`gpipe`, :func:`forward_only` here, ZB-H1 in
:mod:`~.zero_bubble`; :mod:`~.generators` names them and picks one for a Plan);
:func:`lower_communication` inserts the send/receive actions the runtime executes and the
simulator prices. A schedule with ``W`` actions is *split*: its ``B`` is the input gradient and
every unit has a ``W`` after its ``B`` on every stage (:func:`is_split`). The checker that
replays a schedule (``validate``, ``format_grid``, ``ascii_timeline``) lives in :mod:`~.replay`,
above this module.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

from lightning_autopipe.errors import ScheduleError

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "format_actions",
    "parse_actions",
    "chunk_owners",
    "lower_communication",
    "slice_sizes",
    "units",
    "unit_sizes",
    "slice_count",
    "spans",
    "check_shape",
    "is_split",
    "one_f_one_b",
    "gpipe",
    "forward_only",
    "format_schedule",
    "parse_schedule",
]


class Kind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    WEIGHT = "W"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)


_ACTION_RE = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|W)(\d+)\.(\d+)$")


class Action(NamedTuple):
    """One step of one stage: compute or point-to-point transfer of one (micro-batch, slice).

    A named tuple rather than a dataclass: schedules of long steps hold tens of thousands of
    actions and the fast model generates one per shape it prices, so creation cost counts;
    immutability, ordering and hashing are the tuple's.
    """

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
                f"cannot parse action {text!r}; expected '<stage><F|B|W|SF|RF|SB|RB><mb>.<slice>',"
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


def chunk_owners(schedule: Schedule) -> dict[int, int]:
    """Chunk -> rank position, as the schedule lists them (``Action.stage`` is the chunk)."""
    return {a.stage: r for r, acts in schedule.items() for a in acts}


def lower_communication(schedule: Schedule) -> Schedule:
    """Insert the point-to-point actions around each compute action.

    Each receive is placed right before the compute that consumes it and each send right after
    the compute that produces it; sends are non-blocking in the runtime, receives block. Chunk
    ``c`` receives activations from ``c - 1`` and gradients from ``c + 1``; two neighbouring
    chunks on one rank (several chunks per rank, :mod:`~.placement`) hand over locally, with
    no send or receive. With one chunk per rank, chunk == rank position.
    """
    owner = chunk_owners(schedule)
    last = max([max(schedule), *owner])

    def remote(r: int, c: int) -> bool:
        return owner.get(c, -1) != r

    out: Schedule = {}
    for r, actions in schedule.items():
        lowered: list[Action] = []
        for a in actions:
            if not a.kind.is_compute:
                raise ScheduleError(f"lower_communication expects compute actions only, got {a}")
            c, mb, sl = a.stage, a.microbatch, a.slice
            if a.kind is Kind.WEIGHT:  # the weight gradient: nobody waits for it
                lowered.append(a)
            elif a.kind is Kind.FORWARD:
                if c > 0 and remote(r, c - 1):
                    lowered.append(Action(c, Kind.RECV_F, mb, sl))
                lowered.append(a)
                if c < last and remote(r, c + 1):
                    lowered.append(Action(c, Kind.SEND_F, mb, sl))
            else:
                if c < last and remote(r, c + 1):
                    lowered.append(Action(c, Kind.RECV_B, mb, sl))
                lowered.append(a)
                if c > 0 and remote(r, c - 1):
                    lowered.append(Action(c, Kind.SEND_B, mb, sl))
        out[r] = lowered
    return out


def slice_sizes(microbatch_size: int, startup_slices: int) -> list[int]:
    """Sizes of the ``startup_slices`` even slices of one micro-batch (they differ by at most 1).

    Used for micro-batch 0 (startup slices) and, with the drain count, for the last one.
    """
    if startup_slices < 1:
        raise ScheduleError(f"startup_slices must be >= 1, got {startup_slices}")
    if startup_slices > microbatch_size:
        raise ScheduleError(
            f"cannot split a micro-batch of {microbatch_size} samples into {startup_slices} "
            f"slices; use startup_slices / drain_slices <= {microbatch_size} or a larger "
            "micro-batch"
        )
    base, extra = divmod(microbatch_size, startup_slices)
    return [base + (1 if i < extra else 0) for i in range(startup_slices)]


def slice_count(mb: int, num_microbatches: int, startup_slices: int, drain_slices: int) -> int:
    """How many slices micro-batch ``mb`` is cut into (the first: k, the last: j, others 1)."""
    if mb == 0:
        return startup_slices
    return drain_slices if mb == num_microbatches - 1 else 1


def units(
    num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> list[tuple[int, int]]:
    """The (micro-batch, slice) units of one step in the order they enter the pipeline.

    Micro-batch 0 has ``startup_slices`` slices; with two or more micro-batches the last one has
    ``drain_slices`` (with one micro-batch, the startup slices are all there is).
    """
    m, k, j = num_microbatches, startup_slices, drain_slices
    return [(mb, sl) for mb in range(m) for sl in range(slice_count(mb, m, k, j))]


def unit_sizes(
    microbatch_size: int, num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> list[int]:
    """Samples in each unit of :func:`units` when every micro-batch has ``microbatch_size``."""
    m, k, j = num_microbatches, startup_slices, drain_slices
    out: list[int] = []
    for mb in range(m):
        n = slice_count(mb, m, k, j)
        out += slice_sizes(microbatch_size, n) if n > 1 else [microbatch_size]
    return out


def format_schedule(schedule: Schedule) -> str:
    """Text form of a whole schedule: one line ``<stage>: <actions>`` per stage."""
    return "\n".join(f"{s}: {format_actions(schedule[s])}" for s in sorted(schedule))


def parse_schedule(text: str) -> Schedule:
    """Inverse of :func:`format_schedule`."""
    out: Schedule = {}
    for line in text.strip().splitlines():
        head, sep, body = line.partition(":")
        if not sep or not head.strip().isdigit():
            raise ScheduleError(
                f"cannot parse schedule line {line!r}; expected '<stage>: <actions>'"
            )
        out[int(head)] = parse_actions(body)
    return out


# ---------------------------------------------------------------------------- generators
def check_shape(
    num_stages: int, num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> None:
    """Generator arguments are positive integers (a ScheduleError naming the bad one)."""
    for name, v in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("startup_slices", startup_slices),
        ("drain_slices", drain_slices),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {v!r}")


def spans(
    num_microbatches: int, startup_slices: int, drain_slices: int = 1
) -> tuple[list[tuple[int, int, int, int]], int]:
    """``(microbatch, slice, start, end)`` of each unit in pipeline order, and the scale.

    Positions count samples in units of ``1 / (k j)`` of a micro-batch (``scale = k j`` per
    micro-batch), so the slices of micro-batch 0 are ``j`` positions long, those of the last
    micro-batch ``k``, and every other micro-batch ``i`` spans ``[i k j, (i + 1) k j)``.
    Shared with the fast cost model, which replays the same order without Action objects.
    """
    m, k, j = num_microbatches, startup_slices, drain_slices
    scale = k * j
    out = []
    for mb, sl in units(m, k, j):
        n = slice_count(mb, m, k, j)
        width = scale // n
        start = mb * scale + sl * width
        out.append((mb, sl, start, start + width))
    return out, scale


def one_f_one_b(
    num_stages: int, num_microbatches: int, startup_slices: int = 1, drain_slices: int = 1
) -> Schedule:
    """1F1B (one-forward-one-backward) with micro-batch 0 split into ``startup_slices`` slices.

    Warm-up depth is counted in samples, not in units: before stage ``s`` runs the backward of a
    unit ending at sample position ``e`` (in micro-batches), it has forwarded every unit that
    starts before ``e + d``, where ``d = num_stages - 1 - s`` is its distance from the last
    stage. With ``k = 1`` this is plain 1F1B (``d`` warm-up forwards, then alternate). With
    ``k > 1`` the last stage (``d = 0``) runs ``F0.0 B0.0 F0.1 B0.1 ...``: its first backward
    starts after only ``1/k`` of a micro-batch has crossed the pipeline, and the gradients of
    the early slices flow back while the later slices and micro-batches still flow forward.
    Every stage keeps the same forward lead in *samples* as plain 1F1B (counting units instead
    would let a few small slices stand in for whole micro-batches and starve the steady phase),
    so the activations it holds in flight stay bounded by ``d + 1`` micro-batches (the slices
    of micro-batch 0 together count as one), exactly as in plain 1F1B.

    4 stages, m = 4 micro-batches, k = 2 slices, forward 2 and backward 4 ticks per micro-batch
    (a slice takes 1 and 2), free transfers (:func:`ascii_timeline`); digits are forwards of that
    micro-batch, letters its backward (a = 0, b = 1, ...), ``-``/``=`` continue a unit, ``.`` is
    idle. Micro-batch 0 runs as two short slices, forwards ``0`` ``0`` and backwards ``a=`` ``a=``::

        stage 0 |001-2-3-....a=a=.......b===..c===..d===
        stage 1 |.00.1-2-..a=a=3-...b===..c===..d===
        stage 2 |..00..1-a=a=2-.b===3-c===..d===
        stage 3 |...0a=0a=1-b===2-c===3-d===

    versus plain 1F1B (k = 1)::

        stage 0 |0-1-2-3-............a===..b===..c===..d===
        stage 1 |..0-1-2-........a===3-b===..c===..d===
        stage 2 |....0-1-....a===2-b===3-c===..d===
        stage 3 |......0-a===1-b===2-c===3-d===

    What slicing can save: micro-batch 1 still enters after all of micro-batch 0 has left stage 0,
    so the last stage cannot start it before ``S f`` (``f``, ``b``: forward and backward time of a
    micro-batch per stage); with ``m >= 2`` on a balanced pipeline with free transfers the step
    shrinks by exactly ``min((S - 1) f (1 - 1/k), b)`` (3 ticks above), which is that bound.

    Drain slices are the mirror image: the last micro-batch cut into ``j`` slices. In the
    cool-down every stage but the last waits for its last gradient, and the first stage's final
    backward runs alone after the last stage has finished; with ``j`` slices the last stage hands
    back the first slice's gradient early and that tail shrinks to about ``b / j``. The same
    lead rule (in samples) applies, so memory in flight is unchanged. 2 stages, m = 3, j = 2::

        j = 1   stage 0 |0-1-....a===2-b===..c===
                stage 1 |..0-a===1-b===2-c===
        j = 2   stage 0 |0-1-....a===22b===c=c=
                stage 1 |..0-a===1-b===2c=2c=

    Args:
        num_stages: pipeline depth ``S``.
        num_microbatches: micro-batches ``m`` per replica and step.
        startup_slices: slices ``k`` of micro-batch 0 (1 = plain 1F1B).
        drain_slices: slices ``j`` of the last micro-batch when ``m >= 2`` (1 = off).

    Returns:
        Compute-only schedule (``F``/``B``); :func:`lower_communication` adds the transfers.
    """
    check_shape(num_stages, num_microbatches, startup_slices, drain_slices)
    order, scale = spans(num_microbatches, startup_slices, drain_slices)
    out: Schedule = {}
    for s in range(num_stages):
        lead = (num_stages - 1 - s) * scale
        acts: list[Action] = []
        nxt = 0
        for mb, sl, _start, end in order:
            while nxt < len(order) and order[nxt][2] < end + lead:
                acts.append(Action(s, Kind.FORWARD, order[nxt][0], order[nxt][1]))
                nxt += 1
            acts.append(Action(s, Kind.BACKWARD, mb, sl))
        out[s] = acts
    return out


def gpipe(
    num_stages: int, num_microbatches: int, startup_slices: int = 1, drain_slices: int = 1
) -> Schedule:
    """GPipe: every stage forwards all units in order, then runs backwards in reverse order."""
    check_shape(num_stages, num_microbatches, startup_slices, drain_slices)
    us = units(num_microbatches, startup_slices, drain_slices)
    return {
        s: [Action(s, Kind.FORWARD, mb, sl) for mb, sl in us]
        + [Action(s, Kind.BACKWARD, mb, sl) for mb, sl in reversed(us)]
        for s in range(num_stages)
    }


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Forwards of whole micro-batches only (validation / inference passes)."""
    check_shape(num_stages, num_microbatches, 1)
    return {
        s: [Action(s, Kind.FORWARD, mb, 0) for mb in range(num_microbatches)]
        for s in range(num_stages)
    }


def is_split(schedule: Schedule) -> bool:
    """Whether backward is split into input (``B``) and weight (``W``) gradients."""
    return any(a.kind is Kind.WEIGHT for acts in schedule.values() for a in acts)
