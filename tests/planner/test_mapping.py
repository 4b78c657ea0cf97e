"""Device mapping: heavier stages on faster devices, better than every DAPPLE placement policy,
and the placement policies themselves behave as DAPPLE describes them."""

from __future__ import annotations

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.analytic import analytic_profile
from lightning_autopipe.planner.baselines import dapple_placement
from lightning_autopipe.planner.baselines.dapple import POLICIES as DAPPLE_POLICIES
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.mapping import candidate_groupings, rank_layouts, speed_order
from lightning_autopipe.planner.partition import partition_and_slice
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.search import finish_plan
from lightning_autopipe.planner.step import StepShape

MIXED = Cluster.load("conf/cluster/mixed_rack.yaml")  # 8 x speed 1.0, 16 x speed 0.45
TWO_BY_FOUR = Cluster.from_dict({
    "name": "2x4", "network_gbps": 25,
    "servers": [{"name": "m", "count": 2, "gpus": 4,
                 "device": {"name": "d", "speed": 1.0, "memory_gb": 32},
                 "levels": [{"size": 4, "gbps": 200}]}],
})
SLOW_FIRST = Cluster.from_dict({  # mixed_rack with the slow servers first in rank order
    "name": "slow-first", "network_gbps": 25,
    "servers": [
        {"name": "pcie", "count": 2, "gpus": 8,
         "device": {"name": "V100", "speed": 0.45, "memory_gb": 32},
         "levels": [{"size": 2, "gbps": 100}, {"size": 4, "gbps": 64}, {"size": 8, "gbps": 32}]},
        {"name": "nv", "gpus": 8, "device": {"name": "A100", "speed": 1.0, "memory_gb": 40},
         "levels": [{"size": 8, "gbps": 2400}]},
    ],
})
SMALL_HETERO = Cluster.from_dict({
    "name": "small-hetero", "network_gbps": 25,
    "servers": [
        {"name": "fast", "gpus": 4, "device": {"name": "A", "speed": 1.0, "memory_gb": 40},
         "levels": [{"size": 4, "gbps": 600}]},
        {"name": "slow", "count": 2, "gpus": 4,
         "device": {"name": "B", "speed": 0.4, "memory_gb": 32},
         "levels": [{"size": 2, "gbps": 100}, {"size": 4, "gbps": 32}]},
    ],
})


def _gpt(layers=12, mbs=1):
    return analytic_profile("gpt", layers=layers, hidden=1024, heads=16, seq_len=512,
                            vocab=32000, micro_batch_size=mbs)


def test_speed_order_puts_fast_servers_first():
    order = speed_order(MIXED)
    assert [MIXED.device(d).spec.speed for d in order[:8]] == [1.0] * 8
    assert sorted(order) == sorted(d.name for d in MIXED.devices)


def test_heavier_stages_land_on_faster_devices():
    prof = _gpt()
    plan = make_plan(prof, MIXED, 192, num_stages=6, replicas=4, num_microbatches=8)
    work = {}
    for st in plan.stages:
        speed = min(MIXED.device(d).spec.speed for d in st.devices)
        ms = sum(b.compute_ms for b in prof.blocks[st.blocks[0]: st.blocks[1]])
        work.setdefault(speed, []).append(ms)
    assert set(work) == {1.0, 0.45}
    assert min(work[1.0]) > max(work[0.45])  # every fast stage carries more than any slow one


@pytest.mark.parametrize(("cluster", "stages", "replicas", "strict"), [
    (SLOW_FIRST, 4, 4, True),  # 16 of 24 devices: DAPPLE takes them in rank order
    (SMALL_HETERO, 4, 3, True),  # 3 replicas on 4-GPU servers: groups straddle servers
    (MIXED, 6, 4, False),  # append-first = our grouped layout here: ties are allowed
])
def test_mapping_beats_every_dapple_placement_policy(cluster, stages, replicas, strict):
    """Same shape, each placement given its own best AutoPipe partition and slice count."""
    prof = _gpt()
    costs = BlockCosts.from_profile(prof)
    batch, m = 24 * replicas, 8
    devs = [d.name for d in cluster.devices]
    ours = make_plan(prof, cluster, batch, num_stages=stages, replicas=replicas,
                     num_microbatches=m, memory_check=False)
    for policy in DAPPLE_POLICIES:
        groups = dapple_placement(cluster, devs, [replicas] * stages, policy)
        layout = Layout.from_cluster(cluster, groups)
        theirs = min(
            finish_plan(Proposal(groups, cuts, m, k), "dapple-" + policy, prof, cluster,
                        batch).iteration_ms
            for cuts, k, _ in partition_and_slice(costs, layout, StepShape(batch, m))[:3]
        )
        if strict:
            assert ours.iteration_ms < theirs * 0.99, (policy, ours.iteration_ms, theirs)
        else:
            assert ours.iteration_ms <= theirs * (1 + 1e-9), (policy, ours.iteration_ms, theirs)


