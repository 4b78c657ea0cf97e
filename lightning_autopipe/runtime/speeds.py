"""Device speeds measured in training, the cluster they describe, and whether to re-plan.

A plan is made from a profile taken while every rank profiles flat out; a rank that shares its
device (another job, a neighbour on its core, a throttled card) trains at another speed, and
one whose conditions change during the run drifts away from its plan. The step monitor
(:mod:`~lightning_autopipe.runtime.monitor`) gives each rank's speed from its measured compute
over a window of steps (a median: one slow step does not move it); here those speeds become a
:class:`~lightning_autopipe.cluster.Cluster` the planner can plan for (:func:`measured_cluster`),
and :func:`decide_replan` says, as a pure function of the measurements, the current plan and a
planner call, whether a plan for the measured speeds would pay for switching to it.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.hardware import DeviceSpec
from lightning_autopipe.profile import Profile
from lightning_autopipe.runtime.monitor import WARMUP_STEPS

__all__ = ["ReplanDecision", "check_due", "decide_replan", "measured_cluster",
           "measured_speeds", "same_layout", "scaled_profile", "speeds_moved"]

_SAME = 0.05  # speed ratios within 5% of each other (or of 1) are one device type
_SCALED = re.compile(r"(.+) x(\d+(?:\.\d+)?)")  # a type measured at a ratio of its base


def measured_speeds(summaries: Sequence[Any], plan: Any) -> dict[str, float]:
    """Device name -> measured / planned speed, from every rank's
    :class:`~lightning_autopipe.runtime.monitor.RankSummary` (a rank drives the plan's device
    at its stage and replica)."""
    out: dict[str, float] = {}
    for s in summaries:
        ratio = s.speed_ratio
        if not math.isfinite(ratio) or ratio <= 0:
            continue
        stage = plan.stages[s.stage]
        out[stage.devices[s.replica]] = float(ratio)
    return out


def scaled_profile(profile: Profile, ratio: float) -> Profile:
    """``profile`` on a device ``ratio`` times as fast (every time divided by it)."""
    blocks = []
    for b in profile.blocks:
        split = {}
        if b.backward_input_ms is not None and b.backward_weight_ms is not None:
            split = {"backward_input_ms": b.backward_input_ms / ratio,
                     "backward_weight_ms": b.backward_weight_ms / ratio}
        blocks.append(replace(b, forward_ms=b.forward_ms / ratio,
                              backward_ms=b.backward_ms / ratio,
                              forward_fixed_ms=b.forward_fixed_ms / ratio,
                              backward_fixed_ms=b.backward_fixed_ms / ratio, **split))
    return Profile(profile.model, profile.micro_batch_size, profile.device, blocks,
                   profile.fingerprint)


def measured_cluster(cluster: Cluster, ratios: Mapping[str, float]) -> Cluster:
    """``cluster`` with each device's speed multiplied by its measured ratio.

    Devices of one type whose ratios agree within 5% stay one type (at their median ratio; the
    original spec where that is within 5% of 1); others become types of their own, named
    ``"<type> x<ratio>"``. A type with its own profile gets that profile scaled. Links, memory
    and device names are unchanged; every server instance becomes a server of its own so one
    instance's devices can differ from another's.
    """
    by_type: dict[str, list[tuple[float, str]]] = {}
    for d in cluster.devices:
        by_type.setdefault(d.spec.name, []).append((float(ratios.get(d.name, 1.0)), d.name))
    new_spec: dict[str, DeviceSpec] = {}
    for members in by_type.values():
        for group in _groups(sorted(members)):
            ratio = statistics.median(r for r, _ in group)
            spec = cluster.device(group[0][1]).spec
            if abs(ratio - 1.0) > _SAME:
                spec = _scaled_spec(spec, ratio)
            for _, name in group:
                new_spec[name] = spec
    servers = []
    for inst, spec in cluster.instances:
        own = [new_spec[f"{inst}:{i}"] for i in range(spec.gpus)]
        base = own[0]
        servers.append(replace(spec, name=inst, count=1, device=base,
                               devices=tuple((i, s) for i, s in enumerate(own) if s != base)))
    return Cluster(name=f"{cluster.name} (measured)", network_gbps=cluster.network_gbps,
                   network_latency_us=cluster.network_latency_us, servers=servers)


def speeds_moved(ratios: Mapping[str, float]) -> bool:
    """Does a device measure more than 5% away from the speed its plan assumed (so that
    :func:`measured_cluster` changes its type)?"""
    return any(math.isfinite(r) and abs(r - 1.0) > _SAME for r in ratios.values())


def _groups(members: list[tuple[float, str]]) -> list[list[tuple[float, str]]]:
    """Sorted (ratio, device) pairs cut where a ratio exceeds its group's first by over 5%."""
    out: list[list[tuple[float, str]]] = []
    for r, name in members:
        if out and r <= out[-1][0][0] * (1 + _SAME):
            out[-1].append((r, name))
        else:
            out.append([(r, name)])
    return out


