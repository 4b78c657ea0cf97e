"""The tiny GPT task, data and single-process references shared by the reliability launches.

A global batch is ``GLOBAL_BATCH`` samples whatever the layout: with ``R`` replicas the
dataloader batch is ``GLOBAL_BATCH // R``. Lightning wraps every training loader in a shuffling
``DistributedSampler`` (seed ``PL_GLOBAL_SEED`` or 0); replica ``r`` takes every ``R``-th index of
one permutation, so the *set* of samples of global step ``t`` is the same for every ``R``: the
global-batch mean loss (and its gradients) do not depend on the layout. The ``strategy="auto"``
run uses the one-replica sampler explicitly, so it sees the same batches too.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_autopipe.zoo.models import TinyGPT
from tests._with_loss import WithLoss

VOCAB, SEQ = 32, 8
GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 2
LR = 0.01
# Adam turns rounding noise into full-size steps for parameters whose exact gradient is zero
# (a key bias under softmax): with eps 1e-8 a pipeline and one process, summing in different
# orders, then drift apart by ~lr on such entries. eps 1e-4 keeps the moments in play and the
# runs comparable at rtol 1e-5.
ADAM_EPS = 1e-4


def dataset(num: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def build_net(dropout: float = 0.0, d_model: int = 16, seed: int | None = 0) -> TinyGPT:
    if seed is not None:
        torch.manual_seed(seed)
    return TinyGPT(vocab=VOCAB, seq_len=SEQ, d_model=d_model, n_layers=2, n_heads=2,
                   dropout=dropout)


def lm_loss(outputs: torch.Tensor, batch) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), batch[1].reshape(-1))


class NetWithLoss(WithLoss):
    """The test GPT as a plain module with the pipeline's loss (runtime tests without Lightning)."""

    def __init__(self) -> None:
        super().__init__(build_net(), lm_loss)


class Task(pl.LightningModule):
    """Adam (or SGD) on a tiny tied-embedding GPT; ``replicas`` sizes the dataloader batch."""

    def __init__(
        self,
        replicas: int = 1,
        *,
        optimizer: str = "adam",
        dropout: float = 0.0,
        d_model: int = 16,
        steps_per_epoch: int = STEPS_PER_EPOCH,
        explicit_sampler: bool = False,
        init_seed: int | None = 0,
        poison_loss_at: int | None = None,
        global_batch: int = GLOBAL_BATCH,
    ) -> None:
        super().__init__()
        self.net = build_net(dropout, d_model, init_seed)
        self.replicas = replicas
        self.optimizer_name = optimizer
        self.steps_per_epoch = steps_per_epoch
        self.global_batch = global_batch
        self.explicit_sampler = explicit_sampler
        self.step_losses: list[float] = []
        self.poison_loss_at = poison_loss_at  # global step whose loss becomes NaN

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        loss = lm_loss(outputs, batch)
        if self.poison_loss_at is not None and self.trainer.global_step == self.poison_loss_at:
            loss = loss * float("nan")
        return loss

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.step_losses.append(float(loss))
        self.log("train_loss", loss.detach(), on_step=True)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.Adam(self.parameters(), lr=LR, eps=ADAM_EPS)

    def train_dataloader(self):
        ds = dataset(self.global_batch * self.steps_per_epoch)
        if self.explicit_sampler:  # strategy="auto" on one device: the same order as Lightning's
            sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(ds, batch_size=self.global_batch, sampler=sampler)
        return DataLoader(ds, batch_size=self.global_batch // self.replicas)


def global_batches(steps: int, steps_per_epoch: int, global_batch: int = GLOBAL_BATCH):
    """The (inputs, targets) of every global step, as the shuffling samplers order them."""
    ds = dataset(global_batch * steps_per_epoch)
    out = []
    epoch = 0
    while len(out) < steps:
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        idx = list(sampler)
        for t in range(steps_per_epoch):
            sel = idx[t * global_batch : (t + 1) * global_batch]
            out.append((ds.tensors[0][sel], ds.tensors[1][sel]))
        epoch += 1
    return out[:steps]


def reference_losses(
    steps: int,
    *,
    optimizer: str = "adam",
    d_model: int = 16,
    steps_per_epoch: int = STEPS_PER_EPOCH,
    skip_steps: tuple[int, ...] = (),
    global_batch: int = GLOBAL_BATCH,
) -> list[float]:
    """Single-process plain-torch training on the same global batches; ``skip_steps`` take no
    optimizer step (what ``nonfinite_loss="skip"`` does)."""
    net = build_net(0.0, d_model, 0)
    if optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=LR, eps=ADAM_EPS)
    losses = []
    for t, (x, y) in enumerate(global_batches(steps, steps_per_epoch, global_batch)):
        opt.zero_grad()
        loss = lm_loss(net(x), (x, y))
        loss.backward()
        losses.append(float(loss.detach()) if t not in skip_steps else float("nan"))
        if t not in skip_steps:
            opt.step()
    return losses
