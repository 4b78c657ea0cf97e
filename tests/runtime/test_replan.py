"""The re-plan mechanism's pure parts, in one process (the switch itself runs through the Trainer
in tests/lightning/test_replan.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.data_layout import keep_replicas, same_data_layout
from lightning_autopipe.runtime.optim_state import state_bytes_per_param_byte
from lightning_autopipe.runtime.replan import SwitchMessage, agree_switch, optimizer_state_ratio

NAMES = [f"local:{r}" for r in range(4)]


def _plan(*stages: tuple[tuple[int, int], list[str]]) -> Plan:
    return Plan("autopipe", 8, 4, 1, [StagePlan(b, d) for b, d in stages])


def test_a_plan_keeping_every_rank_s_replica_keeps_the_data_layout():
    a = _plan(((0, 3), NAMES[:2]), ((3, 6), NAMES[2:]))
    moved_cut = _plan(((0, 2), NAMES[:2]), ((2, 6), NAMES[2:]))
    swapped_stages = _plan(((0, 3), NAMES[2:]), ((3, 6), NAMES[:2]))
    assert same_data_layout(a, moved_cut, NAMES)
    assert same_data_layout(a, swapped_stages, NAMES)  # ranks swap stages, not replicas


def test_a_plan_giving_a_rank_another_replica_or_width_changes_the_data_layout():
    a = _plan(((0, 3), NAMES[:2]), ((3, 6), NAMES[2:]))
    other_replica = _plan(((0, 3), [NAMES[1], NAMES[0]]), ((3, 6), NAMES[2:]))
    wider = _plan(((0, 6), NAMES))
    assert not same_data_layout(a, other_replica, NAMES)
    assert not same_data_layout(a, wider, NAMES)


def test_a_plan_numbering_the_same_replicas_otherwise_is_renumbered_to_the_running_ones():
    running = Plan("autopipe", 8, 1, 1, [StagePlan((0, 3), NAMES[:2]),
                                         StagePlan((3, 6), NAMES[2:])], replica_batches=[5, 3])
    swapped = Plan("autopipe", 8, 1, 1, [StagePlan((0, 2), [NAMES[1], NAMES[0]]),
                                         StagePlan((2, 6), [NAMES[3], NAMES[2]])],
                   replica_batches=[6, 2])
    assert not same_data_layout(running, swapped, NAMES)
    kept = keep_replicas(swapped, running, NAMES)
    assert same_data_layout(running, kept, NAMES)
    assert [s.devices for s in kept.stages] == [NAMES[:2], NAMES[2:]]
    assert kept.replica_batches == [2, 6]  # each replica's batch moved with its devices
    assert kept.cuts == swapped.cuts
    # ranks regrouped (rank 0 with rank 3): no renumbering keeps every rank's replica
    regrouped = Plan("autopipe", 8, 1, 1, [StagePlan((0, 3), NAMES[:2]),
                                           StagePlan((3, 6), [NAMES[3], NAMES[2]])])
    assert keep_replicas(regrouped, running, NAMES) is regrouped
    assert not same_data_layout(running, regrouped, NAMES)


def test_optimizer_state_ratio_counts_the_state_per_parameter_byte():
    net = nn.Linear(8, 8)
    adam = torch.optim.Adam(net.parameters())
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    assert optimizer_state_ratio([adam], list(net.parameters())) == 0.0  # no step yet
    net(torch.randn(2, 8)).sum().backward()
    adam.step()
    sgd.step()
    ratio = optimizer_state_ratio([adam], list(net.parameters()))
    params = sum(p.numel() for p in net.parameters())
    assert ratio == pytest.approx(2.0 + 2 / params)  # two moments and a scalar step each
    assert optimizer_state_ratio([sgd], list(net.parameters())) == 0.0


def _per_element_state(optimizers, params) -> float:
    """Reference: after a real step on the real parameters, the per-element state bytes (a
    scalar step counter left out) per parameter byte."""
    want = {id(p): p for p in params}
    kept = sum(v.numel() * v.element_size() for opt in optimizers
               for p, st in opt.state.items() if id(p) in want
               for v in st.values() if isinstance(v, torch.Tensor) and v.shape == p.shape)
    return kept / sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("make", [
    lambda ps: [torch.optim.Adam(ps)],
    lambda ps: [torch.optim.AdamW(ps, weight_decay=0.1)],
    lambda ps: [torch.optim.SGD(ps, lr=0.1)],
    lambda ps: [torch.optim.SGD(ps, lr=0.1, momentum=0.9)],
    lambda ps: [torch.optim.RMSprop(ps, momentum=0.5)],
    lambda ps: [torch.optim.Adagrad(ps)],
    # groups with and without momentum, and two optimizers: weighted by their parameter bytes
    lambda ps: [torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:]}],
                                lr=0.1)],
    lambda ps: [torch.optim.Adam(ps[:1]), torch.optim.SGD(ps[1:], lr=0.1)],
], ids=["adam", "adamw", "sgd", "sgd-momentum", "rmsprop-momentum", "adagrad", "groups",
        "two-optimizers"])
def test_the_optimizer_state_measured_before_a_step_is_what_a_real_step_keeps(make):
    net = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    params = list(net.parameters())
    measured = make(params)
    before = state_bytes_per_param_byte(measured)  # nothing stepped: measured on a probe
    optimizers = make(params)
    net(torch.randn(4, 16)).sum().backward()
    for opt in optimizers:
        opt.step()
    assert before == pytest.approx(_per_element_state(optimizers, params))
    # the probe leaves the measured optimizers alone: state of the model's parameters only
    mine = {id(p) for p in params}
    assert all({id(p) for p in opt.state} <= mine for opt in measured)


def test_an_optimizer_that_cannot_be_made_from_its_groups_is_not_measured():
    class Needs(torch.optim.SGD):
        def __init__(self, params, extra):
            super().__init__(params, lr=0.1)

    assert state_bytes_per_param_byte([Needs(nn.Linear(2, 2).parameters(), 1)]) is None
    assert state_bytes_per_param_byte([]) == 0.0


def test_every_rank_gets_rank0_s_verdict_and_a_stale_one_is_refused():
    verdict = SwitchMessage(step=4, switch=False, reason="the running plan is best")
    assert agree_switch(verdict, rank=0, step=4, broadcast=lambda obj, src: obj) is verdict
    assert agree_switch(None, rank=1, step=4, broadcast=lambda obj, src: verdict) is verdict
    with pytest.raises(PipelineRuntimeError, match="for step 6 but received"):
        agree_switch(None, rank=1, step=6, broadcast=lambda obj, src: verdict)


def test_the_stage_cache_keeps_only_the_ranges_it_is_told_to():
    """A check prices candidate plans by reading their stages; the graph then forgets every
    stage but the running plan's, and a forgotten range is built again, computing alike."""
    from lightning_autopipe.graph import split_model

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    blocks = split_model(net, (torch.zeros(2, 4),))
    x = torch.randn(3, 4)
    running = [blocks.stage(0, 2), blocks.stage(2, len(blocks))]
    candidate = blocks.stage(0, 3)
    before = candidate(x)
    blocks.keep_stages([(0, 2), (2, len(blocks))])
    assert blocks.stage(0, 2) is running[0]
    assert blocks.stage(2, len(blocks)) is running[1]
    rebuilt = blocks.stage(0, 3)
    assert rebuilt is not candidate
    torch.testing.assert_close(rebuilt(x), before)
    assert sorted(blocks._stages) == [(0, 2), (0, 3), (2, len(blocks))]
