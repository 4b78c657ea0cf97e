"""The executor's split backward (B then W) against one whole backward, in one process.

The stages here send on a tensor that a later layer of the same stage also consumes (a skip
tensor, as a cut inside a residual block gives): that layer saved it for its weight gradient,
so ``W`` must still find it intact after ``B``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe.runtime.backward import (
    backward_input,
    backward_weight,
    weights_off_the_input_path,
    weights_reached_twice,
)


class SkipOut(nn.Module):
    """Outputs ``(h, lin2(h))``: ``h`` crosses to the next stage and feeds ``lin2`` here."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6) if norm else nn.Identity()
        self.lin2 = nn.Linear(6, 5)

    def forward(self, x):
        h = torch.relu(self.norm(self.lin1(x)))
        return h, self.lin2(h)


@pytest.mark.parametrize("norm", [False, True], ids=["linear", "batchnorm"])
def test_split_backward_equals_the_whole_backward_when_an_output_is_saved_inside(norm):
    torch.manual_seed(0)
    stage = SkipOut(norm)
    x = torch.randn(8, 6)
    g_h, g_y = torch.randn(8, 6), torch.randn(8, 5)
    params = [p for p in stage.parameters() if p.requires_grad]

    ref_x = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    h, y = stage(ref_x)
    torch.autograd.backward([h, y], [g_h, g_y])
    want_x, want = ref_x.grad.clone(), [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    inp = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    outs = list(stage(inp))
    dinputs, state = backward_input(outs, [g_h, g_y], [inp], params)
    assert all(p.grad is None for p in params), "B must leave the weight gradients to W"
    backward_weight(params, state)

    torch.testing.assert_close(dinputs[0], want_x)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
    assert outs[0].grad_fn is not None, "the stage's own outputs are not detached"


class AppliedThrice(nn.Module):
    """One layer applied three times in a row (ALBERT's shared layer in one stage), its output
    scaled by a weight that its input also reads: every weight feeds the input path twice."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.ReLU(), nn.Linear(12, 6))
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        x = x * self.scale
        for _ in range(3):
            x = x + self.layer(x)
        return x * self.scale


def _grads(stage, x, g, split):
    """Input and weight gradients of ``stage`` at ``x`` for output gradient ``g``: one whole
    backward, or B then W as a stage runner runs them."""
    params = [p for p in stage.parameters()]
    for p in params:
        p.grad = None
    inp = x.clone().requires_grad_(True)
    out = stage(inp)
    if not split:
        out.backward(g)
        return inp.grad, [p.grad for p in params]
    whole = weights_reached_twice([out], [inp], params)
    dinputs, state = backward_input([out], [g], [inp], params, whole=whole)
    backward_weight(params, state)
    return dinputs[0], [p.grad for p in params]


def test_a_stage_whose_weights_feed_its_input_path_twice_runs_its_whole_backward_in_b():
    """torch's split computes W one group of weights at a time, each pass freeing the part of
    the input path it ran back along: on such a stage the second group's pass failed ("backward
    through the graph a second time", a zero-bubble run of ALBERT). The stage is found and runs
    its whole backward in B; a stage that uses each weight once keeps the split."""
    torch.manual_seed(0)
    stage, x, g = AppliedThrice(), torch.randn(8, 6), torch.randn(8, 6)
    want_x, want = _grads(stage, x, g, split=False)
    got_x, got = _grads(stage, x, g, split=True)
    torch.testing.assert_close(got_x, want_x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)

    once = SkipOut(norm=False)
    inp = torch.randn(8, 6, requires_grad=True)
    assert weights_reached_twice(list(once(inp)), [inp], list(once.parameters())) is False
    assert weights_reached_twice([stage(inp)], [inp], list(stage.parameters())) is True


class TwoBranches(nn.Module):
    """A later stage of an encoder-decoder (BART's second chunk under ZB-V): it carries on the
    encoder's output ``x``, which takes a gradient, and starts the decoder from its token ids,
    which take none; the two leave the stage apart."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 6)
        self.embed, self.norm, self.dec = nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 6)

    def forward(self, x, ids):
        return self.enc(x), self.dec(self.norm(self.embed(ids)))


def test_weights_off_the_input_path_get_their_gradients_in_b():
    """torch's split groups each weight with the points where its path meets the input path;
    the decoder's weights meet it nowhere, so W computed nothing for them and their gradients
    were dropped (BART under ZB-V). B computes them with the input gradients."""
    torch.manual_seed(0)
    stage = TwoBranches()
    params = list(stage.parameters())
    x, ids = torch.randn(4, 6), torch.randint(0, 10, (4,))
    gs = [torch.randn(4, 6), torch.randn(4, 6)]
    want_x = x.clone().requires_grad_(True)
    torch.autograd.backward(list(stage(want_x, ids)), gs)
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    inp = x.clone().requires_grad_(True)
    outs = list(stage(inp, ids))
    off = weights_off_the_input_path(outs, [inp, ids], params)
    assert {id(p) for p in off} == {id(p) for m in (stage.embed, stage.norm, stage.dec)
                                    for p in m.parameters()}
    dinputs, state = backward_input(outs, gs, [inp, ids], params, off_path=off)
    assert all(p.grad is not None for p in off)  # in B, before W
    assert stage.enc.weight.grad is None
    backward_weight(params, state)
    torch.testing.assert_close(dinputs[0], want_x.grad)
    assert dinputs[1] is None
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w)
