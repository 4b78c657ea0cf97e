"""Clusters the planner tests share: one fast server beside one slower one."""

from __future__ import annotations

from lightning_autopipe.cluster import Cluster


def two_speeds(name: str, fast_gpus: int = 2, slow_gpus: int = 2, *, network_gbps: float = 10,
               fast_gbps: float = 200, slow_gbps: float = 50, fast: str = "fast",
               slow: str = "slow") -> Cluster:
    """Server ``fast`` (device A, speed 1) and server ``slow`` (device B, speed 0.5), 16 GB
    each, one link level per server."""
    def server(label: str, gpus: int, device: str, speed: float, gbps: float) -> dict:
        return {"name": label, "gpus": gpus,
                "device": {"name": device, "speed": speed, "memory_gb": 16},
                "levels": [{"size": gpus, "gbps": gbps}]}

    return Cluster.from_dict({
        "name": name, "network_gbps": network_gbps,
        "servers": [server(fast, fast_gpus, "A", 1.0, fast_gbps),
                    server(slow, slow_gpus, "B", 0.5, slow_gbps)],
    })
