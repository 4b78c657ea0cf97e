"""Step telemetry, speeds from training and the re-plan decision, on synthetic timelines.

Timelines are built from the simulator's own compute events for each rank (so a rank running
at its planned speed measures exactly the predicted compute), with a rank's compute stretched
on purpose to make it slower by a known factor and one step stretched far more (the window's
median must not move). The reference for a measured cluster is the same cluster declared by
hand with the slowed device's speed.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile
from lightning_autopipe.runtime.monitor import (
    WARMUP_STEPS,
    RankSummary,
    StepMonitor,
    StepRecord,
    breakdown,
    predict_rank,
    predicted_compute,
    summarise,
)
from lightning_autopipe.runtime.speeds import (
    check_due,
    decide_replan,
    measured_cluster,
    measured_speeds,
    same_layout,
    speeds_moved,
)

BATCH = 16


def _profile(n: int = 8) -> Profile:
    return Profile("toy", 2, "test",
                   [BlockProfile(f"b{i}", 2.0, 4.0, 1000, 1000, 1000) for i in range(n)])


def _cluster(slow: float = 1.0) -> Cluster:
    """Two local devices; ``local:1`` at ``slow`` (declared by hand: the reference)."""
    data = Cluster.local(2, gbps=100.0, latency_us=1.0).to_dict()
    if slow != 1.0:
        spec = dict(data["servers"][0]["device"], name="cpu-slow", speed=slow)
        data["servers"][0]["devices"] = {1: spec}
    return Cluster.from_dict(data)


def _plan(cluster: Cluster, **pins):
    names = [d.name for d in cluster.devices]
    return search_plan(_profile(), cluster, names, BATCH, num_stages=2, **pins)


def _timeline(sim, device: str, stretch: float, wait_ms: float = 1.0):
    """The device's compute events as executor actions laid end to end (``stretch`` x their
    predicted length), each after a ``wait_ms`` receive, in seconds."""
    t, out = 100.0, []
    events = sorted((e for e in sim.events if e.device == device and e.kind in "FBW"),
                    key=lambda e: e.start_ms)
    for e in events:
        recv = Action(e.stage, Kind.RECV_F, 0)
        out.append((recv, t, t + wait_ms / 1e3))
        t += wait_ms / 1e3
        dur = (e.end_ms - e.start_ms) * stretch / 1e3
        out.append((Action(e.stage, Kind(e.kind), *e.unit), t, t + dur))
        t += dur
    return out, t


def _summaries(plan, cluster, stretch: dict[int, float], steps: int = 9, outlier: int = 4,
               step_ms: float | None = None) -> list[RankSummary]:
    """Every rank's window of ``steps`` synthetic steps; step ``outlier`` runs 10x slower."""
    profile = _profile()
    sim = simulate(plan, profile, cluster)
    out = []
    for rank, (s, stage) in enumerate((s, st) for s, st in enumerate(plan.stages)
                                      for _ in st.devices):
        device = stage.devices[0]
        pred = predict_rank(plan, profile, cluster, device, sim)
        records = []
        for i in range(steps):
            k = stretch.get(rank, 1.0) * (10.0 if i == outlier else 1.0)
            tl, end = _timeline(sim, device, k)
            t1 = end + 0.002
            ms = step_ms if step_ms is not None else None
            records.append(StepRecord(i, breakdown(tl, 99.0, t1, ms), 1 << 20))
        out.append(summarise(records, pred, rank, s))
    return out


