"""This step's pending sends of one rank, released as soon as they are proven received.

A send keeps its buffer alive until waited (gloo marks it complete only then), and holding a
step's worth of sent activations and gradients to its end would break 1F1B's memory bound. A
unit's forward send is proven received when that unit's gradient arrives. Backward sends are
proven received by the previous stage's next message, whose header acknowledges how many
gradient messages it has taken: that count names our first sends only when both sides take them
in unit order, as every generated schedule does (``acks`` / ``releases``; otherwise they are
waited at the end of the step, as any leftover is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.runtime.units import Unit

__all__ = ["Outbox", "in_unit_order"]

#: What one send returns: its works, each with the buffer it must keep alive until waited.
Works = list[tuple[Any, Tensor]]


class Outbox:
    """The sends of one step (see the module docstring for when each is released)."""

    def __init__(self, acks: bool, releases: bool) -> None:
        self.forward: dict[Unit, Works] = {}
        self.backward: list[Works] = []
        self._acks, self._releases = acks, releases
        self._gradients = 0  # gradient messages received this step
        self._released = 0  # backward sends waited so far

    @classmethod
    def for_actions(cls, actions: Sequence[Action], order: dict[Unit, int]) -> Outbox:
        """The outbox of a step running ``actions`` (``order``: unit -> index in the step)."""
        return cls(acks=in_unit_order(actions, Kind.RECV_B, order),
                   releases=in_unit_order(actions, Kind.SEND_B, order))

    @property
    def ack(self) -> int:
        """What this rank's next activation message acknowledges to the next stage."""
        return self._gradients if self._acks else 0

    def gradient_arrived(self, unit: Unit) -> None:
        """``unit``'s gradient came back: its forward send was received."""
        self._gradients += 1
        _wait(self.forward.pop(unit, ()))

    def acknowledged(self, count: int) -> None:
        """The previous stage has taken ``count`` of our gradient messages."""
        while self._releases and self._released < min(count, len(self.backward)):
            _wait(self.backward[self._released])
            self.backward[self._released] = []
            self._released += 1

    def wait_all(self) -> None:
        """Wait for every send still pending (the end of the step)."""
        for works in [*self.forward.values(), *self.backward]:
            _wait(works)
        self.forward, self.backward = {}, []


def _wait(works: Sequence[tuple[Any, Tensor]]) -> None:
    for work, _buf in works:
        work.wait()


def in_unit_order(actions: Sequence[Action], kind: Kind, order: dict[Unit, int]) -> bool:
    """Whether this rank's ``kind`` actions come in the step's unit order."""
    seq = [order[a.unit] for a in actions if a.kind is kind and a.unit in order]
    return seq == sorted(seq)
