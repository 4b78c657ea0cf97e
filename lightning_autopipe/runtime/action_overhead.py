"""Measure what the runtime adds to every compute action besides the stage's own work.

The profile times each block's forward and backward as the model's own calls
(:mod:`~lightning_autopipe.runtime.profiler`); the executor runs every action through a
:class:`~lightning_autopipe.runtime.stage_runner.StageRunner` on top of them: the unit's state
kept in dictionaries, its inputs sliced or handed over from a local chunk, the outputs summed
for the non-finite check, the loss weighted, a split backward's input and weight halves taken
through ``torch.autograd.grad``. That cost is paid per action, whatever the unit's size, so a
plan of many small units (several chunks per rank, startup and drain slices) pays it many
times; left out of the prices, the planner prefers such plans more than it should.

:func:`measure_action_overhead` times it on this process: two chunks of a negligible module on
one rank (a local hand-off between them, as in V and interleaved placement), their actions run
through the runners, minus the same forwards and backwards called directly (what a profile
measures). The planner adds the result to every compute action as the device's
``overhead_ms`` (:func:`~lightning_autopipe.planner.pricing.unit_parts`).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import Tensor, nn

from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.runtime.groups import ChunkLayout
from lightning_autopipe.runtime.outbox import Outbox
from lightning_autopipe.runtime.stage_runner import StageRunner, action_table
from lightning_autopipe.runtime.units import unit_bounds

__all__ = ["measure_action_overhead"]

_WIDTH = 4  # features of the negligible module: its arithmetic is far below the overheads


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_WIDTH, _WIDTH)

    def forward(self, x: Tensor) -> tuple[Tensor]:
        return (self.lin(x),)


def _loss(out: Tensor, batch: object) -> Tensor:
    return out.pow(2).mean()


def _actions(bounds: dict, split: bool) -> list[Action]:
    out: list[Action] = []
    for u in bounds:
        out += [Action(0, Kind.FORWARD, *u), Action(1, Kind.FORWARD, *u),
                Action(1, Kind.BACKWARD, *u), Action(0, Kind.BACKWARD, *u)]
        if split:
            out += [Action(1, Kind.WEIGHT, *u), Action(0, Kind.WEIGHT, *u)]
    return out


def measure_action_overhead(
    device: torch.device | None = None, *, units: int = 8, repeats: int = 15
) -> float:
    """Milliseconds the runtime adds per compute action (F, B or W) on ``device``.

    Each of ``repeats`` rounds runs ``units`` units of a two-chunk step through the runners,
    once with whole and once with split backwards, and then the same work as direct calls;
    a round's figure is the difference per action. The median round is returned (a busy
    neighbour inflates single rounds), never below 0.

    Raises:
        ValueError: ``units`` or ``repeats`` below 1.
    """
    if units < 1 or repeats < 1:
        raise ValueError(f"need units >= 1 and repeats >= 1, got {units} and {repeats}")
    dev = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    mods = [_Tiny().to(dev), _Tiny().to(dev)]
    lays = [ChunkLayout(0, 2, None, None, next_local=True),
            ChunkLayout(1, 2, None, None, prev_local=True)]
    runners = [StageRunner(m, lay, list(m.parameters()), _loss, lambda o: o[0], dev)
               for m, lay in zip(mods, lays)]
    runners[0].local_next, runners[1].local_prev = runners[1], runners[0]
    x = torch.randn(units, _WIDTH, generator=gen).to(dev)
    bounds = unit_bounds(units, units, 1, 1)
    plans = [(split, action_table(split), _actions(bounds, split)) for split in (False, True)]

    def through_runners(split: bool, table: dict, acts: list[Action]) -> float:
        for r in runners:
            r.begin((x, x), (x,), units, bounds, train=True, outbox=Outbox(False, False))
        t0 = time.perf_counter()
        for a in acts:
            table[a.kind](runners[a.stage], a)
        return time.perf_counter() - t0

    def direct() -> float:
        t0 = time.perf_counter()
        for start, stop in bounds.values():
            h = mods[0](x[start:stop])[0]
            leaf = h.detach().requires_grad_()
            _loss(mods[1](leaf)[0], None).backward()
            h.backward(leaf.grad)
        return time.perf_counter() - t0

    rounds = []
    for r in range(repeats + 1):  # the first round warms up
        ran = sum(through_runners(*p) for p in plans)
        base = 2 * direct()
        n = sum(len(p[2]) for p in plans)
        if r:
            rounds.append((ran - base) / n)
        for m in mods:
            m.zero_grad(set_to_none=True)
    return max(0.0, statistics.median(rounds) * 1e3)
