"""A hand-split toy model for executor tests that need no graph layer.

The chain of blocks carries a skip value and a bool mask across boundaries and uses the weight
``E`` in the first and the last block (tied), which is what the executor must handle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ToyChain(nn.Module):
    """``x -> z = x @ E -> relu(l1) -> relu(l2) + z -> (h @ E.T) * (x > 0)`` as 4 blocks
    (``layers`` hidden layers: ``layers + 2`` blocks, the skip added after the last)."""

    def __init__(self, d_in: int = 6, d: int = 5, layers: int = 2) -> None:
        super().__init__()
        self.E = nn.Parameter(torch.randn(d_in, d) * 0.5)
        self.layers = layers
        for i in range(1, layers + 1):
            setattr(self, f"l{i}", nn.Linear(d, d))

    @property
    def num_blocks(self) -> int:
        return self.layers + 2

    def block(self, i: int, vals: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if i == 0:
            (x,) = vals
            z = x @ self.E
            return z, z, x > 0
        if i <= self.layers:
            h, z, mask = vals
            h = torch.relu(getattr(self, f"l{i}")(h))
            return (h + z, mask) if i == self.layers else (h, z, mask)
        h, mask = vals
        return ((h @ self.E.T) * mask,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vals: tuple[torch.Tensor, ...] = (x,)
        for i in range(self.num_blocks):
            vals = self.block(i, vals)
        return vals[0]


class ToyStage(nn.Module):
    """Blocks ``[i, j)`` of a ToyChain; holds (a reference to) the chain's parameters."""

    def __init__(self, chain: ToyChain, i: int, j: int) -> None:
        super().__init__()
        self.chain, self.i, self.j = chain, i, j

    def forward(self, *vals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for b in range(self.i, self.j):
            vals = self.chain.block(b, vals)
        return tuple(vals)


def toy_loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((outputs - batch[1]) ** 2).mean()


def toy_reference(batch: int, layers: int = 2
                  ) -> tuple[ToyChain, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-process reference of a step: the seeded chain (its gradients taken), a batch
    ``x, y`` and its loss; the next ``ToyChain`` built is the same chain again."""
    torch.manual_seed(0)
    ref = ToyChain(layers=layers)
    x, y = torch.randn(batch, 6), torch.randn(batch, 6)
    loss = toy_loss(ref(x), (x, y))
    loss.backward()
    torch.manual_seed(0)
    return ref, x, y, loss


def assert_norm_and_eval_match(ex: Any, ref: ToyChain, x: torch.Tensor, y: torch.Tensor,
                               shard: tuple[torch.Tensor, ...]) -> None:
    """The executor's global gradient norm and its evaluation loss on ``shard`` equal the
    one-process reference's on the whole batch."""
    ref_norm = torch.norm(torch.stack([q.grad.norm() for q in ref.parameters()]))
    torch.testing.assert_close(ex.global_grad_norm(), ref_norm, rtol=1e-5, atol=1e-7,
                               check_dtype=False)  # the pipeline sums in float64
    with torch.no_grad():
        ref_eval = toy_loss(ref(x), (x, y))
    torch.testing.assert_close(ex.eval_step(shard), ref_eval, rtol=1e-5, atol=1e-7)