def _scaled_spec(spec: DeviceSpec, ratio: float) -> DeviceSpec:
    """``spec`` ``ratio`` times as fast, named ``"<type> x<ratio>"``: a type already scaled
    (a pipeline re-planned or re-calibrated before) keeps its base name, with the product of
    its ratios, so measuring again does not lengthen the name."""
    profile = scaled_profile(spec.profile, ratio) if spec.profile is not None else None
    base, total = spec.name, ratio
    found = _SCALED.fullmatch(spec.name)
    if found is not None:
        base, total = found[1], float(found[2]) * ratio
    return replace(spec, name=f"{base} x{total:.2f}", speed=spec.speed * ratio,
                   overhead_ms=spec.overhead_ms / ratio, profile=profile, profile_path=None)


def same_layout(a: Any, b: Any, *, batches: bool = True) -> bool:
    """Two plans that run the same way (stages, devices, counts, schedule, recomputation and,
    with ``batches``, replica batches)."""

    def key(p: Any) -> tuple:
        return (tuple((tuple(s.blocks), tuple(s.devices)) for s in p.stages), p.num_microbatches,
                p.startup_slices, p.drain_slices, p.schedule, tuple(p.recompute),
                tuple(getattr(p, "replica_batches", ())) if batches else ())

    return key(a) == key(b)


@dataclass(frozen=True)
class ReplanDecision:
    """Whether to switch plans, and the figures that decided it.

    Times are ms per step; ``measured_ms_per_sample`` / ``candidate_ms_per_sample`` compare
    plans whose global batches differ (more replicas train more samples per step).
    ``candidate_step_ms`` and ``running_predicted_ms`` are both plans' steps predicted on the
    measured cluster; ``expected_step_ms`` the candidate's step expected in training (the
    measured step times their ratio).
    """

    switch: bool
    reason: str
    measured_step_ms: float
    candidate: Any = None
    candidate_step_ms: float = math.nan
    running_predicted_ms: float = math.nan
    expected_step_ms: float = math.nan
    measured_ms_per_sample: float = math.nan
    candidate_ms_per_sample: float = math.nan
    switch_cost_ms: float = 0.0
    remaining_steps: int = 0
    speeds: Mapping[str, float] | None = None


def check_due(steps_since_switch: int, options: Any, warmup: int | None = None) -> bool:
    """Is the step boundary ``steps_since_switch`` steps into a plan a re-plan check?

    Every ``options.replan_window`` steps counted after the plan's ``warmup`` steps
    (:data:`~lightning_autopipe.runtime.monitor.WARMUP_STEPS`, which the monitor keeps out of
    its window), so each check sees a window of steps that none before it saw, and no sooner
    than ``options.replan_min_steps`` steps into the plan.
    """
    measured = steps_since_switch - (WARMUP_STEPS if warmup is None else warmup)
    window = options.replan_window
    return (options.replan != "off" and steps_since_switch >= options.replan_min_steps
            and measured >= window and measured % window == 0)


