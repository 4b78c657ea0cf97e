"""The partitioner's plans are local optima: no boundary moved by 1-3 blocks, and no two
adjacent boundaries moved by one each, gives a faster step in the simulator, for 1F1B and ZB-H1
on random lognormal profiles (60-200 blocks, 4-16 stages, m from the depth to four times it)."""

from __future__ import annotations

import math
import random

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.polish import neighbours
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile


def _profile(rng: random.Random, n: int) -> Profile:
    blocks = []
    for i in range(n):
        f = rng.lognormvariate(0, 1)
        blocks.append(BlockProfile(f"b{i}", f, 2 * f, 10**6, 10**5, 10**6))
    return Profile("lognormal", 1, "ref", blocks)


def _cluster(stages: int) -> Cluster:
    """Latency-only links (no transfer shares bytes): the fast model is the simulator here."""
    return Cluster.from_dict({"name": "free", "servers": [{
        "name": "s", "gpus": stages, "device": {"name": "d", "speed": 1.0, "memory_gb": 80},
        "levels": [{"size": stages, "gbps": math.inf, "latency_us": 20}]}]})


def _simulated(plan: Plan, cuts: list[int], prof: Profile, cluster: Cluster) -> float:
    return simulate(plan.with_cuts(cuts), prof, cluster).iteration_ms


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_no_local_move_improves_the_partition(seed, schedule):
    rng = random.Random(seed)
    n, stages = rng.randint(60, 200), rng.choice([4, 8, 12, 16])
    m = rng.randint(stages, 4 * stages)
    prof, cluster = _profile(rng, n), _cluster(stages)
    plan = make_plan(prof, cluster, 4 * m, num_stages=stages, replicas=1, num_microbatches=m,
                     schedules=(schedule,))
    got = plan.iteration_ms
    assert _simulated(plan, plan.cuts, prof, cluster) == pytest.approx(got)
    for cuts in neighbours(plan.cuts):
        assert _simulated(plan, cuts, prof, cluster) >= got * (1 - 1e-9), cuts