# ------------------------------------------------------------------------------ breakdown
def test_breakdown_sums_each_kind_and_the_tail():
    tl = [(Action(0, Kind.RECV_F, 0), 0.0, 0.001), (Action(0, Kind.FORWARD, 0), 0.001, 0.004),
          (Action(0, Kind.SEND_F, 0), 0.004, 0.0045), (Action(0, Kind.RECV_B, 0), 0.0045, 0.006),
          (Action(0, Kind.BACKWARD, 0), 0.006, 0.012), (Action(0, Kind.WEIGHT, 0), 0.012, 0.014),
          (Action(0, Kind.SEND_B, 0), 0.014, 0.015)]
    b = breakdown(tl, -0.001, 0.020)
    got = b.as_dict()
    want = {"F": 3.0, "B": 6.0, "W": 2.0, "RF": 1.0, "RB": 1.5, "SF": 0.5, "SB": 1.0,
            "sync": 5.0, "step": 21.0}
    assert got == pytest.approx(want)
    assert b.compute_ms == pytest.approx(11.0)
    assert breakdown(tl, 0.0, 0.02, step_ms=7.5).step_ms == 7.5  # a CUDA-event step time


def test_predicted_compute_is_the_simulators_busy_time_per_device():
    cluster = _cluster()
    plan = _plan(cluster)
    sim = simulate(plan, _profile(), cluster)
    for d in cluster.devices:
        comp = predicted_compute(sim, d.name)
        assert sum(comp.values()) == pytest.approx(sim.busy_ms[d.name])


# --------------------------------------------------------------------------------- speeds
@pytest.mark.parametrize("slow", [0.5, 0.8])
def test_the_speed_estimate_recovers_a_known_slowdown_despite_one_slow_step(slow):
    cluster = _cluster()
    plan = _plan(cluster)
    summ = _summaries(plan, cluster, {1: 1 / slow})
    assert summ[0].speed_ratio == pytest.approx(1.0, rel=1e-9)
    assert summ[1].speed_ratio == pytest.approx(slow, rel=1e-9)
    assert summ[1].speed == pytest.approx(slow * summ[1].speed_planned)
    # the slow step is in the window but not in the medians
    assert summ[1].compute_ms == pytest.approx(summ[1].predicted_compute_ms / slow)
    assert measured_speeds(summ, plan) == pytest.approx({"local:0": 1.0, "local:1": slow})


def test_a_plans_first_step_is_measured_but_kept_out_of_the_window():
    """A rank at its planned pace whose first step paid one-time work (20x slower) measures at
    its planned speed once the window has steps; before that its summary still has figures
    (a logging step) but reports no window (a check refuses it)."""
    cluster = _cluster()
    plan = _plan(cluster)
    sim = simulate(plan, _profile(), cluster)
    device = plan.stages[1].devices[0]
    pred = predict_rank(plan, _profile(), cluster, device, sim)
    mon = StepMonitor(SimpleNamespace(timeline=[]), pred, rank=1, stage=1, window=2)

    def record(i: int, stretch: float) -> StepRecord:
        tl, end = _timeline(sim, device, stretch)
        return StepRecord(i, breakdown(tl, 99.0, end + 0.002), 1 << 20)

    assert WARMUP_STEPS == mon.warmup == 1
    mon.add(record(0, 20.0))
    early = mon.summary()
    assert early.steps == 0
    assert early.speed_ratio == pytest.approx(1 / 20)
    refused = _decide([early, early], plan, cluster, _Planner(), replan_window=1,
                      replan_min_steps=1, replan_threshold=0.0)
    assert not refused.switch
    assert "0 steps measured, fewer than replan_window=1" in refused.reason
    for i in (1, 2):
        mon.add(record(i, 1.0))
    summ = mon.summary()
    assert (summ.steps, mon.steps_seen, mon.last.step) == (2, 3, 2)
    assert summ.speed_ratio == pytest.approx(1.0, rel=1e-9)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        StepMonitor(SimpleNamespace(timeline=[]), pred, rank=1, stage=1, warmup=-1)


def test_checks_fall_every_window_after_the_warm_up_step_and_the_minimum():
    options = AutoPipeOptions(replan_window=2, replan_min_steps=2)
    assert [s for s in range(1, 10) if check_due(s, options)] == [3, 5, 7, 9]
    defaults = AutoPipeOptions()
    assert [s for s in range(1, 80) if check_due(s, defaults)] == [51, 61, 71]
    late = AutoPipeOptions(replan_window=4, replan_min_steps=10)
    assert [s for s in range(1, 20) if check_due(s, late)] == [13, 17]
    assert [s for s in range(1, 10) if check_due(s, options, warmup=0)] == [2, 4, 6, 8]
    off = AutoPipeOptions(replan="off", replan_window=2, replan_min_steps=2)
    assert not any(check_due(s, off) for s in range(1, 50))


