"""Yardstick planners, each re-implemented from its published description on our Profile/Cluster.

Every planner returns :class:`~lightning_autopipe.planner.plan.Proposal` objects that
:func:`~lightning_autopipe.planner.search.make_plan` scores
with the same simulator, so the comparison is of plans, not of cost models:

* ``uniform`` — Megatron-LM style: the same number of blocks on every stage.
* ``parameters`` — DeepSpeed ``partition_method="parameters"``: min-max balance of parameter bytes.
* ``time`` — torchgpipe ``balance_by_time`` / DeepSpeed style: min-max balance of profiled
  forward + backward time, blind to device speeds.
  These three place stage ``s`` on ranks ``[s R, (s + 1) R)`` (the pipe-major rank topology of
  Megatron and DeepSpeed) and use the shape (S, R, m) they are given — pinned, or else the one
  the AutoPipe search picked, so they differ from AutoPipe only in partition and placement.
* ``dapple`` — DAPPLE (Fan et al., PPoPP'21): a dynamic program over stage splits in which
  each new stage picks its replica count and one of three device-assignment policies
  (fresh-first, append-first, scatter-first), scored by DAPPLE's pivot-stage latency model
  (``dapple.py``), which also picks the micro-batch count (AutoPipe's, 8, 32 or 128) unless
  pinned.
* ``piper`` — Piper (Tarnawski et al., NeurIPS'21) without tensor parallelism: a dynamic
  program over contiguous block ranges with a data-parallel degree per stage, minimising the
  bottleneck stage's time per batch under memory limits (``piper.py``).
* ``optimal`` — exhaustive search over partitions, startup slices and small mappings, scored
  by the simulator itself with branch and bound on an optimistic replay; the ground truth for
  small cases.
"""

from __future__ import annotations

import time

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.autopipe import autopipe_proposals
from lightning_autopipe.planner.baselines.dapple import dapple_placement, dapple_proposals
from lightning_autopipe.planner.baselines.optimal import optimal_proposal
from lightning_autopipe.planner.baselines.piper import piper_proposals
from lightning_autopipe.planner.baselines.simple import (
    parameter_cuts,
    rank_order_groups,
    time_cuts,
    uniform_cuts,
)
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.profile import Profile

__all__ = [
    "propose",
    "uniform_cuts",
    "parameter_cuts",
    "time_cuts",
    "rank_order_groups",
    "dapple_placement",
    "optimal_proposal",
]


def _shape(costs, cluster, devs, batch, pins, use_all, max_slices, opt):
    """(stages, replicas, micro-batches) as pinned, completed by the AutoPipe search.

    Returns the shape and the milliseconds spent in the AutoPipe search (not this planner's).
    """
    s, r, m = pins["num_stages"], pins["replicas"], pins["num_microbatches"]
    if s and r and m:
        return (s, r, m), 0.0
    t0 = time.perf_counter()
    best = autopipe_proposals(costs, cluster, devs, batch, pins, use_all, max_slices, opt)[0]
    shape = (len(best.groups), len(best.groups[0]), best.num_microbatches)
    return shape, (time.perf_counter() - t0) * 1e3


def propose(
    planner: str,
    profile: Profile,
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    *,
    pins: dict,
    uniform_replicas: bool = False,
    use_all_devices: bool = False,
    optimizer_factor: float = 2.0,
    max_startup_slices: int = 8,
    schedules: tuple[str, ...] = ("1f1b",),
) -> tuple[list[Proposal], float]:
    """Dispatch to one yardstick planner (see the module docstring).

    The yardsticks run 1F1B as published; ``optimal`` enumerates ``schedules`` too, so it
    stays the exact optimum of whatever AutoPipe may choose among.

    Returns:
        The proposals and the milliseconds spent choosing a borrowed shape (excluded from the
        yardstick's own search time).
    """
    k = pins["startup_slices"] or 1
    args = (costs, cluster, devs, batch, pins, use_all_devices, max_startup_slices,
            optimizer_factor)
    if planner in ("uniform", "parameters", "time"):
        (s, r, m), spent = _shape(*args)
        if s > costs.num_blocks:
            raise PlanError(f"cannot split {costs.num_blocks} blocks into {s} stages")
        cuts = {"uniform": lambda: uniform_cuts(costs.num_blocks, s),
                "parameters": lambda: parameter_cuts(costs, s),
                "time": lambda: time_cuts(costs, s)}[planner]()
        return [Proposal(rank_order_groups(devs, cluster, s, r), cuts, m, k)], spent
    if planner == "optimal":
        (s, r, m), spent = _shape(*args)
        return [optimal_proposal(profile, costs, cluster, devs, batch, s, r, m,
                                 pins["startup_slices"], max_startup_slices,
                                 optimizer_factor, pins.get("drain_slices"),
                                 schedules)], spent
    m, spent = pins["num_microbatches"], 0.0
    if not m:
        (_, _, m), spent = _shape(*args)
    if planner == "dapple":  # DAPPLE weighs micro-batch counts with its own latency model
        ms = [pins["num_microbatches"]] if pins["num_microbatches"] else sorted(
            {m} | {x for x in (8, 32, 128) if batch % x == 0})
        return dapple_proposals(costs, cluster, devs, batch, ms, pins["num_stages"],
                                pins["replicas"], uniform_replicas, use_all_devices,
                                optimizer_factor), spent
    if planner == "piper":
        return piper_proposals(costs, cluster, devs, batch, m, pins["num_stages"],
                               pins["replicas"], uniform_replicas, use_all_devices,
                               optimizer_factor), spent
    raise PlanError(f"unknown planner {planner!r}")
