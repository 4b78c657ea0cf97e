"""Seeded random profiles and clusters for the search-quality reference (see
``test_fast_pricing.py``); also run against an older planner to freeze its figures
(``PYTHONPATH=<its checkout>``, output to ``tests/planner/data/search_reference.json``):

    python tests/planner/search_cases.py > search_reference.json
"""

from __future__ import annotations

import json
import random
import sys

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.profile import BlockProfile, Profile

CASES = 50


def case(seed: int) -> tuple[Profile, Cluster, int]:
    """A small random profile (8-40 blocks) on 2-16 devices of one or two types."""
    rng = random.Random(7000 + seed)
    blocks = []
    for i in range(rng.randint(8, 40)):
        f = rng.lognormvariate(0, 1)
        blocks.append(BlockProfile(
            f"b{i}", f, f * rng.uniform(1.5, 2.5), rng.randint(10**4, 10**8),
            rng.randint(10**3, 10**7), rng.randint(10**4, 10**8),
            forward_fixed_ms=f * rng.choice([0.0, 0.1]), backward_fixed_ms=0.0))
    profile = Profile("random", rng.choice([1, 2, 4]), "test", blocks)
    servers = []
    for i in range(rng.randint(1, 2)):
        gpus = rng.choice([1, 2, 4, 8])
        servers.append({
            "name": f"s{i}", "gpus": gpus, "nic_gbps": 10 ** rng.uniform(0, 3),
            "device": {"name": f"d{i}", "speed": rng.choice([1.0, rng.uniform(0.2, 1.0)]),
                       "memory_gb": rng.choice([8, 80])},
            "levels": [{"size": gpus, "gbps": 10 ** rng.uniform(1, 3)}],
        })
    if sum(s["gpus"] for s in servers) < 2:
        servers.append({"name": "extra", "gpus": 2, "device": {"name": "e", "speed": 0.5,
                        "memory_gb": 16}, "levels": [{"size": 2, "gbps": 100}]})
    cluster = Cluster.from_dict({"name": "random", "network_gbps": 10 ** rng.uniform(0, 2),
                                 "servers": servers})
    return profile, cluster, 8 * rng.choice([1, 2, 4])


def main() -> int:
    from lightning_autopipe.planner import make_plan

    out = {}
    for seed in range(CASES):
        profile, cluster, batch = case(seed)
        out[seed] = make_plan(profile, cluster, batch, memory_check=False).iteration_ms
    json.dump(out, sys.stdout, indent=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
