"""Two ways a step's gradients can go wrong silently, each against one process (gloo ranks).

* A frozen front (fine-tuning with frozen embeddings) under a schedule that splits backwards:
  the second stage's inputs take no gradient, and an input-gradient pass then finds no
  weights behind them, so the stage's weights got no gradient at all.
* Steps accumulated without zeroing (the executor's contract: gradients accumulate into
  ``.grad``) with a weight tied across ranks: the tie summed what every copy already held,
  counting the earlier steps' sum once per copy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from tests.runtime._meta import broadcast

BATCH = 8


class Chain(nn.Module):
    """Three linear layers (three blocks); ``tied``: the last shares the first's weight."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        if tied:
            self.c.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    def pipeline_loss(self, outputs, batch):
        return F.mse_loss(outputs, batch[1])


def _model(tied: bool, frozen: bool) -> Chain:
    torch.manual_seed(0)
    model = Chain(tied).double()
    if frozen:
        model.a.requires_grad_(False)
    return model


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(BATCH, 8, generator=g, dtype=torch.float64) for _ in range(2))
            for _ in range(steps)]


def _case(rank: int, world: int, schedule: str, tied: bool, frozen: bool, steps: int) -> dict:
    """Every rank: ``steps`` train steps of a 2-stage plan (block a | blocks b, c), gradients
    never zeroed; returns this rank's gradients by name."""
    torch.set_num_threads(1)
    model, batches = _model(tied, frozen), _batches(steps)
    plan = Plan("given", BATCH, 2, 1, [StagePlan((0, 1), ["local:0"]),
                                       StagePlan((1, 3), ["local:1"])], schedule=schedule)
    pipe = build_local_pipeline(model, (batches[0][0],), BATCH, AutoPipeOptions(plan=plan),
                                rank=rank, world_size=world, device=torch.device("cpu"),
                                broadcast=broadcast)
    try:
        for batch in batches:
            pipe.executor.train_step(batch)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        pipe.executor.close()


def _reference(tied: bool, frozen: bool, steps: int) -> dict:
    model = _model(tied, frozen)
    for x, y in _batches(steps):
        model.pipeline_loss(model(x), (x, y)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check(ranks: list[dict], want: dict, holders: dict[str, list[int]]) -> None:
    for name, where in holders.items():
        for r in where:
            assert name in ranks[r], f"rank {r} has no gradient of {name}"
            torch.testing.assert_close(ranks[r][name], want[name], rtol=1e-9, atol=1e-12,
                                       msg=lambda s, n=name, r=r: f"rank {r} {n}: {s}")


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_a_frozen_front_still_trains_the_stages_after_it(gloo, schedule):
    ranks = gloo(2).run(_case, schedule, False, True, 1)
    assert "a.weight" not in ranks[0]  # frozen: no gradient, as in one process
    _check(ranks, _reference(False, True, 1),
           {"b.weight": [1], "b.bias": [1], "c.weight": [1], "c.bias": [1]})


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_steps_accumulated_with_a_weight_tied_across_ranks_sum_it_once(gloo, schedule):
    ranks = gloo(2).run(_case, schedule, True, False, 2)
    _check(ranks, _reference(True, False, 2),
           {"a.weight": [0, 1], "a.bias": [0], "b.weight": [1], "c.bias": [1]})
