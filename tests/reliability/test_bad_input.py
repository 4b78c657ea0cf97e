"""Bad input fails at once, before profiling or training, with the numbers and the fix.

Each check is exercised where the strategy runs it: ``build_local_pipeline`` (what
``AutoPipeStrategy.setup`` calls, here as rank 0 of a pretend world with no process group), the
executor's step, or the check function the strategy calls before building the pipeline.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_autopipe.runtime.agree as agree_mod
import lightning_autopipe.runtime.profiler as profile_mod
from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ClusterError, InputError, MemoryPlanError, PlanError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.runtime.checks import check_microbatches
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from tests.reliability import _task as T

CPU = torch.device("cpu")


class Model(nn.Module):
    """The tiny GPT with the pipeline loss contract."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = T.TinyGPT(vocab=T.VOCAB, seq_len=T.SEQ, d_model=16, n_layers=n_layers,
                             n_heads=2)

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        return T.lm_loss(outputs, batch)


class NoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def _example(n: int = 8):
    return (torch.randint(0, T.VOCAB, (n, T.SEQ)),)


def _unexpected(*args, **kwargs):
    raise AssertionError("work was done before the input was checked")


def _build(module, *, world_size=2, **options):
    return build_local_pipeline(
        module,
        _example(),
        8,
        AutoPipeOptions(**options),
        rank=0,
        world_size=world_size,
        device=CPU,
        broadcast=lambda obj, src: obj,
    )


@pytest.fixture
def no_profiling(monkeypatch):
    monkeypatch.setattr(profile_mod, "profile_blocks", _unexpected)
    monkeypatch.setattr(agree_mod, "search_plan", _unexpected)


def _plan(cuts, m=2, k=1, batch=8, devices=None, **kw):
    stages = [
        StagePlan((cuts[i], cuts[i + 1]), [devices[i] if devices else f"local:{i}"])
        for i in range(len(cuts) - 1)
    ]
    return Plan("manual", batch, m, k, stages, **kw)


# ----------------------------------------------------------------------------------- tests
def test_batch_not_divisible_into_the_planned_microbatches(no_profiling):
    with pytest.raises(PlanError, match=r"10 samples .* not divisible into 4 micro-batches.*"
                                        r"num_microbatches in \[1, 2, 5, 10\]"):
        check_microbatches(10, 4, None)
    with pytest.raises(PlanError, match=r"micro-batch of 2 samples cannot be cut into 3"):
        check_microbatches(8, 4, 3)
    with pytest.raises(PlanError, match=r"8 samples per replica .* into 3 micro-batches"):
        _build(Model(), plan=_plan([0, 3, 7], m=3))  # a given plan; the loader batch is 8


def test_more_stages_than_blocks(no_profiling):
    with pytest.raises(PlanError, match=r"num_stages=16 but the model splits into only 7 blocks"):
        _build(Model(), world_size=16, num_stages=16)


def test_stages_not_dividing_the_world(no_profiling):
    """A rank refuses it as the launcher does (a launcher this package does not wrap)."""
    with pytest.raises(PlanError, match=r"num_stages=2 does not divide the 3 launched processes"
                                        r".* pick num_stages in \[1, 3\]"):
        _build(Model(), world_size=3, num_stages=2)


def test_cluster_with_fewer_devices_than_processes(no_profiling):
    with pytest.raises(ClusterError, match=r"describes 2 devices but 4 processes were launched"):
        _build(Model(), world_size=4, cluster=Cluster.local(2))
    with pytest.raises(ClusterError, match=r"describes 8 devices but 4 .* launch exactly 8"):
        _build(Model(), world_size=4, cluster=Cluster.local(8), exact_cluster=True)


