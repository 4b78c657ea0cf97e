"""Batches whose model inputs are several of their entries train like one process: a Hugging
Face style dict batch (inputs and labels in one dict), the same batch as a mapping that is not
a ``dict`` (a tokenizer's ``BatchEncoding`` is a ``UserDict``), and a tuple batch
``(input_ids, attention_mask, labels)`` whose step calls ``self(input_ids, attention_mask)``.

Cases ``labels``, ``mapping`` and ``tuple`` of ``tests/lightning/_capture_run.py`` run in the
shared 2-rank world; this process trains the same net on the batches the ranks saw.
Tolerance: the suite's float32 ``rtol=1e-5, atol=1e-6`` for sums in another order (the
pipeline sums the units' weighted losses).
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning import _capture_run as R

pytestmark = pytest.mark.slow

MODULE = "tests.lightning._capture_run"
CASES = ["labels", "mapping", "tuple"]
WORLD_CASES = {2: [f"{MODULE}:{case}" for case in CASES]}
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("case", CASES)
def test_inputs_and_labels_riding_in_one_batch_train_like_one_process(worlds, case):
    ranks = worlds.results(2, MODULE, case, weights_only=False)
    torch.set_num_threads(1)
    net = R.MaskedLM()
    opt = torch.optim.SGD(net.parameters(), lr=R.LABELS_LR)
    losses = []
    for batch in ranks[0]["batches"]:
        if case == "tuple":
            batch = dict(zip(("input_ids", "attention_mask", "labels"), batch, strict=True))
        opt.zero_grad()
        loss = R.token_loss(net(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert len(losses) == R.STEPS
    R.assert_like_one_process(ranks, losses, net, RTOL, ATOL)
