"""``benchmarks/runtime.py``'s same-round prediction: each rank priced from its own profile.

The benchmark's ranks share one machine and do not run at one speed; both profile at once at
the start of every round, and the prediction beside a timing prices rank ``r`` on the profile
rank ``r`` took. A rank whose profile is its peer's scaled by ``1 / s`` is the same device as
one declared at speed ``s``: both routes must give the simulator the same step.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.runtime")


def _profile(scale: float = 1.0) -> Profile:
    blocks = [
        BlockProfile(name=f"h.{i}", forward_ms=scale * (3.0 + i % 4),
                     backward_ms=scale * (6.0 + 2 * (i % 3)), param_bytes=2**20,
                     activation_bytes=2**18, memory_bytes=2**20,
                     forward_fixed_ms=scale * 0.5, backward_fixed_ms=scale * 1.0,
                     backward_input_ms=scale * (3.5 + i % 3), backward_weight_ms=scale * 3.0)
        for i in range(10)
    ]
    return Profile(model="toy", micro_batch_size=4, device="cpu", blocks=blocks)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_a_rank_priced_on_its_own_slower_profile_is_a_device_declared_slower(bench, schedule):
    cluster = Cluster.local(2, gbps=50.0, latency_us=70.0, reduce_gbps=6.0, overhead_ms=0.05)
    fast, slow = _profile(), _profile(1.25)
    plan = make_plan(fast, cluster, 32, num_stages=2, replicas=1, schedules=(schedule,),
                     num_microbatches=4, uniform_replicas=True)
    (server,) = cluster.servers
    declared = replace(cluster, servers=[replace(
        server, devices=((1, replace(server.device, name="slower", speed=0.8)),))])

    own = simulate(plan, fast, bench.per_rank_cluster(cluster, [fast, slow])).iteration_ms
    assert own == pytest.approx(simulate(plan, fast, declared).iteration_ms, rel=1e-9)
    assert own > simulate(plan, fast, cluster).iteration_ms * 1.05  # the slower rank counts
    alike = bench.per_rank_cluster(cluster, [fast, fast])
    assert simulate(plan, fast, alike).iteration_ms == pytest.approx(
        simulate(plan, fast, cluster).iteration_ms, rel=1e-9)
