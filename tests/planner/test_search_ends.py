"""The plan search ends after a bounded number of steps whatever the link, speed and block
figures, and never returns worse than the min-max balanced start it descends from."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.mapping import candidate_groupings
from lightning_autopipe.planner.partition import autopipe_partition, step_budget
from lightning_autopipe.profile import BlockProfile, Profile

DATA = Path(__file__).resolve().parents[1] / "data"


def test_near_free_links_plan_a_48_layer_gpt_on_16_mixed_devices():
    """Every link at 10^6 Gb/s once made the all-reduce pricing spin for minutes."""
    profile = Profile.load(DATA / "gpt48-profile.json")
    cluster = Cluster.load(DATA / "fast-8a8v.yaml")
    plan = make_plan(profile, cluster, 512)
    assert plan.num_blocks == len(profile.blocks) == 98
    assert plan.iteration_ms > 0
    assert plan.num_stages * max(s.replicas for s in plan.stages) <= 16


def _random_cluster(rng: random.Random) -> Cluster:
    """1-4 servers of 1-16 devices, link figures 10^-1 .. 10^7 Gb/s, speeds 0.1 .. 1."""
    servers, total = [], 0
    for i in range(rng.randint(1, 4)):
        gpus = rng.choice([1, 2, 4, 8, 16])
        if total + gpus > 64:
            break
        total += gpus
        sizes = [s for s in (2, 4, 8) if s < gpus] + [gpus]
        levels = [{"size": s, "gbps": 10 ** rng.uniform(-1, 7),
                   "latency_us": 10 ** rng.uniform(-1, 2)} for s in sizes]
        servers.append({
            "name": f"s{i}", "gpus": gpus, "nic_gbps": 10 ** rng.uniform(-1, 7),
            "device": {"name": f"d{i}", "speed": rng.uniform(0.1, 1.0),
                       "memory_gb": rng.choice([8, 16, 80])},
            "levels": levels,
        })
    if total < 2:  # at least two devices
        servers.append({"name": "extra", "gpus": 2,
                        "device": {"name": "e", "speed": 0.5, "memory_gb": 16},
                        "levels": [{"size": 2, "gbps": 10 ** rng.uniform(-1, 7)}]})
    return Cluster.from_dict({"name": "random", "network_latency_us": 10 ** rng.uniform(-1, 2),
                              "servers": servers, "network_gbps": 10 ** rng.uniform(-1, 7)})


def _random_profile(rng: random.Random, n: int) -> Profile:
    blocks = []
    for i in range(n):
        f = rng.lognormvariate(0, 1)
        blocks.append(BlockProfile(f"b{i}", f, f * rng.uniform(1.5, 2.5),
                                   rng.randint(10**4, 10**8), rng.randint(10**3, 10**7),
                                   rng.randint(10**4, 10**8)))
    return Profile("random", rng.choice([1, 2, 4]), "test", blocks)


@pytest.mark.parametrize("seed", range(30))
def test_partitioner_ends_within_its_step_budget_and_never_loses_to_its_start(seed):
    rng = random.Random(seed)
    profile = _random_profile(rng, rng.randint(20, 200))
    cluster = _random_cluster(rng)
    costs = BlockCosts.from_profile(profile)
    devs = [d.name for d in cluster.devices]
    for _ in range(3):
        replicas = rng.choice([r for r in (1, 2, 4) if r <= len(devs) // 2] or [1])
        stages = rng.randint(2, min(16, len(devs) // replicas))
        m = rng.choice([1, stages, 4 * stages])
        size = rng.choice([1, 2, 4])
        batch = m * replicas * size
        groups = next(iter(candidate_groupings(cluster, devs, stages, replicas).values()))
        layout = Layout.from_cluster(cluster, groups)
        budget = rng.choice([40, 400])
        res = autopipe_partition(costs, layout, batch, m, rng.choice([1, min(2, size)]),
                                 max_evaluations=budget)
        assert res.steps <= step_budget(budget), "the descent did not end by its own rule"
        assert res.evaluations <= budget + 4
        if res.estimate.fits or not math.isfinite(res.balanced_ms):
            assert res.estimate.iteration_ms <= res.balanced_ms * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_the_whole_search_ends_on_extreme_clusters(seed):
    rng = random.Random(100 + seed)
    profile = _random_profile(rng, rng.randint(20, 200))
    cluster = _random_cluster(rng)
    batch = 64 * rng.choice([1, 2, 4])
    plan = make_plan(profile, cluster, batch, memory_check=False)
    assert plan.num_blocks == len(profile.blocks)
    assert math.isfinite(plan.iteration_ms)
    assert plan.iteration_ms > 0
