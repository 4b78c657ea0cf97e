"""The joint search: pipeline depth x replicas x micro-batches x startup slices, then a Plan.

:func:`make_plan` is the one entry point the strategy, the CLI and the benchmark call. For
``planner="autopipe"`` it searches in four levels, each more exact and applied to fewer shapes:

1. every (stages ``S``, replicas ``R``, micro-batches ``m``) allowed by the pins, the devices and
   the batch is scored in O(S) by a closed form on the fastest ``S x R`` devices: ``m + S - 1``
   stage times, a stage time being the larger of perfectly balanced compute (plus half a block
   of rounding) and the slowest cut's transfer, plus the fill latency and the first stage's
   all-reduce; a rough memory check marks shapes that cannot fit;
2. the best eight (at most two micro-batch counts per ``S x R``) are placed: every candidate
   layout of :func:`~.mapping.rank_layouts` is scored by the 1F1B replay with its balanced
   partition;
3. the best (shape, layout) pairs, three or more while the replay budget lasts, get the AutoPipe
   partitioner and the startup slicer (:func:`~.partition.partition_and_slice`);
4. when cheap enough, the simulator (:func:`~.simulate.simulate`, link contention included)
   picks among the best eight proposals; otherwise the fast model's favourite stands.

``search_ms`` is the time to choose the plan; simulating the chosen plan to fill its predicted
figures is not part of it (unless the simulator took part in choosing).

AutoPipe gives every stage the same replica count (what the runtime executes); DAPPLE and Piper
may replicate stages unevenly unless ``uniform_replicas``. The yardstick planners
(``baselines``) are dispatched from here too, so every planner's result is scored by the same
simulator and returned as the same :class:`Plan`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import ClusterError, MemoryPlanError, PlanError
from lightning_autopipe.planner.costmodel import BlockCosts
from lightning_autopipe.planner.mapping import rank_layouts, speed_order
from lightning_autopipe.planner.partition import choose_drain_slices, partition_and_slice
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import Profile, affine_ms

__all__ = ["make_plan", "PLANNERS", "Proposal", "finish_plan", "microbatch_choices"]

PLANNERS = ("autopipe", "dapple", "piper", "time", "parameters", "uniform", "optimal")
GiB = 2**30
_SIM_BUDGET = 3000  # devices x units: simulate finalists only while their sum stays below
_REPLAY_BUDGET = 100_000  # replayed actions per shape the AutoPipe partitioner may spend
_LEVEL2, _LEVEL3 = 8, 3  # shapes placed by the mapper / refined by the partitioner
_LEVEL3_BUDGET = 400_000  # replayed actions (upper bound) for refining more than three
_FINALISTS = 8  # proposals the simulator may choose among (within _SIM_BUDGET)


def _replay_cost(stages: int, m: int, k: int) -> int:
    """Actions one fast-model evaluation replays (long steps are extrapolated, two replays)."""
    m0 = 2 * stages + 6
    return 2 * stages * (m + k) if m <= m0 else 4 * stages * (m0 + stages + k)


@dataclass
class Proposal:
    """A planner's answer before scoring: device groups per stage, cuts, m, k and j."""

    groups: list[list[str]]
    cuts: list[int]
    num_microbatches: int
    startup_slices: int = 1
    drain_slices: int = 1


def microbatch_choices(batch: int, replicas: int, num_stages: int) -> list[int]:
    """Micro-batch counts that divide the per-replica batch.

    All divisors: the largest ones (micro-batches of one or two samples) are often the only
    way a big model fits memory, and the replay of long steps is extrapolated, so many
    micro-batches cost the search little.
    """
    per = batch // replicas
    return [m for m in range(1, per + 1) if per % m == 0]


