"""Building a rank's pipeline again for another plan over the same traced blocks.

One rank of a pretend 2-rank world without a process group (the executor, which needs the
groups, is recorded instead of built): the rebuilt stage must hold exactly the blocks of the new
plan, keep the tensors it already held, give the others their original shapes, and bind the
module's names (tied aliases included) to them; with the values a migration would bring, it
computes what the same blocks of an untouched copy compute.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_autopipe.runtime.build as build_mod
import lightning_autopipe.runtime.profiler as profile_mod
from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.graph import split_model
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.agree import PlanMessage
from lightning_autopipe.runtime.pipeline import build_local_pipeline, rebuild_pipeline

CPU = torch.device("cpu")
D = 8


class Tied(nn.Module):
    """Four linear layers; the head reuses the input layer's weight (a tie across stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.head = nn.Linear(D, D)
        self.head.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.l1(h))
        h = torch.relu(self.l2(h))
        return self.head(h)

    def pipeline_loss(self, outputs: torch.Tensor, batch) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


class _Recorded:
    """Stands in for the executor: what it was built with."""

    def __init__(self, stage, layout, groups, **kwargs) -> None:
        self.stage, self.layout, self.kwargs = stage, layout, kwargs


@pytest.fixture(autouse=True)
def _no_executor(monkeypatch):
    monkeypatch.setattr(build_mod, "PipelineExecutor", _Recorded)


def _plan(cut: int, blocks: int, first_device: str) -> Plan:
    other = "local:0" if first_device == "local:1" else "local:1"
    stages = [StagePlan((0, cut), [first_device]), StagePlan((cut, blocks), [other])]
    return Plan("given", 4, 2, 1, stages)


def _names(pipe) -> set[str]:
    return {pipe.stage.param_names.get(k, k) for k in pipe.stage.state_dict()}


def test_a_rebuild_moves_the_rank_to_another_stage_without_profiling(monkeypatch):
    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    x = torch.randn(4, D)
    n = len(split_model(copy.deepcopy(model), (x,)))
    assert n >= 3
    # rank 1 holds the last stage [1, n) first, then the first stage [0, n - 1)
    first = _plan(1, n, "local:0")
    sent = PlanMessage.planned(first, None, 0)  # what rank 0 would send
    pipe = build_local_pipeline(model, (x,), 4, AutoPipeOptions(plan=first), rank=1,
                                world_size=2, device=CPU, broadcast=lambda o, s: sent)
    assert pipe.layout.stage == 1
    before = dict(model.named_parameters(remove_duplicate=False))
    assert before["inp.weight"] is before["head.weight"]  # the head's stage holds both names
    assert "inp.bias" not in before  # released: another rank's stage

    def _unexpected(*args, **kwargs):
        raise AssertionError("a rebuild must not profile")

    monkeypatch.setattr(profile_mod, "profile_blocks", _unexpected)
    new = rebuild_pipeline(pipe, _plan(n - 1, n, "local:1"))
    assert (new.layout.stage, new.plan.stages[0].blocks) == (0, (0, n - 1))
    assert new.source is pipe.source
    assert isinstance(new.executor, _Recorded)
    assert new.executor.stage is new.stage

    # the module now holds exactly the new stage's tensors, under every original name
    stage_params = {id(p) for p in new.stage.parameters()}
    assert {id(p) for p in model.parameters()} == stage_params
    held = dict(model.named_parameters(remove_duplicate=False))
    assert held["inp.weight"] is held["head.weight"]  # the alias is bound again
    assert "inp.bias" in held  # refilled: a slot the first binding emptied
    assert "head.bias" not in held
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in held.items():
        assert p.shape == ref_params[name].shape, name
        assert not p.is_meta
    # what it held before and holds again is the same object, values kept
    for name, p in before.items():
        if id(p) in stage_params:
            assert held[name] is p
            torch.testing.assert_close(p, ref_params[name])
    # a migration brings the values of what it did not hold; then it computes as the original
    with torch.no_grad():
        for name, p in held.items():
            p.copy_(ref_params[name])
    ref_blocks = split_model(ref, (x,))
    want = ref_blocks.stage(0, n - 1)(x)
    got = new.stage(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)

    # and back: the tensors of the blocks it gives up are released
    held_before = list(new.stage.parameters())  # the stages share the module's slots
    back = rebuild_pipeline(new, _plan(1, n, "local:0"))
    assert back.layout.stage == 1
    assert {id(p) for p in model.parameters()} == {id(p) for p in back.stage.parameters()}
    released = [p for p in held_before if id(p) not in {id(q) for q in back.stage.parameters()}]
    assert released
    assert all(p.numel() == 0 for p in released)
    assert _names(back) == _names(pipe)


