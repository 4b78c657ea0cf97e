"""A non-finite loss names its stage's blocks as the plan table writes them: half-open."""

from __future__ import annotations

import torch

from lightning_autopipe.graph import split_model
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from tests.reliability import _task as T


def test_the_stage_is_named_with_its_half_open_block_range():
    model = T.NetWithLoss()
    x = torch.randint(0, T.VOCAB, (4, T.SEQ))
    n = len(split_model(model, (x,)))
    plan = Plan("manual", 4, 2, 1, [StagePlan((0, n), ["local:0"])])
    pipe = build_local_pipeline(model, (x,), 4, AutoPipeOptions(plan=plan), rank=0,
                                world_size=1, device=torch.device("cpu"),
                                broadcast=lambda obj, src: obj)
    with torch.no_grad():
        next(pipe.stage.parameters()).fill_(float("nan"))
    loss = pipe.executor.train_step((x, torch.randint(0, T.VOCAB, (4, T.SEQ))))
    assert not torch.isfinite(loss)
    where = pipe.nonfinite_origin()
    assert f"(blocks [0, {n}), ranks [0])" in where, where
