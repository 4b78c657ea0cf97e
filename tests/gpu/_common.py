"""The tiny GPT with the pipeline loss contract and its data, shared by the GPU tests."""

from __future__ import annotations

import torch
from torch import nn

from tests.reliability import _task as T

#: float32 agreement between devices and layouts (TF32 off: products round as float32 does)
RTOL, ATOL = 1e-4, 1e-5


class Model(nn.Module):
    """``tests.reliability._task``'s tiny tied-embedding GPT, with ``pipeline_loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = T.build_net(seed=0)

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        return T.lm_loss(outputs, batch)


def batch(n: int = 8, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of (input tokens, next tokens)."""
    data = T.dataset(n, seed=seed)
    return data.tensors[0], data.tensors[1]


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float32 agreement, ``got`` moved to ``want``'s device."""
    torch.testing.assert_close(
        got.to(want.device), want, rtol=RTOL, atol=ATOL, msg=lambda s: f"{what}: {s}"
    )