def make_plan(
    profile: Profile,
    cluster: Cluster,
    global_batch_size: int,
    *,
    planner: str = "autopipe",
    num_stages: int | None = None,
    replicas: int | None = None,
    num_microbatches: int | None = None,
    startup_slices: int | None = None,
    drain_slices: int | None = None,
    devices: list[str] | None = None,
    uniform_replicas: bool = False,
    use_all_devices: bool = False,
    memory_check: bool = True,
    max_startup_slices: int = 8,
    optimizer_factor: float = 2.0,
) -> Plan:
    """Plan training of ``profile`` on ``cluster`` for ``global_batch_size`` samples per step.

    Args:
        planner: ``autopipe`` or a yardstick (``dapple``, ``piper``, ``time``, ``parameters``,
            ``uniform``, ``optimal``); shapes a yardstick does not choose itself (and that are
            not pinned) are taken from the AutoPipe search, so partitions compare like for like.
        num_stages, replicas, num_microbatches, startup_slices, drain_slices: pin that choice
            (``optimal`` also searches drain slices; DAPPLE, Piper and the simple
            partitioners run whole last micro-batches unless ``drain_slices`` is pinned).
        devices: restrict to these device names (e.g. the launched world); default all.
        uniform_replicas: every stage gets the same replica count (the runtime needs it).
        use_all_devices: stages x replicas must equal the number of devices.
        memory_check: raise :class:`MemoryPlanError` when the best plan does not fit.

    Returns:
        The plan with the simulator's predictions, ``search_ms`` and the profile's identity.

    Raises:
        PlanError: impossible pins (more stages than blocks, batch not divisible, too many
            slices, unknown planner); ClusterError: unknown or too few devices;
        MemoryPlanError: nothing fits memory.
    """
    t0 = time.perf_counter()
    if planner not in PLANNERS:
        raise PlanError(f"unknown planner {planner!r}; use one of {', '.join(PLANNERS)}")
    devs = _check_inputs(profile, cluster, global_batch_size, devices, num_stages, replicas,
                         num_microbatches, startup_slices, use_all_devices, drain_slices)
    costs = BlockCosts.from_profile(profile)
    pins = dict(num_stages=num_stages, replicas=replicas, num_microbatches=num_microbatches,
                startup_slices=startup_slices, drain_slices=drain_slices)
    excluded = 0.0
    if planner == "autopipe":
        props = _autopipe(costs, cluster, devs, global_batch_size, pins, use_all_devices,
                          max_startup_slices, optimizer_factor)
    else:
        from lightning_autopipe.planner import baselines

        props, excluded = baselines.propose(
            planner, profile, costs, cluster, devs, global_batch_size, pins=pins,
            uniform_replicas=uniform_replicas, use_all_devices=use_all_devices,
            optimizer_factor=optimizer_factor, max_startup_slices=max_startup_slices,
        )
        for p in props:  # a pinned drain applies to every planner's layout
            p.drain_slices = drain_slices or p.drain_slices
    # Level 4: the simulator picks among the finalists when that is cheap; otherwise the fast
    # model's favourite stands (it tracks the simulator closely) and is simulated only to report
    # its predictions, which is not part of the search time.
    chosen, spent = [], 0
    for p in props:
        spent += sum(len(g) for g in p.groups) * (
            p.num_microbatches + p.startup_slices + p.drain_slices
        )
        if spent > _SIM_BUDGET:
            break
        chosen.append(p)
    if len(chosen) < 2 and props[0].drain_slices > 1 and len(props) > 1:
        # too big to simulate many, but drain slices are where the fast model (no shared-NIC
        # contention) is least sure: the favourite is judged against itself without them
        # (the proposal right after it, see _autopipe)
        chosen = props[:2]
    if len(chosen) >= 2:
        plans = [finish_plan(p, planner, profile, cluster, global_batch_size, optimizer_factor)
                 for p in chosen]
        search_ms = (time.perf_counter() - t0) * 1e3 - excluded
    else:
        search_ms = (time.perf_counter() - t0) * 1e3 - excluded
        plans = [finish_plan(props[0], planner, profile, cluster, global_batch_size,
                             optimizer_factor)]
    fitting = [p for p in plans if _fits(p, cluster)]
    best = min(fitting or plans, key=lambda p: p.iteration_ms)
    if memory_check and not fitting:
        raise _memory_error(best, cluster, global_batch_size)
    best.search_ms = search_ms
    return best


def finish_plan(
    prop: Proposal,
    planner: str,
    profile: Profile,
    cluster: Cluster,
    batch: int,
    optimizer_factor: float = 2.0,
) -> Plan:
    """Turn a proposal into a Plan carrying the simulator's predictions."""
    cuts = prop.cuts
    stages = [StagePlan((cuts[s], cuts[s + 1]), list(g)) for s, g in enumerate(prop.groups)]
    plan = Plan(planner, batch, prop.num_microbatches, prop.startup_slices, stages,
                model=profile.model, fingerprint=profile.fingerprint,
                drain_slices=prop.drain_slices)
    res = simulate(plan, profile, cluster, optimizer_bytes_per_param_byte=optimizer_factor)
    for st, ms in zip(plan.stages, res.stage_ms):
        st.stage_ms = ms
    plan.iteration_ms = res.iteration_ms
    plan.bubble_fraction = res.bubble_fraction
    plan.peak_memory_bytes = dict(res.peak_memory_bytes)
    mean = sum(res.stage_ms) / len(res.stage_ms)
    plan.balance = max(res.stage_ms) / mean if mean > 0 else 1.0
    return plan


