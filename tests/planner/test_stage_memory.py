"""Every fast model counts a stage's memory as the simulator does (``pricing.stage_memory``).

Profiles whose blocks share saved inputs with the block before (``shared_input_bytes``, a
ReLU's output that the next convolution saves too) hold less than the sum of their blocks'
``memory_bytes``, and the first stage holds its saved inputs (slices of the replica's batch)
once. On seeded random profiles with such blocks, under every generator, with startup and
drain slices and with recomputation, each stage's peak equals the simulator's:

* the fast model's ``Estimate.peak_bytes`` (``costmodel``);
* the partitioner's memory limits (``balance.StageLimits``, as ``partition.stage_limits``
  builds them);
* DAPPLE's memory check fits exactly at the simulator's peak and not a byte below it.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.baselines.dapple import _fits
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.partition import stage_limits
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.pricing import stage_memory
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.step import StepShape
from lightning_autopipe.profile import BlockProfile, Profile


def _profile(rng: random.Random, n: int) -> Profile:
    blocks, prev = [], 0
    for i in range(n):
        f = rng.lognormvariate(0, 1)
        mem = rng.randint(10**4, 10**8)
        shared = min(mem, prev) * rng.choice([0, 0, 1]) // rng.choice([1, 2, 3]) if i else (
            rng.choice([0, mem // 4]))
        blocks.append(BlockProfile(f"b{i}", f, f * rng.uniform(1.5, 2.5),
                                   rng.randint(10**4, 10**8), rng.randint(10**3, 10**7), mem,
                                   shared_input_bytes=shared,
                                   loss_bytes=mem // 2 if i == n - 1 else 0,  # freed at B
                                   # a head sharing parameters with the first block
                                   tied_to=0 if i == n - 1 else -1,
                                   tied_bytes=10**4 if i == n - 1 else 0))
        prev = mem
    return Profile("shared", rng.choice([1, 2]), "test", blocks)


def _cluster(replicas: int, stages: int) -> Cluster:
    return Cluster.from_dict({"name": "one", "servers": [{
        "name": "s", "gpus": replicas * stages, "nic_gbps": 100,
        "device": {"name": "d", "speed": 1.0, "memory_gb": 80},
        "levels": [{"size": replicas * stages, "gbps": 600}]}]})


def test_stage_memory_counts_a_shared_storage_once_and_the_batch_once():
    mem = [0, 10, 30, 60]  # blocks of 10, 20, 30 bytes
    shared = [0, 4, 9, 19]  # they share 4, 5, 10 bytes with the block before (the 4: the batch)
    assert stage_memory(mem, shared, 0, 3, 8) == (60 - 4 - 5 - 10, 4 * 8)
    assert stage_memory(mem, shared, 1, 3, 8) == (50 - 10, 0)  # its first block's inputs held
    assert stage_memory(mem, shared, 2, 3, 8) == (30, 0)
    assert stage_memory(mem, [], 0, 3, 8) == (60, 0)


@pytest.mark.parametrize("seed", range(6))
def test_fast_models_count_each_stage_as_the_simulator_does(seed):
    rng = random.Random(5100 + seed)
    profile = _profile(rng, rng.randint(6, 30))
    costs = BlockCosts.from_profile(profile)
    n = costs.num_blocks
    for _ in range(4):
        stages = rng.randint(1, min(5, n))
        replicas = rng.choice([1, 2])
        cluster = _cluster(replicas, stages)
        names = [d.name for d in cluster.devices]
        groups = [names[s * replicas:(s + 1) * replicas] for s in range(stages)]
        layout = Layout.from_cluster(cluster, groups)
        m = rng.randint(1, 2 * stages + 6)  # the in-flight counts are exact up to here
        k, j = rng.choice([(1, 1), (2, 1), (1, 2), (2, 2)])
        size = 4
        batch = m * replicas * size
        cuts = [0, *sorted(rng.sample(range(1, n), stages - 1)), n]
        for schedule in ("1f1b", "zb-h1", "gpipe"):
            recompute = ([rng.random() < 0.5 for _ in range(stages)]
                         if schedule != "zb-h1" else [])
            plan = Plan("autopipe", batch, m, k,
                        [StagePlan((cuts[s], cuts[s + 1]), g) for s, g in enumerate(groups)],
                        drain_slices=j if m > 1 else 1, schedule=schedule,
                        recompute=recompute if any(recompute) else [])
            sim = simulate(plan, profile, cluster)
            est = evaluate(costs, layout, cuts, plan.step_shape(), recompute=recompute,
                           critical_path=False)
            for s, g in enumerate(groups):
                assert math.isclose(est.peak_bytes[s], sim.peak_memory_bytes[g[0]],
                                    rel_tol=1e-12, abs_tol=1.0), (schedule, s)
            if any(recompute) or (k, plan.drain_slices) != (1, 1):
                continue  # the limits are the partitioner's, for its own shape (no slices)
            limits = stage_limits(costs, layout, plan.step_shape())
            for s, g in enumerate(groups):
                assert math.isclose(limits.need(s, cuts[s], cuts[s + 1]),
                                    sim.peak_memory_bytes[g[0]], rel_tol=1e-12, abs_tol=1.0)
            if schedule == "1f1b":  # DAPPLE plans 1F1B: fits at the peak, not a byte less
                st = [(cuts[s], cuts[s + 1], g) for s, g in enumerate(groups)]
                peak = {d: sim.peak_memory_bytes[d] for d in names}
                assert _fits(costs, st, batch, m, profile.micro_batch_size, 2.0,
                             {d: v + 1 for d, v in peak.items()})
                low = max(peak, key=peak.get)
                assert not _fits(costs, st, batch, m, profile.micro_batch_size, 2.0,
                                 {**peak, low: peak[low] - 2})


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_partitioners_fast_check_is_its_memory_formula(schedule):
    """``StageLimits.ok`` (tables made once) agrees with ``need <= capacity`` (the formula) on
    every block range, and its reach is the last end that fits (under ZB-H1 the last block's
    loss bytes count fewer units than its other bytes)."""
    rng = random.Random(61)
    profile = _profile(rng, 25)
    costs = BlockCosts.from_profile(profile)
    cluster = _cluster(1, 3)
    layout = Layout.from_cluster(cluster, [[d.name] for d in cluster.devices])
    limits = stage_limits(costs, layout, StepShape(48, 6, schedule=schedule))
    n = costs.num_blocks
    needs = sorted(limits.need(s, i, j) for s in range(3) for i in range(n)
                   for j in range(i + 1, n + 1))
    for cap in (needs[len(needs) // 4], needs[len(needs) // 2]):
        lim = replace(limits, capacity=[cap] * 3, _kept={})
        for s in range(3):
            for i in range(n):
                fit = [j for j in range(i + 1, n + 1) if lim.need(s, i, j) <= cap]
                assert [j for j in range(i + 1, n + 1) if lim.ok(s, i, j)] == fit
                for j in range(i + 1, n + 1):
                    assert lim.reach(s, i, j) == max([i, *(x for x in fit if x <= j)])