def test_plan_made_for_another_model(no_profiling, monkeypatch):
    monkeypatch.undo()  # profile the other model for real, so its plan carries a fingerprint
    other = Model(n_layers=1)
    from lightning_autopipe.graph import split_model

    prof = profile_mod.profile_blocks(split_model(other, _example(4)), _example(4), repeats=1)
    plan = make_plan(prof, Cluster.local(2), 8, num_stages=2, replicas=1,
                     devices=["local:0", "local:1"], uniform_replicas=True, use_all_devices=True)
    assert plan.fingerprint
    with pytest.raises(PlanError, match=r"made for a model with fingerprint .* re-plan"):
        _build(Model(), plan=plan)


def test_plan_that_does_not_fit_device_memory(no_profiling, monkeypatch):
    tiny = Cluster.local(2, memory_gb=1e-5)
    big = _plan([0, 3, 7], peak_memory_bytes={"local:0": 2**30, "local:1": 1000})
    with pytest.raises(MemoryPlanError, match=r"needs 1.00 GiB on local:0 \(stage 0\) which has "
                                              r"0.00 GiB"):
        _build(Model(), plan=big, cluster=tiny)
    monkeypatch.undo()  # the planner itself: nothing fits 10 KiB devices
    from lightning_autopipe.graph import split_model

    prof = profile_mod.profile_blocks(split_model(Model(), _example(4)), _example(4), repeats=1)
    with pytest.raises(MemoryPlanError, match="no plan fits device memory"):
        search_plan(prof, tiny, ["local:0", "local:1"], 8)


def test_missing_pipeline_loss(no_profiling):
    with pytest.raises(TypeError, match=r"NoLoss has no pipeline_loss\(outputs, batch\)"):
        _build(NoLoss())


def test_inputs_and_targets_with_different_first_dimension():
    pipe = _build(Model(), world_size=1, plan=_plan([0, 7], devices=["local:0"]))
    x = torch.randint(0, T.VOCAB, (8, T.SEQ))
    good = pipe.executor.train_step((x, torch.randint(0, T.VOCAB, (8, T.SEQ))))
    assert torch.isfinite(good)
    with pytest.raises(InputError, match=r"batch\[1\] has shape \(6, 8\) .* inputs hold 8 samples"):
        pipe.executor.train_step((x, torch.randint(0, T.VOCAB, (6, T.SEQ))))


def test_the_batch_digest_tells_samples_and_their_order_apart_and_ignores_floating_inputs():
    """What each stage of a replica compares every step (:func:`batch_digest`): equal for the
    same batch (also when its floating inputs differ, as a random augmentation makes them on
    the first stage's rank), different for other labels or another order."""
    from lightning_autopipe.runtime.checks import batch_digest, check_same_batch
    from lightning_autopipe.runtime.groups import RankLayout

    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(0, 50_000, (8, 300), generator=g), torch.rand(8, 300) > 0.5
    labels = torch.randint(0, 10, (8,), generator=g)
    batch = {"ids": ids, "mask": mask, "x": torch.randn(8, 4), "y": labels}
    same = batch_digest({**batch, "x": torch.randn(8, 4)})
    assert same == batch_digest(batch)
    assert same.dtype == torch.float64
    assert 0 < float(same) < 2**31
    changed = {"labels": {**batch, "y": (labels + 1) % 10}, "order": {**batch, "y": labels.flip(0)},
               "one id": {**batch, "ids": ids.index_put(((torch.tensor(7), torch.tensor(299))),
                                                        torch.tensor(-1))},
               "mask": {**batch, "mask": ~mask}}
    for what, other in changed.items():
        assert batch_digest(other) != same, what
    assert float(batch_digest(None)) == 0.0 == float(batch_digest((torch.randn(2),)))
    from collections import UserDict  # a Hugging Face BatchEncoding is one

    assert batch_digest(UserDict(batch)) == same
    layout = RankLayout(rank=2, stage=0, replica=1, grid=((0, 2), (1, 3)))
    check_same_batch({2: same, 3: same.clone()}, layout)
    with pytest.raises(InputError, match=r"rank\(s\) \[2\] of replica 1 loaded another batch "
                       r"than its last stage \(rank 3\).*distributed_sampler_kwargs"):
        check_same_batch({2: batch_digest(changed["labels"]), 3: same}, layout)
