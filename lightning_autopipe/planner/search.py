"""The plan search's entry points: :func:`make_plan` for one shape space, :func:`search_plan`
for a launched world; every planner's answer scored by the same simulator.

:func:`make_plan` is the one entry point the strategy, the CLI and the benchmark call. For
``planner="autopipe"`` the proposals come from :mod:`~.autopipe` (levels 1-3: closed-form
shapes, placements, partitions and slices); the yardstick planners (:mod:`~.baselines`) answer
with proposals of their own. Level 4: when cheap enough, the simulator
(:func:`~.simulate.simulate`, link contention included) picks among the best proposals;
otherwise the fast model's favourite stands.

``search_ms`` is the time to choose the plan (filling the chosen plan's figures is not part;
the memory fallback below, which chooses among simulated plans, is).

Activation recomputation is the last resort: only when no finalist fits device memory are
its stages that do not fit made to recompute their activations (under a schedule that does
not split the backward), priced by the same simulator; when that does not fit either,
AutoPipe's cuts are walked to ones that fit with recomputation (:mod:`~.memwalk`: cuts chosen
for time can leave one stage too big for any recomputation). :func:`search_plan` prefers any
depth that fits without it.

AutoPipe gives every stage the same replica count (what the runtime executes); DAPPLE and Piper
may replicate stages unevenly unless ``uniform_replicas``. Every planner's result is scored by
the same simulator and returned as the same :class:`Plan`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import replace

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import MemoryPlanError, PlanError
from lightning_autopipe.planner.autopipe import autopipe_proposals
from lightning_autopipe.planner.baselines import propose
from lightning_autopipe.planner.generators import schedule_generator, splits_backward
from lightning_autopipe.planner.inputs import check_inputs
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.memwalk import fitting_cuts
from lightning_autopipe.planner.plan import Plan, Proposal
from lightning_autopipe.planner.polish import bound_many, evaluate_many, polish
from lightning_autopipe.planner.replica_batches import balance_replicas, predicted
from lightning_autopipe.planner.vsearch import (
    choice_note,
    chunked_proposals,
    one_chunk,
    optimistic_ms,
    proposal_stages,
)
from lightning_autopipe.profile import Profile

__all__ = ["make_plan", "search_plan", "PLANNERS", "finish_plan"]

PLANNERS = ("autopipe", "dapple", "piper", "time", "parameters", "uniform", "optimal")
GiB = 2**30
_SIM_BUDGET = 3000  # devices x units: simulate finalists only while their sum stays below


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
    schedules: Sequence[str] = ("1f1b", "zb-h1"),
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
        schedules: the schedules AutoPipe may choose among (the yardsticks run 1F1B);
            ``interleaved-1f1b`` and ``zbv`` add plans of several chunks per rank (vsearch).

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
    devs = check_inputs(profile, cluster, global_batch_size, devices, num_stages, replicas,
                        num_microbatches, startup_slices, use_all_devices, drain_slices)
    costs = BlockCosts.from_profile(profile, cluster)
    pins = dict(num_stages=num_stages, replicas=replicas, num_microbatches=num_microbatches,
                startup_slices=startup_slices, drain_slices=drain_slices)
    excluded = 0.0
    notes: list[str] = []
    if planner == "autopipe":
        for name in schedules:
            schedule_generator(name)  # ScheduleError naming the known ones
        props = autopipe_proposals(costs, cluster, devs, global_batch_size, pins, use_all_devices,
                                   max_startup_slices, optimizer_factor, one_chunk(schedules))
        notes = _polish_favourite(props, costs, cluster, global_batch_size, optimizer_factor)
        props = chunked_proposals(props, costs, cluster, global_batch_size, optimizer_factor,
                                  schedules, pins)
    else:
        props, excluded = propose(
            planner, profile, costs, cluster, devs, global_batch_size, pins=pins,
            uniform_replicas=uniform_replicas, use_all_devices=use_all_devices,
            optimizer_factor=optimizer_factor, max_startup_slices=max_startup_slices,
            schedules=one_chunk(schedules),
        )
        for p in props:  # pinned slices apply to every planner's layout
            p.startup_slices = startup_slices or p.startup_slices
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
        plans = _simulate_finalists(chosen, planner, profile, costs, cluster, global_batch_size,
                                    optimizer_factor)
        search_ms = (time.perf_counter() - t0) * 1e3 - excluded
    else:
        search_ms = (time.perf_counter() - t0) * 1e3 - excluded
        plans = [finish_plan(props[0], planner, profile, cluster, global_batch_size,
                             optimizer_factor)]
    fitting = [p for p in plans if _fits(p, cluster)]
    if not fitting:  # recomputation only when nothing fits without it (part of the search)
        fallback_t0 = time.perf_counter()
        redone = [r for p in plans if (r := _recomputing(p, profile, cluster, global_batch_size,
                                                         optimizer_factor, schedules, planner))]
        fitting = [p for p in redone if _fits(p, cluster)]
        if not fitting and planner == "autopipe":  # other cuts may fit where these do not
            moved = [r for p in plans if (r := _recomputing_elsewhere(
                p, profile, costs, cluster, global_batch_size, optimizer_factor, schedules))]
            fitting = [p for p in moved if _fits(p, cluster)]
            redone += moved
        plans = redone or plans
        search_ms += (time.perf_counter() - fallback_t0) * 1e3
    best = min(fitting or plans, key=lambda p: p.iteration_ms)
    if memory_check and not fitting:
        raise _memory_error(best, cluster, global_batch_size)
    best.search_ms = search_ms
    best.search_notes = notes + choice_note(best, fitting or plans, props, lambda p: optimistic_ms(
        p, costs, cluster, global_batch_size, optimizer_factor), simulated=plans)
    return best


def _simulate_finalists(
    chosen: list[Proposal], planner: str, profile: Profile, costs: BlockCosts, cluster: Cluster,
    batch: int, optimizer_factor: float,
) -> list[Plan]:
    """The finalists as simulated plans, skipping those that cannot win.

    Once a simulated finalist fits memory, a later one is simulated only if its optimistic
    replay (every stage on its fastest replica over uncontended links, the whole step
    replayed: a lower bound of the simulator) does not exceed the best fitting step so far;
    the others could not be chosen (the fastest fitting plan is), so skipping them changes
    nothing but the time spent.
    """
    plans: list[Plan] = []
    best = float("inf")
    for p in chosen:
        if best < float("inf") and optimistic_ms(
                p, costs, cluster, batch, optimizer_factor) * (1 - 1e-9) > best:
            continue
        plan = finish_plan(p, planner, profile, cluster, batch, optimizer_factor)
        plans.append(plan)
        if _fits(plan, cluster):
            best = min(best, plan.iteration_ms)
    return plans


def _polish_favourite(
    props: list[Proposal], costs: BlockCosts, cluster: Cluster, batch: int,
    optimizer_factor: float,
) -> list[str]:
    """Walk the fast model's favourite to the local optimum :func:`~.polish.polish` reaches;
    the simulator then judges it against the other finalists as usual. Returns what to note
    on the plan (that the walk stopped at its sweep budget)."""
    top = props[0]
    layout = Layout.from_cluster(cluster, top.groups)
    step = top.step_shape(batch, optimizer_factor)
    walk = polish(top.cuts, functools.partial(evaluate_many, costs, layout, step=step),
                  functools.partial(bound_many, costs, layout, step=step))
    props[0] = replace(top, cuts=walk.cuts)
    if walk.at_budget:
        return [f"the final local search over the cuts stopped at its budget of {walk.sweeps} "
                f"sweeps while its last sweep still gained {walk.last_gain:.3%} (a better "
                "partition may lie further)"]
    return []


def _proposal_of(plan: Plan) -> Proposal:
    """The proposal ``plan`` was made from (its devices, cuts, step and schedule), for a plan
    of one chunk per rank (the plans that may recompute)."""
    return Proposal([list(st.devices) for st in plan.stages], plan.cuts, plan.num_microbatches,
                    plan.startup_slices, plan.drain_slices, plan.schedule,
                    plan.chunks_per_rank, plan.placement)


def _recomputing(
    plan: Plan, profile: Profile, cluster: Cluster, batch: int, optimizer_factor: float,
    schedules: Sequence[str], planner: str,
) -> Plan | None:
    """``plan`` with every stage that does not fit memory recomputing its activations, under
    1F1B when its own schedule splits the backward (None when that is not allowed)."""
    if plan.chunks_per_rank > 1:  # recomputation runs with one chunk per rank only
        return None
    over = [any(plan.peak_memory_bytes.get(d, 0) > cluster.device(d).spec.memory_bytes
                for d in st.devices) for st in plan.stages]
    schedule = plan.schedule
    if splits_backward(schedule):
        if planner == "autopipe" and "1f1b" not in schedules:
            return None
        schedule = "1f1b"
    return finish_plan(replace(_proposal_of(plan), schedule=schedule), plan.planner, profile,
                       cluster, batch, optimizer_factor, recompute=over)


def _recomputing_elsewhere(
    plan: Plan, profile: Profile, costs: BlockCosts, cluster: Cluster, batch: int,
    optimizer_factor: float, schedules: Sequence[str],
) -> Plan | None:
    """The fastest plan at the cuts :func:`~.memwalk.fitting_cuts` finds for ``plan``'s
    devices and step, each as it is where it fits, else recomputing its stages that do not
    fit (:func:`_recomputing`); None when it finds no cuts that fit, or where
    :func:`_recomputing` may not recompute."""
    if splits_backward(plan.schedule) and "1f1b" not in schedules:
        return None
    prop = _proposal_of(plan)
    found = []
    for cuts in fitting_cuts(prop, costs, cluster, batch, optimizer_factor):
        moved = finish_plan(replace(prop, cuts=cuts), plan.planner, profile, cluster, batch,
                            optimizer_factor)
        if not _fits(moved, cluster):
            moved = _recomputing(moved, profile, cluster, batch, optimizer_factor, schedules,
                                 plan.planner)
        if moved is not None and _fits(moved, cluster):
            found.append(moved)
    return min(found, key=lambda p: p.iteration_ms, default=None)


def finish_plan(
    prop: Proposal,
    planner: str,
    profile: Profile,
    cluster: Cluster,
    batch: int,
    optimizer_factor: float = 2.0,
    recompute: Sequence[bool] = (),
) -> Plan:
    """Turn a proposal into a Plan carrying the simulator's predictions (``recompute``: the
    stages that recompute their activations)."""
    plan = Plan(planner, batch, prop.num_microbatches, prop.startup_slices,
                proposal_stages(prop), model=profile.model, fingerprint=profile.fingerprint,
                drain_slices=prop.drain_slices, schedule=prop.schedule,
                recompute=list(recompute) if any(recompute) else [],
                chunks_per_rank=prop.chunks_per_rank, placement=prop.placement)
    return predicted(plan, profile, cluster, optimizer_factor)


def search_plan(
    profile: Profile,
    cluster: Cluster,
    devices: Sequence[str],
    replica_batch: int,
    *,
    planner: str = "autopipe",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    startup_slices: int | None = None, drain_slices: int | None = None,
    schedules: Sequence[str] = ("1f1b", "zb-h1"),
    optimizer_factor: float = 2.0,
    balance: bool = True,
) -> Plan:
    """The plan with the most samples/s that uses every launched device.

    The dataloader's batch is one replica's (as with DDP), so a layout with ``R`` replicas
    trains a global batch of ``replica_batch * R``; each pipeline depth dividing the world size
    (or the pinned one) is planned and the fastest per sample wins (:func:`make_plan`'s args).
    With ``balance``, replicas of unlike speed train uneven shares of that global batch when
    the simulator predicts it faster (:func:`~.replica_batches.balance_replicas`).
    """
    world = len(devices)
    if num_stages is not None and world % num_stages:
        raise PlanError(
            f"num_stages={num_stages} does not divide the {world} launched processes; every "
            "stage needs the same number of replicas: pick a divisor of the world size"
        )
    depths = [num_stages] if num_stages else [s for s in range(1, world + 1) if world % s == 0]
    best: tuple[bool, float, Plan] | None = None  # (fits without recomputation, rate, plan)
    failures: list[str] = []
    kinds: set[type] = set()
    for depth in depths:
        replicas = world // depth
        try:
            plan = make_plan(
                profile, cluster, replica_batch * replicas, planner=planner, num_stages=depth,
                replicas=replicas, num_microbatches=num_microbatches,
                startup_slices=startup_slices, drain_slices=drain_slices,
                devices=list(devices), uniform_replicas=True, use_all_devices=True,
                schedules=schedules, optimizer_factor=optimizer_factor,
            )
        except PlanError as exc:
            failures.append(f"{depth} stages x {replicas} replicas: {exc}")
            kinds.add(type(exc))
            continue
        if balance and replicas > 1:
            plan = balance_replicas(plan, profile, cluster, optimizer_factor)
        rate = replica_batch * replicas / max(plan.iteration_ms, 1e-9)
        key = (not any(plan.recompute), rate, plan)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        cls = kinds.pop() if len(kinds) == 1 else PlanError  # e.g. MemoryPlanError everywhere
        raise cls("no plan fits the launched devices: " + " | ".join(failures))
    return best[2]


# ---------------------------------------------------------------------------- checks
def _fits(plan: Plan, cluster: Cluster) -> bool:
    return all(b <= cluster.device(d).spec.memory_bytes for d, b in plan.peak_memory_bytes.items())


def _memory_error(plan: Plan, cluster: Cluster, batch: int) -> MemoryPlanError:
    over = max(plan.peak_memory_bytes,
               key=lambda d: plan.peak_memory_bytes[d] / cluster.device(d).spec.memory_bytes)
    need, have = plan.peak_memory_bytes[over], cluster.device(over).spec.memory_bytes
    held = [i for i, st in enumerate(plan.stages) if over in st.devices]
    redone = [i for i, r in enumerate(plan.recompute) if r]
    replicas = plan.stages[0].replicas
    v = plan.chunks_per_rank
    depth = (f"{plan.num_stages} stages" if v == 1 else
             f"{plan.num_ranks} ranks x {v} chunks")
    where = (f"stage {held[0]}, blocks {list(plan.stages[held[0]].blocks)}" if len(held) == 1
             else f"chunks {held}, blocks {[list(plan.stages[c].blocks) for c in held]}")
    return MemoryPlanError(
        f"no plan fits device memory{f' even with stages {redone} recomputing' if redone else ''}"
        f": the best plan ({depth}, "
        f"{replicas} replica{'s' if replicas != 1 else ''}, {plan.num_microbatches} "
        f"micro-batches of global batch {batch}) needs {need / GiB:.2f} GiB on {over} ({where})"
        f" which has {have / GiB:.2f} GiB; use more "
        "stages, a smaller micro-batch (more micro-batches or a smaller batch), more devices, "
        "or pass memory_check=False to get the plan anyway"
    )