def test_summaries_round_trip_through_the_gathered_tensor():
    cluster = _cluster()
    plan = _plan(cluster)
    for s in _summaries(plan, cluster, {1: 2.0}, steps=3):
        assert RankSummary.from_tensor(s.to_tensor()) == s


def test_a_measured_cluster_prices_like_the_cluster_declared_with_those_speeds():
    fast = _cluster()
    plan = _plan(fast)
    measured = measured_cluster(fast, {"local:0": 1.02, "local:1": 0.5})
    declared = _cluster(slow=0.5)
    assert [d.name for d in measured.devices] == [d.name for d in declared.devices]
    assert measured.device("local:0").spec == fast.device("local:0").spec  # within 5%: kept
    assert measured.device("local:1").spec.speed == pytest.approx(0.5)
    for p in (plan, _plan(declared)):
        a = simulate(p, _profile(), measured).iteration_ms
        b = simulate(p, _profile(), declared).iteration_ms
        assert a == pytest.approx(b, rel=1e-9)


def test_a_measured_type_with_its_own_profile_gets_the_profile_scaled():
    data = _cluster().to_dict()
    own = Profile("toy", 2, "own", [BlockProfile(f"b{i}", 3.0, 6.0, 1000, 1000, 1000)
                                    for i in range(8)])
    cluster = Cluster.from_dict(data)
    spec = cluster.servers[0].device
    from dataclasses import replace

    server = replace(cluster.servers[0], device=replace(spec, profile=own))
    cluster = Cluster(cluster.name, cluster.network_gbps, cluster.network_latency_us, [server])
    measured = measured_cluster(cluster, {"local:1": 0.5})
    slowed = measured.device("local:1").spec.profile
    assert slowed.blocks[0].forward_ms == pytest.approx(6.0)
    assert measured.device("local:0").spec.profile.blocks[0].forward_ms == 3.0


def test_measuring_a_measured_cluster_again_multiplies_the_ratios():
    """A pipeline keeps the cluster it was last priced on (after a switch or a
    re-calibration): ratios measured against it compose with the earlier ones, pricing as
    the product measured at once, and a type's name keeps its base with the product."""
    fast = _cluster()
    once = measured_cluster(fast, {"local:0": 1.3, "local:1": 0.5})
    twice = measured_cluster(once, {"local:0": 1.0, "local:1": 1.6})
    direct = measured_cluster(fast, {"local:0": 1.3, "local:1": 0.8})
    base = fast.device("local:1").spec.name
    assert twice.device("local:1").spec.name == f"{base} x0.80"
    for name in ("local:0", "local:1"):
        assert twice.device(name).spec.speed == pytest.approx(direct.device(name).spec.speed)
    for p in (_plan(fast), _plan(direct)):
        assert simulate(p, _profile(), twice).iteration_ms == pytest.approx(
            simulate(p, _profile(), direct).iteration_ms, rel=1e-9)
    assert not speeds_moved({"local:0": 1.04, "local:1": 0.96})
    assert speeds_moved({"local:0": 1.0, "local:1": 1.06})