def test_only_a_pipeline_built_from_a_source_can_be_rebuilt():
    torch.manual_seed(0)
    model, x = Tied(), torch.randn(4, D)
    n = len(split_model(copy.deepcopy(model), (x,)))
    pipe = build_local_pipeline(model, (x,), 4, AutoPipeOptions(plan=_plan(1, n, "local:0")),
                                rank=0, world_size=2, device=CPU, broadcast=lambda o, s: o)
    pipe.source = None
    with pytest.raises(PipelineRuntimeError, match="no StageSource"):
        rebuild_pipeline(pipe, _plan(2, n, "local:0"))


class Chain(nn.Module):
    """Four untied linear layers of different widths: every block has its own byte count."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(2 * D, 3 * D)
        self.c, self.d = nn.Linear(3 * D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))

    def pipeline_loss(self, outputs: torch.Tensor, batch) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


def test_a_switch_costs_the_moved_bytes_at_the_link_rate_plus_the_measured_rebuild():
    """switch_cost against a brute-force count: what each rank newly holds (parameters with
    their optimizer state, at the ratio given) sent at the cluster's link, plus the running
    pipeline's measured build time; no step time enters it."""
    from lightning_autopipe.cluster import Cluster
    from lightning_autopipe.runtime.replan import switch_cost

    torch.manual_seed(0)
    model, x = Chain(), torch.randn(4, D)
    blocks = split_model(copy.deepcopy(model), (x,))
    n = len(blocks)
    first, second = _plan(1, n, "local:0"), _plan(n - 1, n, "local:0")
    sent = PlanMessage.planned(first, None, 0)
    pipe = build_local_pipeline(model, (x,), 4, AutoPipeOptions(plan=first), rank=1,
                                world_size=2, device=CPU, broadcast=lambda o, s: sent)
    assert pipe.build_ms > 0  # the build timed itself
    gbps, latency_us, ratio = 0.5, 200.0, 2.0
    pipe.cluster = Cluster.local(2, gbps=gbps, latency_us=latency_us)

    def held(plan: Plan, stage: int) -> dict[str, int]:
        part = blocks.stage(*plan.stages[stage].blocks)
        return {part.param_names.get(k, k): p.numel() * p.element_size()
                for k, p in part.named_parameters()}

    moved = 0  # rank r holds stage r in both plans; its new stage's names it lacked arrive
    pairs = 0
    for stage in (0, 1):
        old, new = held(first, stage), held(second, stage)
        got = sum(size for name, size in new.items() if name not in old)
        moved += int(got * (1 + ratio))
        pairs += got > 0
    assert moved > 0
    want_ms = pipe.build_ms + moved * 8 / (gbps * 1e9) * 1e3 + pairs * latency_us / 1e3
    ms, nbytes = switch_cost(pipe, second, optimizer_ratio=ratio)
    assert nbytes == pytest.approx(moved, abs=4)  # per-tensor rounding of the state bytes
    assert ms == pytest.approx(want_ms, rel=1e-6)
    ms, _ = switch_cost(pipe, second, optimizer_ratio=ratio, overhead_ms=7.0)
    assert ms == pytest.approx(want_ms - pipe.build_ms + 7.0, rel=1e-6)


class Positions(nn.Module):
    """A first layer that adds a non-persistent buffer (as position ids are held): it is in
    no state dict, so no migration brings it to a rank that newly holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.register_buffer("pos", torch.arange(D, dtype=torch.float32), persistent=False)
        self.b, self.c = nn.Linear(D, D), nn.Linear(D, D)

    def reset_parameters(self) -> None:  # what re-creates the buffer on the meta device
        with torch.no_grad():
            self.pos.copy_(torch.arange(D, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x) + self.pos))))

    def pipeline_loss(self, outputs: torch.Tensor, batch) -> torch.Tensor:
        return F.mse_loss(outputs, batch[1])


@pytest.mark.parametrize("construct", ["deferred_init", "meta_device"])
def test_a_rebuilt_meta_model_s_non_persistent_buffer_is_created_as_its_initialiser_does(
        construct):
    from lightning_autopipe.runtime import materialize as mat

    torch.manual_seed(0)
    if construct == "deferred_init":
        with mat.deferred_init():
            model = Positions()
    else:
        with torch.device("meta"):
            model = Positions()
    x = torch.randn(4, D)
    n = len(split_model(copy.deepcopy(model), (x,)))
    first = _plan(1, n, "local:0")  # rank 1 holds [1, n): not the buffer's block
    sent = PlanMessage.planned(first, None, 0)
    pipe = build_local_pipeline(model, (x,), 4, AutoPipeOptions(plan=first), rank=1,
                                world_size=2, device=CPU, broadcast=lambda o, s: sent)
    new = rebuild_pipeline(pipe, _plan(n - 1, n, "local:1"))  # now it holds [0, n - 1)
    got = {k: b for k, b in new.stage.named_buffers()}
    (pos,) = [b for k, b in got.items() if k.endswith("pos")]
    assert not pos.is_meta
    torch.testing.assert_close(pos, torch.arange(D, dtype=torch.float32))
