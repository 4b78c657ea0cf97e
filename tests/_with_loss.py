"""A test network under the pipeline contract: ``forward`` is the network, ``pipeline_loss`` a
given loss function; as a plain module (what the runtime pipelines without Lightning) and as a
LightningModule trained by a given optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn


class WithLoss(nn.Module):
    """``net`` with ``loss_fn(outputs, batch)`` as its ``pipeline_loss``."""

    def __init__(self, net: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        return self.loss_fn(outputs, batch)


class TaskWithLoss(WithLoss, pl.LightningModule):
    """:class:`WithLoss` as a LightningModule whose optimizer is ``optimizer(parameters)``
    (``functools.partial(torch.optim.Adam, lr=...)``). ``WithLoss.__init__`` runs
    LightningModule's (next in the method order); ``training_step`` is for Lightning's checks and
    ``strategy="auto"``: the pipeline strategy runs ``pipeline_loss`` itself."""

    def __init__(
        self,
        net: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        super().__init__(net, loss_fn)
        self.make_optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())
