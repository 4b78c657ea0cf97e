"""A model the strategy captures with torch.export trains and validates like one process.

Its forward peeks at its output with ``hasattr`` (case ``batchnorm`` of
``tests/lightning/_capture_run.py``), so
torch.fx's graph fails where the model runs and the model is exported; the export holds
BatchNorm's mode as constants, which the stages choose by their own ``train()``/``eval()``.
The reference trains the same net in this process on the same batches and evaluates it in
``eval()``: the pipeline's validation normalises by the running statistics and leaves them as
they are (two validations agree, and the statistics equal the reference's after training).
Tolerance: the suite's float32 ``rtol=1e-5, atol=1e-6`` for sums in another order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from tests.lightning import _capture_run as R

pytestmark = pytest.mark.slow

MODULE = "tests.lightning._capture_run"
WORLD_CASES = {2: [f"{MODULE}:batchnorm"]}
RTOL, ATOL = 1e-5, 1e-6


def _reference(batches: list[list[torch.Tensor]]) -> tuple[list[float], float, float, dict]:
    """One process on the batches the ranks trained (the sampler's order); the validation
    loss in ``eval()``, and (what a graph stuck in training mode would give) in ``train()``."""
    torch.set_num_threads(1)
    net = R.PeekingCNN()
    opt = torch.optim.SGD(net.parameters(), lr=R.LR)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    stuck = copy.deepcopy(net)  # batch statistics: its running ones move, the net's do not
    net.eval()
    with torch.no_grad():
        val = [float(F.cross_entropy(net(x), y)) for x, y in R.images(R.VAL_BATCHES, seed=2)]
        wrong = [float(F.cross_entropy(stuck(x), y)) for x, y in R.images(R.VAL_BATCHES, seed=2)]
    return (losses, sum(val) / len(val), sum(wrong) / len(wrong),
            {f"net.{k}": v for k, v in net.state_dict().items()})


def test_an_exported_batchnorm_model_validates_with_its_running_statistics(worlds):
    ranks = worlds.results(2, MODULE, "batchnorm", weights_only=False)
    losses, val, wrong, state = _reference(ranks[0]["batches"])
    assert wrong != pytest.approx(val, rel=1e-3)  # the check can tell the two modes apart
    for rank in ranks:
        assert rank["reads_its_mode"], "the stage does not choose BatchNorm's mode itself"
        first, second = rank["validated"]
        assert first == second  # validation left the running statistics as they were
        assert first == pytest.approx(val, rel=RTOL)
    last = next(r for r in ranks if r["stage"] == 1)
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    for rank in ranks:
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, state[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")
