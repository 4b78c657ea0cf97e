"""One pricing core: the fast model and the simulator price the same generated schedules, and
the all-reduce fluid model ends on any link figures."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.allreduce import allreduce_finish
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.generators import SCHEDULES
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.pricing import allreduce_ms, unit_ms
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.step import StepShape
from lightning_autopipe.profile import BlockProfile, Profile


def _latency_only_cluster(per_server: int) -> Cluster:
    """Two servers whose links have latency but unlimited bandwidth: no transfer ever shares
    a link's bytes (the fast model's one simplification: it queues, the simulator shares).

    The servers' devices differ in speed, per-action overhead and all-reduce reduction rate,
    so every term of the unit price and of the ring shows up in both models.
    """
    dev = {"a": {"name": "A", "speed": 1.0, "memory_gb": 80, "overhead_ms": 0.05,
                 "reduce_gbps": 40},
           "b": {"name": "B", "speed": 0.6, "memory_gb": 80, "overhead_ms": 0.1,
                 "reduce_gbps": 25}}
    return Cluster.from_dict({
        "name": "latency-only", "network_gbps": math.inf, "network_latency_us": 30,
        "servers": [{"name": n, "gpus": per_server, "device": d,
                     "levels": [{"size": per_server, "gbps": math.inf, "latency_us": 30}]}
                    for n, d in dev.items()],
    })


def _tie(i: int, n: int) -> dict:
    if i == n - 1:
        return {"tied_to": 0, "tied_bytes": 10**5}
    if i in (4, 6) and i < n - 1:
        return {"tied_to": i - 2, "tied_bytes": 5 * 10**4}
    return {}


def _profile(rng: random.Random, n: int) -> Profile:
    blocks = []
    for i in range(n):
        f = rng.uniform(0.5, 3.0)
        b = f * rng.uniform(1.5, 2.5)
        blocks.append(BlockProfile(f"b{i}", f, b, rng.randint(10**5, 10**7), 10**5, 10**6,
                                   forward_fixed_ms=0.2 * f, backward_fixed_ms=0.1 * b,
                                   # the last block's loss saves 40% of its memory: freed at
                                   # B where the backward is split
                                   loss_bytes=4 * 10**5 if i == n - 1 else 0,
                                   # ... and shares 10^5 parameter bytes with block 0; blocks
                                   # 2, 4 and 6 use one module (each names the use before)
                                   **_tie(i, n)))
    return Profile("p", 4, "ref", blocks)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("replicas", [1, 2])
def test_fast_model_equals_the_simulator_for_every_generator(schedule: str, replicas: int):
    rng = random.Random(f"{schedule}-{replicas}")  # str seeds are not salted per process
    prof = _profile(rng, 8)
    costs = BlockCosts.from_profile(prof)
    for stages, m, k, j in itertools.product(range(1, 5), range(1, 7), (1, 2, 3), (1, 2)):
        if j > 1 and m < 2:
            continue
        per = (stages + 1) // 2 * replicas
        cluster = _latency_only_cluster(per)
        # stages alternate between the servers, each stage's replicas on one server (the fast
        # model prices a stage at its slowest replica and its slowest link, the simulator
        # every replica on its own: alike only when a stage's replicas are alike)
        groups = [[f"{'ab'[s % 2]}:{(s // 2) * replicas + r}" for r in range(replicas)]
                  for s in range(stages)]
        cuts = sorted(rng.sample(range(1, 8), stages - 1))
        cuts = [0, *cuts, 8]
        batch = 4 * m * replicas * 3  # micro-batches of 12 samples per replica
        plan = Plan("t", batch, m, k,
                    [StagePlan((cuts[s], cuts[s + 1]), groups[s]) for s in range(stages)],
                    schedule=schedule, drain_slices=j)
        sim = simulate(plan, prof, cluster)
        est = evaluate(costs, Layout.from_cluster(cluster, groups), cuts, plan.step_shape(),
                       exact=True)
        case = (schedule, stages, replicas, m, k, j)
        assert est.iteration_ms == pytest.approx(sim.iteration_ms, rel=1e-9), case
        assert est.stage_ms == pytest.approx(sim.stage_ms, rel=1e-9), case
        for s, st in enumerate(plan.stages):
            assert est.peak_bytes[s] == pytest.approx(sim.peak_memory_bytes[st.devices[0]],
                                                      abs=1.0), case


def test_unit_price_is_affine_over_the_speed_plus_the_overhead():
    # 10 ms at the profile's size of which 2 ms fixed, half the samples, speed 0.5, 1 ms overhead
    assert unit_ms(10.0, 2.0, 0.5, 0.5, 1.0) == pytest.approx((2.0 + 8.0 * 0.5) / 0.5 + 1.0)
    assert unit_ms(10.0, 0.0, 0.25, 1.0) == pytest.approx(2.5)


def test_allreduce_finish_ends_on_near_free_and_very_slow_links():
    """Residual bytes below the time resolution once made the fluid loop spin forever."""
    for gbps in (1e-1, 1.0, 1e3, 1e6, 1e7, 1e9):
        cluster = Cluster.local(8, gbps=gbps, latency_us=10)
        names = [d.name for d in cluster.devices]
        groups = [names[0:4], names[4:8]]
        layout = Layout.from_cluster(cluster, groups)
        ends = [8458.050272511997, 8458.05027251]
        out = allreduce_finish(layout, ends, [1.6e8, 4.2e7])
        for s, g in enumerate(groups):  # one ring per level resource: never slower than alone
            alone = allreduce_ms(cluster, g, [1.6e8, 4.2e7][s])
            assert out[s] >= ends[s] + alone * (1 - 1e-9)
            assert math.isfinite(out[s])


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_in_flight_memory_of_long_steps_equals_the_whole_replay(schedule: str):
    """Long steps are extrapolated from two shorter ones; the count must equal the full scan."""
    from lightning_autopipe.planner.compiled import inflight, inflight_of, lists
    from lightning_autopipe.planner.schedule import unit_sizes

    for stages, m, k, j in itertools.product((1, 2, 5), (30, 41, 97), (1, 3), (1, 2)):
        mb = 6
        fracs = [sz / mb for sz in unit_sizes(mb, m, k, j)]
        whole = inflight_of(lists(schedule, stages, m, k, j), fracs)
        assert inflight(schedule, stages, m, k, mb, j) == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_the_vector_replay_prices_every_candidate_as_the_scalar_one(schedule):
    """polish.evaluate_many is the fast model's replay on vectors: equal to it, to the bit."""
    from lightning_autopipe.planner.polish import evaluate_many, neighbours

    rng = random.Random(5)
    prof = _profile(rng, 24)
    cl = Cluster.from_dict({"name": "c", "network_gbps": 10, "servers": [
        {"name": "s", "count": 2, "gpus": 4, "device": {"name": "d", "speed": 1.0,
                                                        "memory_gb": 1, "reduce_gbps": 20},
         "levels": [{"size": 4, "gbps": 50, "latency_us": 20}]}]})
    costs = BlockCosts.from_profile(prof, cl)
    devs = [d.name for d in cl.devices]
    for stages, replicas, m, k, j in ((4, 2, 3, 2, 2), (8, 1, 30, 1, 3), (2, 4, 5, 3, 1)):
        layout = Layout.from_cluster(cl, [devs[s * replicas:(s + 1) * replicas]
                                          for s in range(stages)])
        cuts = [0, *sorted(rng.sample(range(1, 24), stages - 1)), 24]
        cands = [cuts, *neighbours(cuts)]
        batch = replicas * m * 6
        step = StepShape(batch, m, k, drain_slices=j, schedule=schedule)
        many = evaluate_many(costs, layout, cands, step)
        fresh = BlockCosts.from_profile(prof, cl)  # nothing kept from the batch (memo.py)
        for c, (ms, fits) in zip(cands, many):
            one = evaluate(fresh, layout, c, step, critical_path=False)
            assert ms == one.iteration_ms
            assert fits == one.fits


