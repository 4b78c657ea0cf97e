"""In-place writes through views: the split model must see them where the model does.

A view and its base are two graph values; sent over one stage boundary they arrive as two
tensors, so a write through the view after the cut would not reach the base (wrong numbers,
no error). And a received tensor written through a view of it is an autograd leaf written in
place (an error). Blocks are never cut where two aliases of a written storage cross together,
and a stage clones a received tensor it writes through a view. Reference: the unsplit model,
every cut of the blocks (outputs and gradients, ``check_split``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_autopipe import split_model
from tests.graph._reference import check_split


class Three(nn.Module):
    """Three linear layers ``l1``, ``l2``, ``l3`` (``width`` in, ``last_in`` into ``l3``);
    each model below wires them its own way."""

    def __init__(self, width: int = 8, last_in: int = 8) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(width, width), nn.Linear(width, width)
        self.l3 = nn.Linear(last_in, width)


class WriteThroughView(Three):
    """``v`` views ``h``; ``h`` is read after the write through ``v``."""

    def forward(self, x):
        h = self.l1(x)
        v = h[:, :4]
        g = torch.relu(self.l2(x))
        v.mul_(2)
        return self.l3(g + h)


class SetItemOnReceived(Three):
    """``h[:, 0] = ...`` on a value another block computed (export records a view and copy_)."""

    def forward(self, x):
        h = self.l1(x) * 1
        g = self.l2(x)
        h[:, 0] = g[:, 0]
        return self.l3(h)


def _every_cut(n: int) -> list[list[int]]:
    return [[0, *inner, n] for k in range(n) for inner in itertools.combinations(range(1, n), k)]


@pytest.mark.parametrize("tracer", ["auto", "export"])
@pytest.mark.parametrize("model_cls", [WriteThroughView, SetItemOnReceived])
def test_writes_through_views_give_the_models_outputs_and_gradients_at_every_cut(
        model_cls, tracer):
    if model_cls is SetItemOnReceived and tracer == "auto":
        tracer = "export"  # fx cannot trace item assignment on a proxy
    torch.manual_seed(0)
    model, x = model_cls(), (torch.randn(4, 8),)
    blocks = split_model(model, x, tracer=tracer)
    assert len(blocks) >= 2
    for cuts in _every_cut(len(blocks)):
        check_split(blocks, model, x, cuts)


def test_views_of_a_storage_nobody_writes_still_cut_freely():
    """Only written storages constrain the cuts: a read-only view crossing beside its base
    keeps every block of the layer (no needless merge)."""

    class ReadOnlyView(Three):
        def forward(self, x):
            h = self.l1(x)
            v = h[:, :4]
            g = self.l2(h)
            return self.l3(v) + g + h

    model, x = ReadOnlyView(last_in=4), (torch.randn(4, 8),)
    blocks = split_model(model, x)
    assert blocks.names == ["l1", "l2", "l3"]
    for cuts in _every_cut(len(blocks)):
        check_split(blocks, model, x, cuts)

