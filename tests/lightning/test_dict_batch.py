"""A Hugging Face style dict batch (inputs and labels in one dict) trains like one process.

Case ``labels`` of ``tests/lightning/_capture_run.py`` runs in the shared 2-rank world; this process
trains the same net on the batches the ranks saw. Tolerance: the suite's float32 ``rtol=1e-5,
atol=1e-6`` for sums in another order (the pipeline sums the units' weighted losses).
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning import _capture_run as R

pytestmark = pytest.mark.slow

MODULE = "tests.lightning._capture_run"
WORLD_CASES = {2: [f"{MODULE}:labels"]}
RTOL, ATOL = 1e-5, 1e-6


def test_labels_riding_in_a_dict_batch_train_like_one_process(worlds):
    ranks = worlds.results(2, MODULE, "labels", weights_only=False)
    torch.set_num_threads(1)
    net = R.MaskedLM()
    opt = torch.optim.SGD(net.parameters(), lr=R.LABELS_LR)
    losses = []
    for batch in ranks[0]["batches"]:
        opt.zero_grad()
        loss = R.token_loss(net(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert len(losses) == R.STEPS
    last = next(r for r in ranks if r["stage"] == 1)
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    state = {f"net.{k}": v for k, v in net.state_dict().items()}
    for rank in ranks:
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, state[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")
