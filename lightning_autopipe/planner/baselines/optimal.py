"""The exact optimum of the cost model for one shape, by enumeration with branch and bound."""

from __future__ import annotations

import itertools
import math

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.baselines.simple import rank_order_groups
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.mapping import candidate_groupings
from lightning_autopipe.planner.plan import Plan, Proposal, StagePlan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.step import StepShape
from lightning_autopipe.profile import Profile

__all__ = ["optimal_proposal"]

_OPTIMAL_LIMIT = 20_000  # (partition, mapping, slices) candidates the exact search may enumerate


def _mappings(cluster: Cluster, devs: list[str], stages: int, replicas: int) -> list[list]:
    """Every ordered choice of devices for small cases, else the mapper's layouts permuted.

    Layouts whose devices are interchangeable (same speeds, memories, links and contention:
    equal :meth:`Layout.signature`) are enumerated once.
    """
    if replicas == 1 and math.perm(len(devs), stages) <= 120:
        cands = [[[d] for d in p] for p in itertools.permutations(devs, stages)]
    else:
        cands = []
        for groups in candidate_groupings(cluster, devs, stages, replicas).values():
            perms = itertools.permutations(groups) if stages <= 4 else [groups]
            cands += [[list(g) for g in p] for p in perms]
        cands.append(rank_order_groups(devs, cluster, stages, replicas))
    out, seen = [], set()
    for groups in cands:
        sig = Layout.from_cluster(cluster, groups).signature()
        if sig not in seen:
            seen.add(sig)
            out.append(groups)
    return out


def optimal_proposal(
    profile: Profile,
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    stages: int,
    replicas: int,
    m: int,
    k_pin: int | None,
    max_slices: int,
    optimizer_factor: float = 2.0,
    j_pin: int | None = None,
    schedules: tuple[str, ...] = ("1f1b",),
) -> Proposal:
    """Exact best (partition, mapping, startup and drain slices, schedule) for a fixed shape.

    Branch and bound: every candidate gets an optimistic replay (a lower bound of the
    simulator); candidates are simulated in order of that bound until the bound exceeds the
    best simulated time, so the answer is exactly the simulator's optimum over the space.

    Raises:
        PlanError: the space is too large to enumerate (more than 20 000 candidates).
    """
    n = costs.num_blocks
    mb = batch // (m * replicas)
    ks = [k_pin] if k_pin else list(range(1, min(max_slices, mb) + 1))
    js = [j_pin] if j_pin else list(range(1, min(max_slices, mb) + 1)) if m >= 2 else [1]
    steps = [StepShape(batch, m, k, drain_slices=j, schedule=sch,
                       optimizer_factor=optimizer_factor)
             for k in ks for j in js for sch in schedules]
    maps = _mappings(cluster, devs, stages, replicas)
    parts = math.comb(n - 1, stages - 1)
    total = parts * len(maps) * len(steps)
    if total > _OPTIMAL_LIMIT:
        raise PlanError(
            f"the optimal planner would enumerate {parts} partitions x {len(maps)} mappings x "
            f"{len(steps)} (startup, drain, schedule) choices = {total} candidates (limit "
            f"{_OPTIMAL_LIMIT}); use it on small cases (about 12 blocks, 4 stages) or pin "
            "startup_slices and drain_slices"
        )
    cands = []
    for groups in maps:
        lay = Layout.from_cluster(cluster, groups, optimistic=True)
        for inner in itertools.combinations(range(1, n), stages - 1):
            cuts = [0, *inner, n]
            for step in steps:
                e = evaluate(costs, lay, cuts, step, critical_path=False)
                cands.append((not e.fits, e.iteration_ms, groups, cuts, step))
    cands.sort(key=lambda c: (c[0], c[1]))
    best: tuple[tuple[bool, float], Proposal] | None = None
    for unfit, bound, groups, cuts, step in cands:
        if best is not None and (unfit, bound) >= best[0]:
            break
        k, j, sch = step.startup_slices, step.drain_slices, step.schedule
        plan = Plan("optimal", batch, m, k,
                    [StagePlan((cuts[s], cuts[s + 1]), groups[s]) for s in range(stages)],
                    drain_slices=j, schedule=sch)
        res = simulate(plan, profile, cluster, optimizer_bytes_per_param_byte=optimizer_factor)
        fits = all(v <= cluster.device(d).spec.memory_bytes
                   for d, v in res.peak_memory_bytes.items())
        key = (not fits, res.iteration_ms)
        if best is None or key < best[0]:
            best = (key, Proposal(groups, cuts, m, k, j, sch))
    assert best is not None
    return best[1]
