"""Yardstick planners, each re-implemented from its published description on our Profile/Cluster.

Every planner returns :class:`~.search.Proposal` objects that :func:`~.search.make_plan` scores
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
  (``_dapple.py``), which also picks the micro-batch count (AutoPipe's, 8, 32 or 128) unless
  pinned.
* ``piper`` — Piper (Tarnawski et al., NeurIPS'21) without tensor parallelism: a dynamic
  program over contiguous block ranges with a data-parallel degree per stage, minimising the
  bottleneck stage's time per batch under memory limits (``_piper.py``).
* ``optimal`` — exhaustive search over partitions, startup slices and small mappings, scored
  by :func:`simulate` itself with branch and bound on an optimistic replay; the ground truth for
  small cases.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner._dapple import dapple_placement, dapple_proposals
from lightning_autopipe.planner._piper import piper_proposals
from lightning_autopipe.planner.costmodel import BlockCosts, Layout, evaluate
from lightning_autopipe.planner.mapping import candidate_groupings
from lightning_autopipe.planner.partition import balanced_cuts
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.search import Proposal, _autopipe
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import Profile

__all__ = [
    "propose",
    "uniform_cuts",
    "parameter_cuts",
    "time_cuts",
    "rank_order_groups",
    "dapple_placement",
    "optimal_proposal",
    "DAPPLE_POLICIES",
]

DAPPLE_POLICIES = ("fresh", "append", "scatter")
_OPTIMAL_LIMIT = 20_000  # (partition, mapping, slices) candidates the exact search may enumerate


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


def _shape(costs, cluster, devs, batch, pins, use_all, max_slices, opt):
    """(stages, replicas, micro-batches) as pinned, completed by the AutoPipe search.

    Returns the shape and the milliseconds spent in the AutoPipe search (not this planner's).
    """
    s, r, m = pins["num_stages"], pins["replicas"], pins["num_microbatches"]
    if s and r and m:
        return (s, r, m), 0.0
    t0 = time.perf_counter()
    best = _autopipe(costs, cluster, devs, batch, pins, use_all, max_slices, opt)[0]
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
) -> tuple[list[Proposal], float]:
    """Dispatch to one yardstick planner (see the module docstring).

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
                                 optimizer_factor, pins.get("drain_slices"))], spent
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


# ---------------------------------------------------------------------------- optimal
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
) -> Proposal:
    """Exact best (partition, mapping, startup and drain slices) for a fixed shape.

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
    slices = [(k, j) for k in ks for j in js]
    maps = _mappings(cluster, devs, stages, replicas)
    parts = math.comb(n - 1, stages - 1)
    total = parts * len(maps) * len(slices)
    if total > _OPTIMAL_LIMIT:
        raise PlanError(
            f"the optimal planner would enumerate {parts} partitions x {len(maps)} mappings x "
            f"{len(slices)} (startup, drain) slice counts = {total} candidates (limit "
            f"{_OPTIMAL_LIMIT}); use it on small cases (about 12 blocks, 4 stages) or pin "
            "startup_slices and drain_slices"
        )
    cands = []
    for groups in maps:
        lay = Layout.from_cluster(cluster, groups, optimistic=True)
        for inner in itertools.combinations(range(1, n), stages - 1):
            cuts = [0, *inner, n]
            for k, j in slices:
                e = evaluate(costs, lay, cuts, batch, m, k, drain_slices=j,
                             optimizer_factor=optimizer_factor, critical_path=False)
                cands.append((not e.fits, e.iteration_ms, groups, cuts, k, j))
    cands.sort(key=lambda c: (c[0], c[1]))
    best: tuple[tuple[bool, float], Proposal] | None = None
    for unfit, bound, groups, cuts, k, j in cands:
        if best is not None and (unfit, bound) >= best[0]:
            break
        plan = Plan("optimal", batch, m, k,
                    [StagePlan((cuts[s], cuts[s + 1]), groups[s]) for s in range(stages)],
                    drain_slices=j)
        res = simulate(plan, profile, cluster, optimizer_bytes_per_param_byte=optimizer_factor)
        fits = all(v <= cluster.device(d).spec.memory_bytes
                   for d, v in res.peak_memory_bytes.items())
        key = (not fits, res.iteration_ms)
        if best is None or key < best[0]:
            best = (key, Proposal(groups, cuts, m, k, j))
    assert best is not None
    return best[1]
