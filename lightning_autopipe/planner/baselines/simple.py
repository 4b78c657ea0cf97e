"""The simple partitioners: equal blocks, balanced parameters, balanced time (rank order).

Megatron-LM's uniform layers per stage, DeepSpeed's ``partition_method="parameters"`` and
torchgpipe's ``balance_by_time``; stage ``s`` runs on ranks ``[s R, (s + 1) R)`` (the pipe-major
rank topology of Megatron and DeepSpeed).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.balance import balanced_cuts
from lightning_autopipe.planner.layout import BlockCosts

__all__ = ["uniform_cuts", "parameter_cuts", "time_cuts", "rank_order_groups"]


def uniform_cuts(num_blocks: int, num_stages: int) -> list[int]:
    """Equal block counts per stage (the first ``num_blocks % num_stages`` stages get one more)."""
    base, extra = divmod(num_blocks, num_stages)
    return [0, *itertools.accumulate(base + (s < extra) for s in range(num_stages))]


def parameter_cuts(costs: BlockCosts, num_stages: int) -> list[int]:
    """Min-max balance of parameter bytes (DeepSpeed's ``parameters`` method)."""
    weights = [float(p) + 1e-9 * i for i, p in enumerate(costs.params)]  # tie-break empties
    cuts = balanced_cuts(weights, [1.0] * num_stages)
    assert cuts is not None
    return cuts


def time_cuts(costs: BlockCosts, num_stages: int) -> list[int]:
    """Min-max balance of forward + backward time on identical devices."""
    cuts = balanced_cuts(costs.compute, [1.0] * num_stages)
    assert cuts is not None
    return cuts


def rank_order_groups(devices: Sequence[str], cluster: Cluster, stages: int, replicas: int):
    """Stage ``s`` on the ``s``-th block of ``replicas`` devices in global rank order."""
    ranked = sorted(devices, key=lambda n: cluster.device(n).rank)
    return [list(ranked[s * replicas : (s + 1) * replicas]) for s in range(stages)]
