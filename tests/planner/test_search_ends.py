"""The plan search ends after a bounded number of steps whatever the link, speed and block
figures, and never returns worse than the min-max balanced start it descends from."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.layout import Layout
from lightning_autopipe.planner.mapping import candidate_groupings
from lightning_autopipe.planner.partition import autopipe_partition, step_budget
from lightning_autopipe.planner.step import StepShape
from lightning_autopipe.profile import Profile

from ._random import random_cluster, random_costs, random_profile

DATA = Path(__file__).resolve().parents[1] / "data"


def test_near_free_links_plan_a_48_layer_gpt_on_16_mixed_devices():
    """Every link at 10^6 Gb/s once made the all-reduce pricing spin for minutes."""
    profile = Profile.load(DATA / "gpt48-profile.json")
    cluster = Cluster.load(DATA / "fast-8a8v.yaml")
    plan = make_plan(profile, cluster, 512)
    assert plan.num_blocks == len(profile.blocks) == 98
    assert plan.iteration_ms > 0
    assert plan.num_stages * max(s.replicas for s in plan.stages) <= 16


@pytest.mark.parametrize("seed", range(30))
def test_partitioner_ends_within_its_step_budget_and_never_loses_to_its_start(seed):
    rng = random.Random(seed)
    _, cluster, costs, devs = random_costs(rng, rng.randint(20, 200))
    for _ in range(3):
        replicas = rng.choice([r for r in (1, 2, 4) if r <= len(devs) // 2] or [1])
        stages = rng.randint(2, min(16, len(devs) // replicas))
        m = rng.choice([1, stages, 4 * stages])
        size = rng.choice([1, 2, 4])
        batch = m * replicas * size
        groups = next(iter(candidate_groupings(cluster, devs, stages, replicas).values()))
        layout = Layout.from_cluster(cluster, groups)
        budget = rng.choice([40, 400])
        step = StepShape(batch, m, rng.choice([1, min(2, size)]))
        res = autopipe_partition(costs, layout, step, max_evaluations=budget)
        assert res.steps <= step_budget(budget), "the descent did not end by its own rule"
        assert res.evaluations <= budget + 4
        if res.estimate.fits or not math.isfinite(res.balanced_ms):
            assert res.estimate.iteration_ms <= res.balanced_ms * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_the_whole_search_ends_on_extreme_clusters(seed):
    rng = random.Random(100 + seed)
    profile = random_profile(rng, rng.randint(20, 200))
    cluster = random_cluster(rng)
    batch = 64 * rng.choice([1, 2, 4])
    plan = make_plan(profile, cluster, batch, memory_check=False)
    assert plan.num_blocks == len(profile.blocks)
    assert math.isfinite(plan.iteration_ms)
    assert plan.iteration_ms > 0
