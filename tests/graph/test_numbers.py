"""A Python number the model reads is a constant of the captured graph: one changed after the
capture is named (the strategy warns of it after a step), and the graph indeed still computes
with the captured value, which is what makes the warning true (no processes)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_autopipe import split_model
from lightning_autopipe.graph.numbers import changed_numbers


class Annealed(nn.Module):
    """A temperature annealed during training, as a Python number; a dropout module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.drop, self.out = nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 2)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.inp(x))) / self.temperature)


class Holder(nn.Module):
    """The model under a root, as a LightningModule holds it; the root's own number is the
    steps' (a loss weight), not named."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.loss_weight = Annealed(), 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_number_changed_after_the_capture_is_named_and_the_graph_keeps_the_old(tracer):
    model, x = Holder(), torch.randn(3, 4)
    blocks = split_model(model, (x,), tracer=tracer)
    captured = copy.deepcopy(model)
    assert changed_numbers(blocks.numbers) == []
    model.net.temperature, model.loss_weight = 2.0, 1.0
    model.net.drop.p = 0.0 if tracer == "fx" else 0.5  # fx calls the module: it reads p itself
    changed = {n.path: now for n, now in changed_numbers(blocks.numbers)}
    assert changed == ({"net.temperature": 2.0} if tracer == "fx"
                       else {"net.temperature": 2.0, "net.drop.p": 0.5})
    model.eval(), captured.eval()
    with torch.no_grad():
        torch.testing.assert_close(blocks.run((x,)), captured(x))  # the captured 1.0
        assert not torch.allclose(blocks.run((x,)), model(x))


def test_a_number_set_back_or_never_changed_is_not_named():
    model, x = Holder(), torch.randn(3, 4)
    blocks = split_model(model, (x,), tracer="fx")
    model.net.temperature = 2.0
    model.net.temperature = 1.0
    model.train(False)  # the mode is followed by the stages themselves
    assert changed_numbers(blocks.numbers) == []
    model.net.temperature = torch.ones(3)  # another type (compared first: no elementwise bool)
    assert [n.path for n, _ in changed_numbers(blocks.numbers)] == ["net.temperature"]
    model.net.temperature = float("nan")  # a NaN captured stays equal to a NaN
    blocks = split_model(model, (x,), tracer="fx")
    assert changed_numbers(blocks.numbers) == []
