"""GradientSync against plain autograd: averages, accumulation, and the bucket-view fast path."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopipe.runtime.gradsync import GradientSync


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _case(rank: int, world: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    ref = _model()
    ref(x).pow(2).mean().backward()  # mean over both ranks' halves = mean of the whole
    model = _model()
    params = list(model.parameters())
    # bucket of 100 bytes: several buckets, launched one by one during the backward
    sync = GradientSync(params, dist.group.WORLD, 2, bucket_bytes=100)
    assert len(sync.buckets) > 2
    for step in range(2):  # second step: gradients left from the first accumulate
        sync.prepare()
        sync.arm()
        model(x[rank * 3 : rank * 3 + 3]).pow(2).mean().backward()
        sync.finish()
        for p, r in zip(params, ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad * (step + 1), rtol=1e-5, atol=1e-7)
    # a gradient replaced after prepare() (e.g. by user code) is still averaged
    for p in params:
        p.grad = None
    sync.prepare()
    params[0].grad = torch.zeros_like(params[0])
    sync.arm()
    model(x[rank * 3 : rank * 3 + 3]).pow(2).mean().backward()
    sync.finish()
    for p, r in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)
    sync.remove()  # the hooks hold the group: it must not outlive destroy_process_group
    del sync


def test_bucketed_average_equals_whole_batch_gradients_and_keeps_accumulation(gloo):
    gloo(2).run(_case)


def _unused_case(rank: int, world: int) -> None:
    """One process (and DDP) leaves a parameter no backward reached with ``.grad`` None, so
    AdamW's weight decay and moments skip it; one only replica 0 used is averaged."""
    torch.manual_seed(0)
    used, spare, sometimes = nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(3, 3)
    params = [*used.parameters(), *spare.parameters(), *sometimes.parameters()]
    sync = GradientSync(params, dist.group.WORLD, 2, bucket_bytes=40)
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    before = [p.detach().clone() for p in spare.parameters()]
    x = torch.ones(2, 3) * (rank + 1)
    for _ in range(2):
        opt.zero_grad()
        sync.prepare()
        sync.arm()
        out = used(x).sum() + (sometimes(x).sum() if rank == 0 else 0.0)
        out.backward()
        sync.finish()
        assert all(p.grad is None for p in spare.parameters())
        assert all(p.grad is not None for p in [*used.parameters(), *sometimes.parameters()])
        opt.step()
    for p, b in zip(spare.parameters(), before):
        assert torch.equal(p, b)
    assert all(p not in opt.state or not opt.state[p] for p in spare.parameters())
    # replica 0's gradient (2 rows of ones: 2) averaged with replica 1's zero
    torch.testing.assert_close(sometimes.bias.grad, torch.full((3,), 1.0))
    sync.remove()
    del sync


def test_a_parameter_no_replica_used_keeps_no_gradient(gloo):
    gloo(2).run(_unused_case)
