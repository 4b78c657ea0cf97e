"""build_local_pipeline profiles on every rank (contention) and with pipeline_loss on the batch.

Ranks of a pretend 2-rank world without a process group: rank 0's PlanMessage is handed
to rank 1 by hand, as the strategy's broadcast would; the executor (which needs the process
groups) is left out. Real launches are covered by tests/test_strategy.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lightning_autopipe.runtime.build as build_mod
import lightning_autopipe.runtime.profiler as profile_mod
from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.lightning.example import _batch_like
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.agree import PlanMessage
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from tests.runtime import _cases as C

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_executor(monkeypatch):
    monkeypatch.setattr(build_mod, "PipelineExecutor", lambda *args, **kwargs: None)


Model = C.PipelineNet


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return C.dataset("gpt", n, seed=3)


def _build(rank: int, broadcast, example_batch: Any = None, module: nn.Module | None = None):
    x, _ = _batch()
    return build_local_pipeline(
        module or Model(),
        (x,),
        8,
        AutoPipeOptions(num_stages=2, profile_repeats=1),  # search_plan(..., 8, num_stages=2)
        rank=rank,
        world_size=2,
        device=CPU,
        broadcast=broadcast,
        example_batch=example_batch,
    )


@pytest.fixture
def calls(monkeypatch) -> list[dict[str, Any]]:
    """Every profile_blocks call's keyword arguments (the real function still runs)."""
    real = profile_mod.profile_blocks
    seen: list[dict[str, Any]] = []

    def recording(blocks, example, **kw):
        seen.append(kw)
        return real(blocks, example, **kw)

    monkeypatch.setattr(profile_mod, "profile_blocks", recording)
    return seen


def _rank0_payload(example_batch: Any = None) -> tuple[Any, Any]:
    sent: list[Any] = []

    def broadcast(obj, src):
        sent.append(obj)
        return obj

    pipe = _build(0, broadcast, example_batch)
    return pipe, sent[0]


def test_every_rank_profiles_with_the_same_settings_and_rank0_plans(calls):
    pipe0, payload = _rank0_payload()
    assert isinstance(payload, PlanMessage)
    assert payload.ok
    assert payload.error_kind is None
    assert len(calls) == 1
    pipe1 = _build(1, lambda obj, src: payload)
    assert len(calls) == 2  # rank 1 profiled too (as load), with rank 0's settings
    assert calls[0] == calls[1]
    assert calls[1]["repeats"] == 1
    assert calls[1]["device"] == "cpu"
    assert pipe1.plan == pipe0.plan
    assert pipe1.profile == pipe0.profile  # rank 0's, not its own
    assert (pipe0.layout.stage, pipe1.layout.stage) == (0, 1)


def test_the_last_block_is_profiled_with_pipeline_loss_on_the_sliced_batch(monkeypatch):
    """The loss profile_blocks gets is pipeline_loss on the first n samples of the batch: the
    same value as the whole model's loss on those samples (n = 8, and 4 for the fixed part)."""
    x, y = _batch()
    ref = Model()
    want = {n: C.loss_fn(ref(x[:n]), (x[:n], y[:n])).item() for n in (8, 4)}
    got: dict[int, float] = {}
    real = profile_mod.profile_blocks

    def checking(blocks, example, loss_fn=None, **kw):
        def loss(outputs, n):
            value = loss_fn(outputs, n)
            got[n] = value.item()
            return value

        return real(blocks, example, loss_fn=loss if loss_fn else None, **kw)

    monkeypatch.setattr(profile_mod, "profile_blocks", checking)
    _build(0, lambda obj, src: obj, example_batch=(x, y))
    assert got.keys() == want.keys()
    for n in want:
        assert got[n] == pytest.approx(want[n], rel=1e-5), n


def test_without_a_batch_the_profile_has_no_loss(calls):
    _build(0, lambda obj, src: obj)
    assert calls[0].get("loss_fn") is None


def test_a_pipeline_loss_that_fails_while_profiling_falls_back_to_no_loss(calls):
    class LogsInLoss(Model):
        def pipeline_loss(self, outputs, batch):
            raise RuntimeError("self.log() is not allowed before the loop runs")

    with pytest.warns(UserWarning, match=r"pipeline_loss failed .* self.log\(\) is not allowed"):
        pipe = _build(0, lambda obj, src: obj, example_batch=_batch(), module=LogsInLoss())
    assert [c.get("loss_fn") is not None for c in calls] == [True, False]
    assert pipe.profile is not None


def test_a_failed_load_profile_on_another_rank_warns_and_keeps_rank0_plan(monkeypatch):
    pipe0, payload = _rank0_payload()

    def boom(*args, **kwargs):
        raise RuntimeError("device 1 out of memory")

    monkeypatch.setattr(profile_mod, "profile_blocks", boom)
    with pytest.warns(UserWarning, match=r"rank 1: profiling .* device 1 out of memory"):
        pipe1 = _build(1, lambda obj, src: payload)
    assert pipe1.plan == pipe0.plan


def test_rank0_failure_is_raised_on_every_rank_with_the_local_one_as_cause(monkeypatch):
    error = PlanMessage.failed(RuntimeError("rank 0 ran out of memory"))
    with pytest.raises(PipelineRuntimeError, match=r"rank 0 failed .* RuntimeError: rank 0 ran"):
        _build(1, lambda obj, src: error)

    def boom(*args, **kwargs):
        raise RuntimeError("rank 1 ran out of memory too")

    monkeypatch.setattr(profile_mod, "profile_blocks", boom)
    with pytest.raises(PipelineRuntimeError, match="rank 0 ran out of memory") as info:
        _build(1, lambda obj, src: error)
    assert "rank 1 ran out of memory too" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="rank 1 ran out of memory too"):  # rank 0 raises its own
        _build(0, lambda obj, src: obj)


def test_batch_like_cuts_the_batch_to_the_example_or_gives_none():
    module = Model()
    x, y = _batch()
    part = _batch_like(module, (x, y), (torch.zeros(2, C.SEQ, dtype=torch.long),))
    assert part is not None
    assert torch.equal(part[0], x[:2])
    assert torch.equal(part[1], y[:2])
    assert _batch_like(module, (x, y), (torch.zeros(2, C.SEQ + 1, dtype=torch.long),)) is None
    assert _batch_like(module, (x, y), (torch.zeros(9, C.SEQ, dtype=torch.long),)) is None
    assert _batch_like(module, None, (x,)) is None