# ------------------------------------------------------------------------------- decision
class _Planner:
    """Plans for the measured cluster as the run would (2 stages) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cluster: Cluster):
        self.calls += 1
        return _plan(cluster)


def _slowed_run(slow: float = 0.4):
    """The plan for alike ranks, rank 1 then slowed by ``slow``: every rank's window, its
    step as the slowed cluster's simulation of the running plan, and the gain a plan for the
    slowed cluster is predicted to bring."""
    fast = _cluster()
    plan = _plan(fast)
    slowed = _cluster(slow)
    step = simulate(plan, _profile(), slowed).iteration_ms
    summ = _summaries(plan, fast, {1: 1 / slow}, steps=10, step_ms=step)
    best = _plan(slowed)
    assert not same_layout(best, plan)
    gain = 1.0 - best.iteration_ms / step
    return fast, plan, summ, gain


def _predict(plan, cluster) -> float:
    return simulate(plan, _profile(), cluster).iteration_ms


def _decide(summ, plan, cluster, planner, cost_ms=0.0, remaining=1000, since=100, **opts):
    options = AutoPipeOptions(**{"replan_window": 10, "replan_min_steps": 20, **opts})
    return decide_replan(summ, plan, cluster, planner, predict=_predict, options=options,
                         switch_cost_ms=cost_ms, remaining_steps=remaining,
                         steps_since_switch=since)


def test_replan_off_never_switches_nor_plans():
    cluster, plan, summ, gain = _slowed_run()
    planner = _Planner()
    got = _decide(summ, plan, cluster, planner, replan="off", replan_threshold=0.0)
    assert (got.switch, planner.calls) == (False, 0)
    assert "off" in got.reason


def test_a_slowdown_that_another_plan_beats_by_more_than_threshold_and_cost_switches():
    cluster, plan, summ, gain = _slowed_run()
    assert gain > 0.15  # the slowed rank leaves much on the table
    planner = _Planner()
    step = summ[0].step_ms
    cost = 0.5 * (gain - 0.05) * step * 100  # half the margin, over 100 remaining steps
    got = _decide(summ, plan, cluster, planner, cost_ms=cost, remaining=100,
                  replan_threshold=0.05)
    assert got.switch, got.reason
    assert planner.calls == 1
    assert got.candidate is not None
    assert not same_layout(got.candidate, plan)
    assert got.speeds == pytest.approx({"local:0": 1.0, "local:1": 0.4})
    assert got.candidate_step_ms == pytest.approx(step * (1 - gain))


def test_below_threshold_or_unpaid_switch_cost_does_not_switch():
    cluster, plan, summ, gain = _slowed_run()
    step = summ[0].step_ms
    above = _decide(summ, plan, cluster, _Planner(), replan_threshold=gain + 0.02)
    assert not above.switch
    assert "not more than" in above.reason
    just = _decide(summ, plan, cluster, _Planner(), replan_threshold=gain - 0.02)
    assert just.switch  # the same figures switch with a threshold just below the gain
    cost = (gain - 0.02) * step * 10 * 1.5  # more than 10 steps' gain above the threshold
    unpaid = _decide(summ, plan, cluster, _Planner(), cost_ms=cost, remaining=10,
                     replan_threshold=0.02)
    assert not unpaid.switch
    paid = _decide(summ, plan, cluster, _Planner(), cost_ms=cost, remaining=1000,
                   replan_threshold=0.02)
    assert paid.switch  # the same cost spread over more steps pays


def test_too_few_steps_or_a_short_window_or_no_gain_does_not_switch():
    cluster, plan, summ, _ = _slowed_run()
    planner = _Planner()
    early = _decide(summ, plan, cluster, planner, since=5, replan_threshold=0.0)
    assert not early.switch
    assert "replan_min_steps=20" in early.reason
    short = [RankSummary(**{**s.__dict__, "steps": 4}) for s in summ]
    assert not _decide(short, plan, cluster, planner, replan_threshold=0.0).switch
    assert planner.calls == 0
    even = _summaries(plan, cluster, {}, steps=10)  # nobody slowed: the same plan comes back
    same = _decide(even, plan, cluster, planner, replan_threshold=0.0)
    assert not same.switch
    assert "running one" in same.reason
    assert math.isfinite(same.candidate_step_ms)


def test_a_slowdown_the_speeds_do_not_explain_slows_both_plans_alike():
    """Every rank's step twice what the simulator makes of the measured speeds (a core shared
    by two ranks slows messages and overheads too): a candidate predicted only a little faster
    than the running plan on those speeds is no 50% gain over the measured step."""
    cluster, plan, summ, gain = _slowed_run()
    step = summ[0].step_ms
    doubled = [RankSummary(**{**s.__dict__, "step_ms": 2 * step}) for s in summ]
    got = _decide(doubled, plan, cluster, _Planner(), replan_threshold=gain + 0.02)
    assert not got.switch, got.reason
    assert got.running_predicted_ms == pytest.approx(step)
    assert got.expected_step_ms == pytest.approx(2 * step * (1 - gain))
    # the gain is the predicted ratio's, whatever the measured step
    assert _decide(doubled, plan, cluster, _Planner(), replan_threshold=gain - 0.02).switch


# ------------------------------------------------------------------- re-balancing replicas
def _replica_summaries(plan, cluster, stretch: dict[int, float], step_ms: float
                       ) -> list[RankSummary]:
    """One stage x two replicas: each rank's window, its compute ``stretch`` x predicted."""
    profile, sim = _profile(), simulate(plan, _profile(), cluster)
    out = []
    for rank, device in enumerate(plan.stages[0].devices):
        pred = predict_rank(plan, profile, cluster, device, sim)
        records = []
        for i in range(10):
            tl, end = _timeline(sim, device, stretch.get(rank, 1.0))
            records.append(StepRecord(i, breakdown(tl, 99.0, end + 0.002, step_ms), 1 << 20))
        out.append(summarise(records, pred, rank, 0, replica=rank))
    return out