def decide_replan(
    summaries: Sequence[Any],
    plan: Any,
    cluster: Cluster,
    planner: Callable[[Cluster], Any],
    *,
    predict: Callable[[Any, Cluster], float],
    options: Any,
    switch_cost_ms: float,
    remaining_steps: int,
    steps_since_switch: int,
    rebalance: Callable[[Cluster], Any] | None = None,
) -> ReplanDecision:
    """Should every rank switch to a plan made for the measured speeds?

    Yes when, with ``options.replan == "auto"``, at least ``options.replan_min_steps`` steps
    since the last switch (or the start) and a full window of ``options.replan_window`` steps
    measured on every rank, the plan ``planner(measured_cluster(...))`` returns differs from
    ``plan`` and, per sample, its expected step plus ``switch_cost_ms`` spread over the
    ``remaining_steps`` is below the measured step by more than ``options.replan_threshold``
    (a fraction). The measured step is the slowest rank's median (the pipeline's step).

    The expected step is the measured one times the candidate's predicted step over the
    running plan's, both predicted on the measured cluster (``predict``): what the measured
    speeds do not explain (a neighbour that also slows the messages, a core shared by two
    ranks, per-step overheads) then slows both plans alike, instead of making any other plan
    look faster than the running one merely because its step is a prediction and the running
    one's a measurement.

    Re-balancing is the cheap step of the escalation: when the plan made for the measured speeds
    does not clear the bar (another layout, whose prediction differs more from the running
    one's), the running layout with its replica batches re-dealt for the measured speeds
    (``rebalance``: no state moves) is judged by the same rule. The bar is the same: measured
    speeds are noisy, and a lower one re-deals on that noise (4 ranks on 2 cores: at every
    check).

    Args:
        summaries: every rank's :class:`~lightning_autopipe.runtime.monitor.RankSummary`.
        plan, cluster: the running plan and the cluster it was made for.
        planner: measured cluster -> plan (e.g. ``search_plan`` with the run's pins); only
            called when the other conditions hold.
        predict: (plan, cluster) -> predicted step ms (the simulator on the run's profile).
        options: an :class:`~lightning_autopipe.options.AutoPipeOptions` (its ``replan*``).
        switch_cost_ms: what a switch costs (migration and rebuild), ms.
        remaining_steps: training steps left after the switch.
        steps_since_switch: steps run under the current plan.
        rebalance: measured cluster -> the running plan with replica batches for it (or the
            plan unchanged), tried when the searched plan does not switch.
    """
    measured = max((s.step_ms for s in summaries), default=math.nan)
    base = {"measured_step_ms": measured, "switch_cost_ms": float(switch_cost_ms),
            "remaining_steps": int(remaining_steps)}
    if options.replan == "off":
        return ReplanDecision(False, "replan='off'", **base)
    if steps_since_switch < options.replan_min_steps:
        return ReplanDecision(False, f"{steps_since_switch} steps since the last switch, fewer "
                              f"than replan_min_steps={options.replan_min_steps}", **base)
    short = min((s.steps for s in summaries), default=0)
    if short < options.replan_window or not math.isfinite(measured):
        return ReplanDecision(False, f"{short} steps measured, fewer than "
                              f"replan_window={options.replan_window}", **base)
    if remaining_steps <= 0:
        return ReplanDecision(False, "no steps remain to pay for a switch", **base)
    speeds = measured_speeds(summaries, plan)
    now = measured_cluster(cluster, speeds)
    running_ms = float(predict(plan, now))
    context = (measured, running_ms, now, predict, switch_cost_ms, remaining_steps, speeds, base)
    decision = _judge(planner(now), plan, options, context)
    if decision.switch or rebalance is None or plan.stages[0].replicas < 2:
        return decision
    again = rebalance(now)
    if same_layout(again, plan) or not same_layout(again, plan, batches=False):
        return decision
    other = _judge(again, plan, options, context)
    return other if other.switch else decision


def _judge(candidate: Any, plan: Any, options: Any, context: tuple) -> ReplanDecision:
    """:func:`decide_replan`'s rule for one candidate (a re-balance of the running layout is
    named so in the reason)."""
    measured, running_ms, now, predict, switch_cost_ms, remaining_steps, speeds, base = context
    candidate_ms = float(predict(candidate, now))
    expected = measured * candidate_ms / running_ms if running_ms > 0 else math.inf
    per_now = measured / plan.global_batch_size
    per_new = expected / candidate.global_batch_size
    amortised = (expected + switch_cost_ms / remaining_steps) / candidate.global_batch_size
    full = {**base, "candidate": candidate, "candidate_step_ms": candidate_ms,
            "running_predicted_ms": running_ms, "expected_step_ms": float(expected),
            "measured_ms_per_sample": per_now, "candidate_ms_per_sample": per_new,
            "speeds": speeds}
    if same_layout(candidate, plan):
        return ReplanDecision(False, "the plan for the measured speeds is the running one",
                              **full)
    name, threshold = "replan_threshold", float(options.replan_threshold)
    what = ("the running layout with replica batches for the measured speeds"
            if same_layout(candidate, plan, batches=False) else "a plan for the measured speeds")
    limit = per_now * (1.0 - threshold)
    gain = 1.0 - amortised / per_now
    figures = (f"(predicted on the measured speeds: {candidate_ms:.0f} ms against "
               f"the running plan's {running_ms:.0f} ms, which measures {measured:.0f} ms)")
    if amortised < limit:
        return ReplanDecision(True, f"{what} is expected {gain:.1%} faster per sample than the "
                              f"measured step, switch cost included ({name} {threshold:.1%}) "
                              f"{figures}", **full)
    return ReplanDecision(False, f"{what} gains {gain:.1%} per sample with the switch cost, not "
                          f"more than {name}={threshold:.1%} {figures}", **full)
