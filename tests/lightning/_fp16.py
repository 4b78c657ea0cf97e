"""fp16 loss scaling under the pipeline: the module, the scaler settings and the reference.

Shared by the launch (``_fp16_run.py``) and the one-process reference in the pytest process.

The net is built so that one stage overflows alone. Stage 1 (blocks ``head`` and ``side``)
adds ``side(h.detach()) / SIDE * SIDE`` to its output: in value just ``side(h)``, but the
backward of the ``* SIDE`` holds, in fp16, ``SIDE`` times the output's gradient: with a loss
scale ``S`` that is ``SIDE * S * dL/dy`` per element, which passes 65504 (fp16's largest value)
at a scale where every other fp16 gradient is at least ``SIDE / 16`` times smaller (the
weight gradients sum at most 16 samples of ``|h| <= 1``); the inf reaches ``side``'s weights
and the ``detach`` keeps it out of stage 0, whose gradients stay finite. The targets are +-1
and the outputs start near 0, so ``dL/dy`` of the mean squared error is about ``2 / N`` per
element (``N`` = samples x 4 outputs) in every step, and the step of the first overflow is
known in advance:

* the scale grows 4x after every finite step (``growth_interval=1``) and backs off 16x;
* ``INIT_SCALE = 2.8 * 65504 / SIDE`` puts the overflow at step 2 (scale ``16 * INIT_SCALE``)
  both for the mean over a replica's 8 samples and for the mean over 16 (one process on the
  2x2 run's global batch): inside a data-parallel backward each replica's gradient is its own
  mean loss's (twice the global one's with two replicas, as under DDP), and growth by 4 leaves
  a window in which both overflow at the same step (``2 < 2.8 < 4``); steps 0, 1, 3 and 4 stay
  finite with a margin of ``4 / 2.8``;
* after 5 steps the scale is ``16 * INIT_SCALE`` again, so a run resumed from that checkpoint
  overflows at its first step: only a restored scale does (a fresh one would be 16x smaller).
"""

from __future__ import annotations

from functools import partial

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests._with_loss import TaskWithLoss

SIDE = 1024.0
FP16_MAX = 65504.0
INIT_SCALE = 2.8 * FP16_MAX / SIDE
SCALER = {"init_scale": INIT_SCALE, "growth_factor": 4.0, "backoff_factor": 1 / 16,
          "growth_interval": 1}
OVERFLOW_STEP = 2
STEPS, RESUME_STEPS = 5, 2
REPLICA_BATCH, MICROBATCHES, STARTUP_SLICES, DRAIN_SLICES = 8, 2, 2, 2  # units of 2, 2, 2, 2
CUT = 2  # blocks inp, mid | head, side
LR, CLIP = 0.3, 0.25


class Net(nn.Module):
    """Two tanh layers (stage 0), then a head plus the overflowing side branch (stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid = nn.Linear(8, 16), nn.Linear(16, 16)
        self.head, self.side = nn.Linear(16, 4), nn.Linear(16, 4)
        with torch.no_grad():  # outputs near 0: dL/dy is ~2/N from the first step on
            self.head.weight.mul_(0.05)
            self.side.weight.mul_(0.05)
            self.head.bias.zero_()
            self.side.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.head(h) + self.side(h.detach()) / SIDE * SIDE


def loss_fn(outputs: torch.Tensor, batch) -> torch.Tensor:
    return F.mse_loss(outputs, batch[1])


class Task(TaskWithLoss):
    def __init__(self) -> None:
        super().__init__(Net(), loss_fn, partial(torch.optim.SGD, lr=LR))


def plugin(device: str = "cpu") -> MixedPrecision:
    """fp16 autocast with a plain scaler of these settings (Lightning picks bf16 on a CPU)."""
    return MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, **SCALER))


def loader(samples: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    y = torch.randint(0, 2, (samples, 4), generator=g).float() * 2 - 1
    return DataLoader(TensorDataset(x, y), batch_size=REPLICA_BATCH)


def reference(batches, state=None, scaler_state=None, device: str = "cpu") -> dict:
    """One process over the global ``batches``: autocast fp16, the same scaler settings,
    ``unscale_`` then norm clipping, SGD; every step's loss, norm, scale and (CPU) weights."""
    net = Net()
    if state is not None:
        net.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    net = net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    kind = torch.device(device).type
    scaler = torch.amp.GradScaler(kind, **SCALER)
    if scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    out: dict = {"start_scale": scaler.get_scale(), "losses": [], "norms": [], "scales": [],
                 "skipped": [], "states": []}
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=torch.float16, cache_enabled=False):
            loss = F.mse_loss(net(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        out["losses"].append(float(loss.detach()))
        out["norms"].append(float(norm))
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(scaler.get_scale() < before)
        out["states"].append({f"net.{k}": v.detach().cpu().clone()
                              for k, v in net.state_dict().items()})
    return out
