"""The executor's split backward (B then W) against one whole backward, in one process.

The stages here send on a tensor that a later layer of the same stage also consumes (a skip
tensor, as a cut inside a residual block gives): that layer saved it for its weight gradient,
so ``W`` must still find it intact after ``B``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe.runtime.backward import backward_input, backward_weight


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