# ---------------------------------------------------------------------------- checks
def _check_inputs(
    profile: Profile,
    cluster: Cluster,
    batch: int,
    devices: list[str] | None,
    num_stages: int | None,
    replicas: int | None,
    m: int | None,
    k: int | None,
    use_all: bool,
    j: int | None = None,
) -> list[str]:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"global_batch_size must be a positive integer, got {batch!r}")
    for name, v in (("num_stages", num_stages), ("replicas", replicas),
                    ("num_microbatches", m), ("startup_slices", k), ("drain_slices", j)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise PlanError(f"{name} must be a positive integer or None, got {v!r}")
    devs = [d.name for d in cluster.devices] if devices is None else list(devices)
    for d in devs:
        cluster.device(d)  # ClusterError naming the bad device
    if len(set(devs)) != len(devs):
        raise ClusterError(f"device list {devs} names a device twice")
    if not devs:
        raise ClusterError("no devices to plan for; pass at least one device name")
    n, nd = len(profile.blocks), len(devs)
    if num_stages is not None and num_stages > n:
        raise PlanError(
            f"cannot split {n} blocks of {profile.model!r} into {num_stages} stages; use at most "
            f"{n} stages (or profile the model at a finer block granularity)"
        )
    need = (num_stages or 1) * (replicas or 1)
    if need > nd:
        raise ClusterError(
            f"{num_stages or 1} stages x {replicas or 1} replicas need {need} devices but only "
            f"{nd} are available ({cluster.name!r}); use fewer stages or replicas, or add devices"
        )
    if use_all and num_stages and replicas and need != nd:
        raise PlanError(
            f"use_all_devices needs stages x replicas == {nd} devices, but {num_stages} x "
            f"{replicas} = {need}; pin a shape whose product is {nd}"
        )
    r = replicas or 1
    if batch % r:
        raise PlanError(
            f"global batch {batch} is not divisible into {r} replicas; use a multiple of {r}"
        )
    if m is not None and batch % (r * m):
        ok = [x for x in range(1, batch // r + 1) if (batch // r) % x == 0]
        raise PlanError(
            f"global batch {batch} is not divisible into {r} replicas x {m} micro-batches "
            f"= {r * m}; use a batch that is a multiple of {r * m}, or num_microbatches in "
            f"{ok[:12]}"
        )
    if k is not None and m is not None and k > batch // (r * m):
        raise PlanError(
            f"cannot split a micro-batch of {batch // (r * m)} samples into {k} startup slices;"
            f" use startup_slices <= {batch // (r * m)} or fewer micro-batches"
        )
    if j is not None and m is not None and m >= 2 and j > batch // (r * m):
        raise PlanError(
            f"cannot split a micro-batch of {batch // (r * m)} samples into {j} drain slices;"
            f" use drain_slices <= {batch // (r * m)} or fewer micro-batches"
        )
    return devs


def _fits(plan: Plan, cluster: Cluster) -> bool:
    return all(b <= cluster.device(d).spec.memory_bytes for d, b in plan.peak_memory_bytes.items())


def _memory_error(plan: Plan, cluster: Cluster, batch: int) -> MemoryPlanError:
    over = max(plan.peak_memory_bytes,
               key=lambda d: plan.peak_memory_bytes[d] / cluster.device(d).spec.memory_bytes)
    need, have = plan.peak_memory_bytes[over], cluster.device(over).spec.memory_bytes
    s = next(i for i, st in enumerate(plan.stages) if over in st.devices)
    return MemoryPlanError(
        f"no plan fits device memory: the best plan ({plan.num_stages} stages, "
        f"{[st.replicas for st in plan.stages][0]} replicas, {plan.num_microbatches} "
        f"micro-batches of global batch {batch}) needs {need / GiB:.2f} GiB on {over} (stage {s}, "
        f"blocks {list(plan.stages[s].blocks)}) which has {have / GiB:.2f} GiB; use more "
        "stages, a smaller micro-batch (more micro-batches or a smaller batch), more devices, "
        "or pass memory_check=False to get the plan anyway"
    )


# ---------------------------------------------------------------------------- AutoPipe
@dataclass
class _Shape:
    stages: int
    replicas: int
    microbatches: int
    score: float
    fits: bool


def _slice_term(
    fill: float, size: int, tau: Callable[[float], float], pin: int | None, max_slices: int
) -> float:
    """Closed-form cost of a micro-batch of ``size`` samples cut into its best q slices.

    Each stage runs the q slices (``q * tau(size / q)``), and the pipeline waits ``fill`` slice
    times for them: ``stages - 1`` when the micro-batch is the only one (its slices both fill
    and drain the pipeline), half of that for one end of several micro-batches (with q = 1 the
    two ends of a plain 1F1B together give its ``(stages - 1) * tau`` bubble). A pinned count
    is taken as is.
    """
    qs = [pin] if pin else range(1, min(max_slices, size) + 1)
    return min((q + fill) * tau(size / q) for q in qs)


def _shapes(
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    pins: dict,
    use_all: bool,
    optimizer_factor: float,
    max_slices: int = 1,
) -> list[_Shape]:
    """Level 1: every allowed (S, R, m) with its closed-form estimate.

    The estimate already counts startup and drain slices (``_slice_term``): with per-call
    costs, the best micro-batch count with slices is often smaller than without them (fewer,
    larger micro-batches; the ends cut finer), and a shape ranked on plain 1F1B alone would
    never reach the partitioner.
    """
    order = speed_order(cluster, devs)
    specs = [cluster.device(d).spec for d in order]
    nd, n = len(order), costs.num_blocks
    work = costs.compute[-1]
    big = max(costs.compute[i + 1] - costs.compute[i] for i in range(n))
    params, mem = costs.params[-1], costs.mem[-1]
    act = sum(costs.act[:-1]) / max(1, n - 1)
    mbs = costs.micro_batch_size
    out = []
    s_list = [pins["num_stages"]] if pins["num_stages"] else range(1, min(n, nd) + 1)
    for s in s_list:
        if pins["replicas"]:
            r_list = [pins["replicas"]]
        elif use_all:
            r_list = [nd // s] if nd % s == 0 else []
        else:
            r_list = sorted({r for r in range(1, nd // s + 1) if batch % r == 0})
        for r in r_list:
            if s * r > nd or batch % r:
                continue
            chunks = [specs[i * r : (i + 1) * r] for i in range(s)]
            speeds = [min(x.speed for x in c) for c in chunks]
            cap = min(min(x.memory_bytes for x in c) for c in chunks)
            ovh = max(x.overhead_ms for c in chunks for x in c)
            sum_sp = sum(speeds)
            g0 = order[:r]
            ar = cluster.allreduce_ms(g0, int(params / s)) if r > 1 else 0.0
            hop = xfer = 0.0  # fill latency of one hop; slowest cut's transfer per sample
            for c in range(s - 1):
                a, b = order[c * r], order[(c + 1) * r]
                ms = act / mbs / (cluster.bandwidth_gbps(a, b) * BYTES_PER_MS_PER_GBPS)
                if cluster.device(a).server != cluster.device(b).server:
                    ms *= r  # the replicas' transfers share the NIC
                hop = max(hop, cluster.latency_us(a, b) / 1e3 + ms * mbs)
                xfer = max(xfer, ms)
            # perfectly balanced stages, plus half a block of rounding on the slowest stage
            base = max(work / sum_sp + 0.5 * work / n / min(speeds), big / max(speeds))
            fixed = min(sum(costs.fixed(0, n)) / sum_sp, base)  # per-call part of base
            m_list = [pins["num_microbatches"]] if pins["num_microbatches"] else (
                microbatch_choices(batch, r, s)
            )

            def tau(samples: float, base=base, fixed=fixed, ovh=ovh, xfer=xfer) -> float:
                """One stage's forward + backward of ``samples``: compute- or link-bound."""
                return max(affine_ms(base, fixed, samples / mbs) + 2 * ovh, xfer * samples)

            k_pin, j_pin = pins["startup_slices"], pins["drain_slices"]
            limit = max_slices if s > 1 else 1  # one stage has no fill or drain to shorten
            for m in m_list:
                if (batch // r) % m or batch // (r * m) < max(k_pin or 1, j_pin or 1):
                    continue  # a pinned m, k or j this shape's replica batch cannot hold
                size = batch // (m * r)
                scale = size / mbs
                if m == 1:  # one micro-batch: startup slices only
                    est = _slice_term(s - 1, size, tau, k_pin, limit)
                else:
                    est = (m - 2) * tau(size) + sum(
                        _slice_term((s - 1) / 2, size, tau, pin, limit) for pin in (k_pin, j_pin)
                    )
                est += 2 * (s - 1) * hop * scale + ar
                need = params / s * (2 + optimizer_factor) + mem / s * scale * min(s, m)
                out.append(_Shape(s, r, m, est, need <= cap))
    return out


def _autopipe(
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    pins: dict,
    use_all: bool,
    max_slices: int,
    optimizer_factor: float,
) -> list[Proposal]:
    shapes = _shapes(costs, cluster, devs, batch, pins, use_all, optimizer_factor, max_slices)
    if not shapes:
        raise PlanError(
            f"no (stages x replicas) shape uses all {len(devs)} devices with global batch "
            f"{batch}; pick a device count with more divisors or drop use_all_devices"
        )
    shapes.sort(key=lambda x: (not x.fits, x.score))
    k_pin = pins["startup_slices"]
    picked: list[_Shape] = []
    per_shape: dict[tuple[int, int], int] = {}
    for sh in shapes:  # the best few, at most two micro-batch counts per (stages, replicas)
        key = (sh.stages, sh.replicas)
        if per_shape.get(key, 0) < 2:
            per_shape[key] = per_shape.get(key, 0) + 1
            picked.append(sh)
            if len(picked) == _LEVEL2:
                break
    level2 = []
    for sh in picked:
        ranked = rank_layouts(costs, cluster, devs, sh.stages, sh.replicas, batch,
                              sh.microbatches, k_pin or 1, optimizer_factor=optimizer_factor)
        level2 += [(mr, sh) for mr in ranked]
    level2.sort(key=lambda x: (not x[0].estimate.fits, x[0].estimate.iteration_ms))
    level3 = []
    spent = 0
    for n, (mr, sh) in enumerate(level2):
        m = sh.microbatches
        cost = _replay_cost(sh.stages, m, max_slices)
        budget = max(20, min(400, _REPLAY_BUDGET // cost))
        if n >= _LEVEL3 and spent + budget * cost > _LEVEL3_BUDGET:
            break  # beyond the best three, refine more layouts only while it is cheap
        spent += budget * cost
        groups = [list(g) for g in mr.layout.groups]
        for cuts, k, est in partition_and_slice(
            costs, mr.layout, batch, m, k_pin, max_slices, optimizer_factor=optimizer_factor,
            max_evaluations=budget,
        ):
            level3.append((est, Proposal(groups, cuts, m, k), mr.layout))
    level3.sort(key=lambda x: (not x[0].fits, x[0].iteration_ms))
    # Drain slices for the finalists only: the tail they shorten is the same for close
    # candidates, so choosing j earlier would multiply the partitioner's work for no change.
    # Each finalist also goes to the simulator without them (right after it), since link
    # contention the fast model ignores can make the extra messages cost more than they save.
    j_pin = pins.get("drain_slices")
    scored = []
    for est, prop, layout in level3[:_FINALISTS]:
        j, est_j = j_pin or 1, est
        if not j_pin:
            j, est_j = choose_drain_slices(
                costs, layout, prop.cuts, batch, prop.num_microbatches, prop.startup_slices,
                max_slices, optimizer_factor=optimizer_factor,
            )
        first = Proposal(prop.groups, prop.cuts, prop.num_microbatches, prop.startup_slices, j)
        scored.append((est_j, [first] + ([prop] if j != 1 and not j_pin else [])))
    scored.sort(key=lambda x: (not x[0].fits, x[0].iteration_ms))
    finalists = [p for _, props in scored for p in props]
    top = finalists[0]
    plain = (k_pin or 1, j_pin or 1)  # plain 1F1B of the favourite, for the same reason
    if (top.startup_slices, top.drain_slices) != plain:
        finalists.append(Proposal(top.groups, top.cuts, top.num_microbatches, *plain))
    return finalists
