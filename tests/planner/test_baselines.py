"""Yardstick planners against brute force of their own objectives, and every planner's plan
checked against the simulator."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.planner import PLANNERS, make_plan
from lightning_autopipe.planner.baselines import parameter_cuts, time_cuts, uniform_cuts
from lightning_autopipe.planner.baselines.dapple import _latency
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile
from tests.planner.clusters import two_speeds

HETERO3 = two_speeds("hetero-3", slow_gpus=1)


def _profile(seed: int, n: int, mbs: int = 4) -> Profile:
    rng = random.Random(seed)
    blocks = []
    for i in range(n):
        f = rng.uniform(0.5, 4)
        blocks.append(BlockProfile(f"b{i}", f, 2 * f, rng.randint(10**5, 10**8),
                                   rng.randint(10**4, 10**6), rng.randint(10**5, 10**7)))
    return Profile("p", mbs, "test", blocks)


def _splits(n: int, s: int):
    for inner in itertools.combinations(range(1, n), s - 1):
        yield [0, *inner, n]


def test_uniform_parameter_and_time_cuts_match_their_definitions():
    assert uniform_cuts(10, 4) == [0, 3, 6, 8, 10]
    prof = _profile(1, 9)
    costs = BlockCosts.from_profile(prof)
    for s in (2, 3, 4):
        for cuts_fn, prefix in ((parameter_cuts, costs.params), (time_cuts, costs.compute)):
            got = cuts_fn(costs, s)

            def load(c, pre=prefix, ns=s):
                return max(pre[c[i + 1]] - pre[c[i]] for i in range(ns))

            assert load(got) == pytest.approx(min(load(c) for c in _splits(9, s)))


def test_piper_dp_equals_brute_force_of_its_objective():
    """Piper's bottleneck load over every split and every data-parallel degree assignment."""
    prof = _profile(2, 6)
    costs = BlockCosts.from_profile(prof)
    cl = Cluster.local(4, gbps=10, latency_us=0)
    batch, m = 32, 4
    per_byte = 1 / (10 * BYTES_PER_MS_PER_GBPS)

    def load(i, j, d):
        comp = (costs.compute[j] - costs.compute[i]) * batch / (4 * d)
        grads = costs.params[j] - costs.params[i]
        ar = 2 * (d - 1) / d * grads * per_byte
        io = (costs.act[i - 1] if i > 0 else 0) + (costs.act[j - 1] if j < 6 else 0)
        return comp + ar + io * 2 * batch / (4 * d) * per_byte

    best = min(
        max(load(c[i], c[i + 1], ds[i]) for i in range(s))
        for s in range(1, 5) for c in _splits(6, s)
        for ds in itertools.product([1, 2, 4], repeat=s) if sum(ds) <= 4
    )
    plan = make_plan(prof, cl, batch, planner="piper", num_microbatches=m, memory_check=False)
    got = max(load(*st.blocks, st.replicas) for st in plan.stages)
    assert got == pytest.approx(best, rel=1e-9)


def test_dapple_latency_reduces_to_1f1b_closed_form_without_communication():
    rng = random.Random(3)
    for _ in range(20):
        n, m = rng.randint(1, 6), rng.randint(1, 12)
        st = [(f, 2 * f, 0.0, 0.0) for f in (rng.uniform(1, 5) for _ in range(n))]
        heavy = max(f + b for f, b, _, _ in st)
        closed = sum(f + b for f, b, _, _ in st) + (m - 1) * heavy
        assert _latency(st, m) == pytest.approx(closed)
    # an early stage whose steady phase outlasts the last stage's becomes the pivot, and its
    # all-reduce (after the backward drains to it) can end the step
    st = [(1.0, 2.0, 50.0, 0.0), (4.0, 8.0, 0.0, 0.5), (1.0, 2.0, 0.0, 0.0)]
    m = 4
    expected = 1.0 + 4 * 12.0 + 3.0 + 2 * 0.5 + max(0.0, 2.0 + 0.0 + 50.0)
    assert _latency(st, m) == pytest.approx(expected)


def test_optimal_equals_brute_force_simulation():
    prof = _profile(4, 6)
    batch, m = 16, 4
    devs = [d.name for d in HETERO3.devices]
    best = float("inf")
    for s in (2, 3):
        for cuts in _splits(6, s):
            for order in itertools.permutations(devs, s):
                for k, j, sch in itertools.product((1, 2, 3, 4), (1, 2, 3, 4),
                                                   ("1f1b", "zb-h1")):
                    plan = Plan("bf", batch, m, k, [StagePlan((cuts[i], cuts[i + 1]), [order[i]])
                                                    for i in range(s)], drain_slices=j,
                                schedule=sch)
                    best = min(best, simulate(plan, prof, HETERO3).iteration_ms)
    got = min(
        make_plan(prof, HETERO3, batch, planner="optimal", num_stages=s, replicas=1,
                  num_microbatches=m, memory_check=False).iteration_ms
        for s in (2, 3)
    )
    assert got == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("planner", PLANNERS)
def test_every_planner_returns_a_plan_the_simulator_confirms(planner):
    prof = _profile(5, 8)
    cl = Cluster.from_dict({
        "name": "c", "network_gbps": 25,
        "servers": [{"name": "s", "count": 2, "gpus": 2,
                     "device": {"name": "d", "speed": 1.0, "memory_gb": 16},
                     "levels": [{"size": 2, "gbps": 100}]}],
    })
    pins = {"num_stages": 2, "replicas": 2} if planner == "optimal" else {}
    plan = make_plan(prof, cl, 32, planner=planner, memory_check=False, **pins)
    assert plan.planner == planner
    assert plan.cuts[0] == 0
    assert plan.cuts[-1] == 8
    assert all(a < b for a, b in zip(plan.cuts, plan.cuts[1:]))
    assert len(set(plan.devices)) == len(plan.devices)
    res = simulate(plan, prof, cl)
    assert plan.iteration_ms == pytest.approx(res.iteration_ms)
    assert [st.stage_ms for st in plan.stages] == pytest.approx(res.stage_ms)
    mean = sum(res.stage_ms) / len(res.stage_ms)
    assert plan.balance == pytest.approx(max(res.stage_ms) / mean)
    assert plan.search_ms >= 0
