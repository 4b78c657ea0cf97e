"""BatchNorm under micro-batches and slices: whole-batch running statistics (no processes).

The reference is torch's own update: ``F.batch_norm(training=True)`` applied once to the
concatenation of every slice's input of that layer, i.e. what one process running the whole
mini-batch through that layer would track. Training-mode outputs stay the per-slice ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from lightning_autopipe.errors import PlanError
from lightning_autopipe.lightning import reproducible as R
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.batchnorm import WholeBatchStats, batch_norm_note, has_batch_norm
from tests.runtime import _cases as C

SLICES = [(0, 2), (2, 4), (4, 5), (5, 8), (8, 12)]  # a micro-batch cut into uneven slices


def _net(momentum: float | None = 0.1) -> nn.Module:
    net = C.build_net("cnn_bn")
    for m in net.modules():
        if isinstance(m, _BatchNorm):
            m.momentum = momentum
    return net.train()


def _reference(net: nn.Module, x: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    """Per-slice forwards with the statistics frozen; then torch's update on the inputs."""
    bns = [m for m in net.modules() if isinstance(m, _BatchNorm)]
    for _ in range(steps):
        seen: dict[int, list[torch.Tensor]] = {id(m): [] for m in bns}
        hooks = [m.register_forward_pre_hook(
            lambda m, a, seen=seen: seen[id(m)].append(a[0].detach())) for m in bns]
        for m in bns:
            m.track_running_stats = False
        for lo, hi in SLICES:
            net(x[lo:hi])
        for m in bns:
            m.track_running_stats = True
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for m in bns:
                m.num_batches_tracked += 1
                momentum = (1 / float(m.num_batches_tracked) if m.momentum is None
                            else m.momentum)
                F.batch_norm(torch.cat(seen[id(m)]), m.running_mean, m.running_var,
                             training=True, momentum=momentum, eps=m.eps)
    return {k: v.clone() for k, v in net.state_dict().items() if "running" in k or "tracked" in k}


def _tracked(net: nn.Module, x: torch.Tensor, steps: int, recompute: bool = False):
    stats = WholeBatchStats(net)
    outs = []
    for _ in range(steps):
        for lo, hi in SLICES:
            part = x[lo:hi].requires_grad_(recompute)
            y = checkpoint(net, part, use_reentrant=False) if recompute else net(part)
            if recompute:
                y.sum().backward()  # re-runs the forward inside backward
            outs.append(y.detach())
        stats.commit()
    stats.remove()
    state = {k: v.clone() for k, v in net.state_dict().items() if "running" in k or "tracked" in k}
    return state, outs


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
def test_running_statistics_equal_one_update_over_the_whole_batch(momentum, recompute):
    torch.manual_seed(0)
    x = torch.randn(12, 3, 8, 8)
    want = _reference(_net(momentum), x, steps=2)
    got, _ = _tracked(_net(momentum), x, steps=2, recompute=recompute)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda s, key=key: f"{key}: {s}")
    assert int(got["stem.1.num_batches_tracked"]) == 2  # once per step, not per slice


def test_per_slice_updates_differ_from_the_whole_batch_ones():
    """The reference can tell: torch's own per-slice updates give other statistics."""
    torch.manual_seed(0)
    x = torch.randn(12, 3, 8, 8)
    want = _reference(_net(), x, steps=1)
    plain = _net()
    for lo, hi in SLICES:
        plain(x[lo:hi])
    assert not torch.allclose(plain.state_dict()["stem.1.running_var"],
                              want["stem.1.running_var"], rtol=1e-3)


def test_training_outputs_stay_normalised_per_slice_and_eval_is_untouched():
    torch.manual_seed(0)
    x = torch.randn(12, 3, 8, 8)
    plain = _net()
    expected = [plain(x[lo:hi]).detach() for lo, hi in SLICES]
    _, outs = _tracked(_net(), x, steps=1)
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got, want)
    net = _net()
    stats = WholeBatchStats(net)
    net.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net(x)
    stats.commit()  # nothing tracked in evaluation
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_note_says_what_batch_norm_normalises_over():
    assert has_batch_norm(_net())
    assert not has_batch_norm(C.build_net("cnn"))
    text = batch_norm_note(16, 4, 2, 1, replicas=2)
    assert "micro-batch of 4 samples" in text
    assert "slices down to 2" in text
    assert "batch of 16" in text
    assert "broadcast_buffers" in text
    whole = batch_norm_note(8, 1, 1, 1, replicas=1)  # one unsliced micro-batch: no caveat
    assert "whole batch of 8 samples" in whole
    assert "Pin num_microbatches" not in whole
    assert "not over" not in whole


def test_deterministic_fixes_the_counts_by_a_rule_and_refuses_an_auto_depth():
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        free = AutoPipeOptions(num_stages=2)
        assert R.reproducible_options(free, 8) is free  # off: the planner decides
        torch.use_deterministic_algorithms(True)
        fixed = R.reproducible_options(free, 8)
        assert (fixed.num_microbatches, fixed.startup_slices, fixed.drain_slices) == (4, 1, 1)
        assert R.reproducible_options(AutoPipeOptions(num_stages=2), 6).num_microbatches == 6
        pinned = R.reproducible_options(AutoPipeOptions(num_stages=2, startup_slices=2), 8)
        assert pinned.startup_slices == 2  # a pinned count is kept
        with pytest.raises(PlanError, match="pin num_stages"):
            R.check_reproducible(AutoPipeOptions())
    finally:
        torch.use_deterministic_algorithms(previous)