def test_dapple_policies_follow_their_definitions():
    devs = [d.name for d in TWO_BY_FOUR.devices]  # m0:0..3, m1:0..3
    fresh = dapple_placement(TWO_BY_FOUR, devs, [2, 2, 2], "fresh")
    assert fresh[0] == ["m0:0", "m0:1"]
    assert fresh[1] == ["m1:0", "m1:1"]  # a machine nothing is placed on yet
    assert fresh[2] == ["m0:2", "m0:3"]  # none fresh left: the one with most free devices
    append = dapple_placement(TWO_BY_FOUR, devs, [2, 2, 2], "append")
    assert append[:2] == [["m0:0", "m0:1"], ["m0:2", "m0:3"]]  # fill the machine in use
    assert append[2] == ["m1:0", "m1:1"]
    scatter = dapple_placement(TWO_BY_FOUR, devs, [2, 4], "scatter")
    assert scatter[0] == ["m0:0", "m1:0"]  # evenly over machines
    assert scatter[1] == ["m0:1", "m1:1", "m0:2", "m1:2"]


def test_mapper_dedupes_interchangeable_layouts_and_keeps_distinct_ones():
    costs = BlockCosts.from_profile(_gpt(layers=4))
    local = Cluster.local(4)
    assert len(rank_layouts(costs, local, [d.name for d in local.devices], 4, 1,
                            StepShape(32, 8))) == 1
    devs = [d.name for d in SMALL_HETERO.devices]
    cands = candidate_groupings(SMALL_HETERO, devs, 4, 3)
    assert {"grouped", "grouped-reversed", "pipelined"} <= set(cands)
    for groups in cands.values():
        assert sorted(d for g in groups for d in g) == sorted(speed_order(SMALL_HETERO)[:12])
    ranked = rank_layouts(costs, SMALL_HETERO, devs, 4, 3, StepShape(96, 8))
    times = [r.estimate.iteration_ms for r in ranked]
    assert times == sorted(times)
    assert len({r.layout.signature() for r in ranked}) == len(ranked)


def test_a_faster_server_behind_slow_links_loses_to_a_slower_one_with_fast_links():
    """Two replicas of one stage: the faster devices (speed 1.0) share a 1 Gb/s level, the
    slower ones (0.9) a 1000 Gb/s one; the all-reduce of big gradients decides. AutoPipe
    places the replicas on the fast links, at least as well as any yardstick's placement."""
    from lightning_autopipe.profile import BlockProfile, Profile

    prof = Profile("m", 1, "t", [BlockProfile(f"b{i}", 1.0, 2.0, 10**8, 10**4, 10**6)
                                 for i in range(2)])
    cluster = Cluster.from_dict({"name": "c", "network_gbps": 10, "servers": [
        {"name": "p", "gpus": 2, "device": {"name": "P", "speed": 0.9, "memory_gb": 16},
         "levels": [{"size": 2, "gbps": 1000}]},
        {"name": "q", "gpus": 2, "device": {"name": "Q", "speed": 1.0, "memory_gb": 16},
         "levels": [{"size": 2, "gbps": 1}]}]})
    pins = dict(num_stages=1, replicas=2, num_microbatches=1)
    plan = make_plan(prof, cluster, 4, **pins)
    assert sorted(plan.devices) == ["p:0", "p:1"]
    for planner in ("time", "parameters", "uniform", "dapple", "piper"):
        other = make_plan(prof, cluster, 4, planner=planner, **pins)
        assert plan.iteration_ms <= other.iteration_ms * (1 + 1e-9), planner
