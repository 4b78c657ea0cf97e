"""Planning reports: the plan table printed by the CLI, the recipes and every training run."""

from __future__ import annotations

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.profile import Profile

__all__ = ["format_plan", "plan_table"]


def _bytes(n: float) -> str:
    """Bytes in the unit that shows them (a 14 MB stage is ``13.4 MiB``, not ``0.0 GiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _ranks(indices: list[int]) -> str:
    """``rank 0`` / ``ranks 0-3`` / ``ranks 0,2``: the launched ranks that hold a stage."""
    if len(indices) == 1:
        return f"rank {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"ranks {indices[0]}-{indices[-1]}"
    return "ranks " + ",".join(map(str, indices))


def _short(names: list[str], width: int) -> str:
    text = ",".join(names)
    return text if len(text) <= width else text[: width - 3] + "..."


def _device_type(cluster: Cluster, devices: list[str]) -> str:
    """The stage's slowest device type and its speed, in words.

    A discovered cluster's types are named after the host's processor and numbered classes
    (``cpu AMD EPYC (slower 1)``), which say nothing to a user: its row names the ranks and
    the measured speed relative to the fastest rank. A declared type keeps its name and its
    declared speed relative to the reference profile.
    """
    order = {d.name: i for i, d in enumerate(cluster.devices)}
    spec = min((cluster.device(d).spec for d in devices), key=lambda x: x.speed)
    if cluster.name == "discovered":
        ranks = sorted(order[d] for d in devices if d in order)
        return _short([f"{_ranks(ranks)}, measured {spec.speed:.2f}x the fastest"], _TYPE_W)
    return _short([f"{spec.name}, {spec.speed:.2f}x the reference"], _TYPE_W)


_TYPE_W = 40


def format_plan(plan: Plan, profile: Profile, cluster: Cluster | None = None) -> str:
    """A readable table of a plan: one row per stage, then the predicted step.

    With the ``cluster`` each stage also shows the device type that holds it and that type's
    speed (measured, for a discovered cluster).
    """
    reps = [s.replicas for s in plan.stages]
    rep = str(reps[0]) if len(set(reps)) == 1 else "/".join(map(str, reps))
    per = plan.global_batch_size / (plan.num_microbatches * max(reps))  # even share
    lines = [
        f"plan ({plan.planner}) for {plan.model or profile.model}: {plan.num_stages} stages x "
        f"{rep} replicas, global batch {plan.global_batch_size} = {plan.num_microbatches} "
        f"micro-batches of {per:g} samples per replica, {plan.startup_slices} startup "
        f"slice{'s' if plan.startup_slices != 1 else ''}, {plan.drain_slices} drain "
        f"slice{'s' if plan.drain_slices != 1 else ''}, schedule {plan.schedule}",
    ]
    v = plan.chunks_per_rank
    if v > 1:  # the stages are chunks: say which rank position holds which
        held = "; ".join(f"rank {r}: {plan.rank_stages(r)}" for r in range(plan.num_ranks))
        lines[0] = lines[0].replace(f"{plan.num_stages} stages x",
                                    f"{plan.num_ranks} ranks x {v} chunks x")
        lines.append(f"{v} chunks per rank ({plan.placement} placement), rank -> chunks: "
                     f"{held}")
    typed = cluster is not None and all(
        d in {x.name for x in cluster.devices} for d in plan.devices)
    kind = f" {'device type (speed)':<{_TYPE_W}}" if typed else ""
    col = "stage" if v == 1 else "chunk"
    head = (f"{col:>5}  {'blocks':<11} {'first .. last block':<44} {'devices':<28}{kind} "
            f"{'stage ms':>9}  {'peak memory':>11}")
    lines += [head, "-" * len(head)]
    names = profile.names
    for s, st in enumerate(plan.stages):
        i, j = st.blocks
        span = names[i] if j - i == 1 else f"{names[i]} .. {names[j - 1]}"
        if len(span) > 44:
            span = span[:41] + "..."
        peak = max((plan.peak_memory_bytes.get(d, 0) for d in st.devices), default=0)
        dev = f" {_device_type(cluster, st.devices):<{_TYPE_W}}" if typed else ""
        lines.append(
            f"{s:>5}  {f'[{i}, {j})':<11} {span:<44} {_short(st.devices, 28):<28}{dev} "
            f"{st.stage_ms:>9.2f}  {_bytes(peak):>11}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"predicted iteration {plan.iteration_ms:.1f} ms | bubble {plan.bubble_fraction:.1%} | "
        f"balance {plan.balance:.3f} (max/mean stage ms) | search {plan.search_ms:.0f} ms"
    )
    lines += [f"note: {n}" for n in plan.search_notes]
    lines += _shares(plan)
    redone = [s for s in range(plan.num_stages) if plan.recomputes(s)]
    if redone:
        lines.append(f"note: stages {redone} recompute their activations in backward (no plan "
                     "fits device memory without; priced as one more forward per unit)")
    return "\n".join(lines)


def plan_table(plan: Plan, profile: Profile | None, cluster: Cluster | None = None) -> str:
    """:func:`format_plan` when the profile is known, else the stages and the prediction only.

    A run given a saved plan has no profile (nothing was measured), so the block names and
    per-stage figures are unknown; the layout and the plan's own prediction still are.
    """
    if profile is not None:
        return format_plan(plan, profile, cluster)
    rows = [
        f"  stage {s}: blocks [{st.blocks[0]}, {st.blocks[1]}) on {', '.join(st.devices)}"
        for s, st in enumerate(plan.stages)
    ]
    head = (
        f"AutoPipe plan ({plan.planner}): {plan.num_stages} stages x {plan.replicas} replicas, "
        f"{plan.num_microbatches} micro-batches, {plan.startup_slices} startup / "
        f"{plan.drain_slices} drain slices, predicted {plan.iteration_ms:.1f} ms/step"
    )
    redone = [s for s in range(plan.num_stages) if plan.recomputes(s)]
    tail = [f"  stages {redone} recompute their activations in backward"] if redone else []
    return "\n".join([head, *rows, *_shares(plan), *tail])


def _shares(plan: Plan) -> list[str]:
    """The uneven replica batches, if any, as a note line."""
    if not plan.replica_batches:
        return []
    each = ", ".join(f"replica {i} ({plan.stages[0].devices[i]}): {n}"
                     for i, n in enumerate(plan.replica_batches))
    return [f"note: uneven replica batches (samples per step, slower replicas fewer): {each}"]