def test_a_stage_whose_blocks_share_weights_runs_its_whole_backward_in_b():
    """Blocks 2, 4 and 6 use one module: a split backward cannot resume W on a stage holding
    two of them (runtime/backward.py, ``weights_reached_twice``), so its B is the whole
    backward and frees everything; a stage holding one of them keeps the split."""
    prof = _profile(random.Random(0), 8)
    costs = BlockCosts.from_profile(prof)
    b = prof.blocks
    whole = sum(x.backward_ms for x in b[2:5])
    assert costs.split(2, 5) == pytest.approx(
        (whole, 0.0, sum(x.backward_fixed_ms for x in b[2:5]), 0.0))
    assert costs.loss_share(2, 5) == costs.memory(2, 5, 1)[0]
    assert costs.split(3, 6)[1] == pytest.approx(sum(x.split_backward()[1] for x in b[3:6]))
    assert costs.loss_share(3, 6) == 0
    plan = Plan("t", 48, 4, 1, [StagePlan((0, 2), ["a:0"]), StagePlan((2, 5), ["b:0"]),
                                StagePlan((5, 8), ["a:1"])], schedule="zb-h1")
    sim = simulate(plan, prof, _latency_only_cluster(2))
    weights = [e for e in sim.events if e.kind == "W" and e.stage == 1]
    assert weights  # each only the runtime's cost of an action (device b's overhead_ms)
    assert all(e.end_ms - e.start_ms == pytest.approx(0.1) for e in weights)