def _data_parallel_drift(slow: float = 0.8):
    """Two alike replicas planned even, then rank 1 at ``slow``: the running plan, the
    summaries (the step as the slowed cluster's simulation of it) and the slowed cluster."""
    fast = _cluster()
    plan = search_plan(_profile(), fast, ["local:0", "local:1"], BATCH, num_stages=1)
    assert plan.replicas == 2
    assert plan.replica_batches == []
    slowed = _cluster(slow)
    step = simulate(plan, _profile(), slowed).iteration_ms
    return fast, plan, _replica_summaries(plan, fast, {1: 1 / slow}, step), slowed


def test_a_switch_that_only_rebalances_replica_batches_is_named_so_and_takes_the_same_bar():
    fast, plan, summ, _ = _data_parallel_drift()

    def planner(cluster):  # the run's search: the same layout, uneven batches
        return search_plan(_profile(), cluster, ["local:0", "local:1"], BATCH, num_stages=1)

    got = _decide(summ, plan, fast, planner, replan_threshold=0.03)
    assert got.switch, got.reason
    assert "the running layout with replica batches" in got.reason
    assert same_layout(got.candidate, plan, batches=False)
    assert got.candidate.replica_batches[0] > got.candidate.replica_batches[1]
    gain = 1 - got.candidate_ms_per_sample / got.measured_ms_per_sample
    assert 0.03 < gain < 0.5
    kept = _decide(summ, plan, fast, planner, replan_threshold=gain + 0.02)
    assert not kept.switch
    assert "replan_threshold" in kept.reason


def test_a_new_layout_short_of_the_replan_bar_falls_back_to_rebalancing_the_running_one():
    from lightning_autopipe.planner.replica_batches import balance_replicas

    fast, plan, summ, _ = _data_parallel_drift()

    def planner(cluster):  # another layout (two micro-batches), even batches
        return search_plan(_profile(), cluster, ["local:0", "local:1"], BATCH, num_stages=1,
                           num_microbatches=2, balance=False)

    def rebalance(cluster):
        return balance_replicas(plan, _profile(), cluster)

    options = AutoPipeOptions(replan_window=10, replan_min_steps=20, replan_threshold=0.05)
    common = dict(predict=_predict, options=options, switch_cost_ms=0.0, remaining_steps=1000,
                  steps_since_switch=100)
    alone = decide_replan(summ, plan, fast, planner, **common)
    assert not alone.switch
    assert "replan_threshold" in alone.reason
    got = decide_replan(summ, plan, fast, planner, rebalance=rebalance, **common)
    assert got.switch, got.reason
    assert same_layout(got.candidate, plan, batches=False)
    assert got.candidate.replica_batches
