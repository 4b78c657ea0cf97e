"""The simulator's typed events: a device free again, a message, a ring flow, their arrival,
a flow's last byte through the links, a ring done (:mod:`~.simulate` handles each)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autopipe.planner.fluid import Flow

__all__ = ["Free", "Message", "RingFlow", "Arrived", "FlowDone", "RingDone"]


@dataclass(frozen=True, slots=True)
class Free:
    """A device finished its compute action and runs on."""

    device: int


@dataclass(frozen=True, slots=True)
class Message:
    """Activations (``SF``) or gradients (``SB``) of one unit from device ``src``'s chunk
    ``chunk`` to device ``dst``'s chunk ``dst_chunk``."""

    src: int
    dst: int
    code: int
    unit: int
    chunk: int
    dst_chunk: int


@dataclass(frozen=True, slots=True)
class RingFlow:
    """One edge's share of a stage's gradient all-reduce."""

    stage: int


@dataclass(frozen=True, slots=True)
class Arrived:
    """A message or ring flow is through (its latency paid); ``sent`` is when it left."""

    what: Message | RingFlow
    sent: float


@dataclass(frozen=True, slots=True)
class FlowDone:
    """The links carried a flow's last byte (stale when the flow's rate changed since)."""

    flow: Flow
    version: int


@dataclass(frozen=True, slots=True)
class RingDone:
    """A stage's all-reduce ended (its last flow, latency and reduction done)."""

    stage: int
