"""Seeded random profiles and clusters for the planner's property tests (extreme figures)."""

from __future__ import annotations

import random

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.profile import BlockProfile, Profile


def random_cluster(rng: random.Random) -> Cluster:
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


def random_profile(rng: random.Random, n: int) -> Profile:
    """``n`` blocks of lognormal times, backward 1.5-2.5 x forward, sizes over decades."""
    blocks = []
    for i in range(n):
        f = rng.lognormvariate(0, 1)
        blocks.append(BlockProfile(f"b{i}", f, f * rng.uniform(1.5, 2.5),
                                   rng.randint(10**4, 10**8), rng.randint(10**3, 10**7),
                                   rng.randint(10**4, 10**8)))
    return Profile("random", rng.choice([1, 2, 4]), "test", blocks)


def random_costs(rng: random.Random, n: int) -> tuple[Profile, Cluster, BlockCosts, list[str]]:
    """A random profile of ``n`` blocks, then a random cluster (in that order from ``rng``),
    the profile's block costs and the cluster's device names."""
    profile = random_profile(rng, n)
    cluster = random_cluster(rng)
    return profile, cluster, BlockCosts.from_profile(profile), [d.name for d in cluster.devices]
