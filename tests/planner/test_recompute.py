"""Activation recomputation as a planner choice: priced alike by the fast model and the
simulator, chosen only when nothing fits memory without it, optional in plan files."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ClusterError, MemoryPlanError, PlanError
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.search import make_plan, search_plan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile

MB = 2**20


def _profile(n: int = 8, seed: int = 0, params: int = 4 * MB, shared: int = 0) -> Profile:
    """Blocks of ``params`` bytes whose activations (8 MB a micro-batch) dominate memory;
    every block after the first saves ``shared`` bytes of its input that the one before
    saves too."""
    rng = random.Random(seed)
    blocks = [BlockProfile(f"b{i}", rng.uniform(1, 2), rng.uniform(2, 4), params, MB // 4,
                           8 * MB, forward_fixed_ms=0.1, backward_fixed_ms=0.2,
                           shared_input_bytes=shared if i else 0)
              for i in range(n)]
    return Profile("p", 4, "ref", blocks)


@pytest.mark.parametrize("shared", [0, MB // 8], ids=["unshared", "shared"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_fast_model_prices_recomputation_as_the_simulator(schedule, shared):
    prof = _profile(shared=shared)
    costs = BlockCosts.from_profile(prof)
    rng = random.Random(1)
    for stages, m in itertools.product((1, 2, 4), (1, 3, 6)):
        cluster = Cluster.local(stages, gbps=1e6, latency_us=1)
        groups = [[d.name] for d in cluster.devices]
        cuts = [0, *sorted(rng.sample(range(1, 8), stages - 1)), 8]
        flags = [rng.random() < 0.5 for _ in range(stages)]
        plan = Plan("t", 4 * m, m, 1, [StagePlan((cuts[s], cuts[s + 1]), groups[s])
                                      for s in range(stages)],
                    schedule=schedule, recompute=flags)
        sim = simulate(plan, prof, cluster)
        est = evaluate(costs, Layout.from_cluster(cluster, groups), cuts, plan.step_shape(),
                       exact=True, recompute=flags)
        plain = simulate(Plan("t", 4 * m, m, 1, plan.stages, schedule=schedule), prof, cluster)
        case = (schedule, stages, m, flags)
        assert est.iteration_ms == pytest.approx(sim.iteration_ms, rel=1e-9), case
        assert est.stage_ms == pytest.approx(sim.stage_ms, rel=1e-9), case
        for s, st in enumerate(plan.stages):
            dev = st.devices[0]
            assert est.peak_bytes[s] == pytest.approx(sim.peak_memory_bytes[dev], abs=1.0)
            i, j = st.blocks
            fwd = sum(b.forward_ms for b in prof.blocks[i:j])
            if flags[s]:  # one more forward per unit; only the inputs held in flight
                assert sim.stage_ms[s] == pytest.approx(plain.stage_ms[s] + fwd, rel=1e-9)
                inputs = prof.blocks[i - 1].activation_bytes if i else 0
                params = sum(b.param_bytes for b in prof.blocks[i:j])
                mem = sum(b.memory_bytes for b in prof.blocks[i:j])
                assert sim.peak_memory_bytes[dev] < plain.peak_memory_bytes[dev] or m == 1
                assert sim.peak_memory_bytes[dev] <= 4 * params + inputs * m + mem + 1
                if schedule == "gpipe" and i > 0:  # every unit in flight, one re-created
                    held = mem - sum(b.shared_input_bytes for b in prof.blocks[i + 1:j])
                    again = held - prof.blocks[i].shared_input_bytes  # its input once
                    want = 4 * params + inputs * m + again
                    assert sim.peak_memory_bytes[dev] == pytest.approx(want, abs=2), case
            else:
                assert sim.stage_ms[s] == pytest.approx(plain.stage_ms[s], rel=1e-9)


def test_recomputation_is_chosen_only_when_nothing_fits_without_it():
    prof = _profile()
    roomy = make_plan(prof, Cluster.local(2, memory_gb=16), 32, num_stages=2, replicas=1,
                      num_microbatches=8, schedules=("gpipe",))
    assert not roomy.recompute
    need = max(roomy.peak_memory_bytes.values())
    # GPipe holds all 8 micro-batches: no cut fits 60% of that, recomputing stages do
    tight = make_plan(prof, Cluster.local(2, memory_gb=0.6 * need / 2**30), 32, num_stages=2,
                      replicas=1, num_microbatches=8, schedules=("gpipe",))
    assert any(tight.recompute)
    assert max(tight.peak_memory_bytes.values()) <= 0.6 * need
    assert tight.iteration_ms > roomy.iteration_ms  # it costs the recomputed forwards
    with pytest.raises(MemoryPlanError, match="even with stages"):  # nor any other cuts
        make_plan(prof, Cluster.local(2, memory_gb=8 * MB / 2**30), 32, num_stages=2,
                  replicas=1, num_microbatches=8, schedules=("gpipe",))
    with pytest.raises(ClusterError, match="memory_gb > 0"):
        Cluster.local(2, memory_gb=0)


def test_the_search_time_counts_the_recomputation_fallback(monkeypatch):
    """The fallback chooses among simulated plans: its time is search time, not left out of
    ``search_ms`` as filling the chosen plan's figures is."""
    import lightning_autopipe.planner.search as search

    prof = _profile()
    roomy = make_plan(prof, Cluster.local(2, memory_gb=16), 32, num_stages=2, replicas=1,
                      num_microbatches=8, schedules=("gpipe",))
    tight = Cluster.local(2, memory_gb=0.6 * max(roomy.peak_memory_bytes.values()) / 2**30)
    inner = search._recomputing

    def slow(*args, **kwargs):
        time.sleep(0.25)
        return inner(*args, **kwargs)

    monkeypatch.setattr(search, "_recomputing", slow)
    plan = make_plan(prof, tight, 32, num_stages=2, replicas=1, num_microbatches=8,
                     schedules=("gpipe",))
    assert any(plan.recompute)
    assert plan.search_ms >= 250


@pytest.mark.parametrize("heavy", ["first", "last"])
def test_cuts_chosen_for_time_move_until_a_recomputing_plan_fits(heavy):
    """Two slow blocks at one end: the fastest cut gives the other stage seven of eight
    blocks, more than 110 MB holds even recomputing; cuts that fit by recomputing exist, and
    the plan is the fastest of every cut recomputing what does not fit (brute force)."""
    slow = (0, 1) if heavy == "first" else (6, 7)
    prof = Profile("p", 4, "ref", [
        BlockProfile(b.name, 12.0 if i in slow else 1.0, 2.0, b.param_bytes, b.activation_bytes,
                     b.memory_bytes) for i, b in enumerate(_profile().blocks)])
    pins = {"num_stages": 2, "replicas": 1, "num_microbatches": 8, "startup_slices": 1,
            "drain_slices": 1, "schedules": ("gpipe",)}
    roomy = make_plan(prof, Cluster.local(2, memory_gb=16), 32, **pins)
    assert max(st.blocks[1] - st.blocks[0] for st in roomy.stages) == 7
    cluster = Cluster.local(2, memory_gb=110 * MB / 2**30)
    limit = cluster.devices[0].spec.memory_bytes
    options = []
    for c in range(1, 8):
        stages = [StagePlan((0, c), ["local:0"]), StagePlan((c, 8), ["local:1"])]
        plain = simulate(Plan("t", 32, 8, 1, stages, schedule="gpipe"), prof, cluster)
        over = [plain.peak_memory_bytes[f"local:{s}"] > limit for s in range(2)]
        res = simulate(Plan("t", 32, 8, 1, stages, schedule="gpipe",
                            recompute=over if any(over) else []), prof, cluster)
        if max(res.peak_memory_bytes.values()) <= limit:
            options.append((res.iteration_ms, c, over))
    assert options
    assert roomy.cuts[1] not in [c for _, c, _ in options]
    tight = make_plan(prof, cluster, 32, **pins)
    assert max(tight.peak_memory_bytes.values()) <= limit
    assert (tight.iteration_ms, tight.cuts[1], tight.recompute) == min(options)


def test_a_long_model_on_many_stages_finds_the_cuts_that_fit_recomputing():
    """64 blocks of equal memory and random times on 8 stages, memory for the even split with
    every stage recomputing and 2% more: only cuts near the even split fit, which the walk
    from the time-favourite cuts, one or two cuts at a time, does not reach."""
    rng = random.Random(0)
    prof = Profile("p", 1, "ref", [
        BlockProfile(f"b{i}", (f := rng.lognormvariate(0, 1)), 2 * f, MB, MB // 16, 4 * MB)
        for i in range(64)])
    even = [StagePlan((8 * s, 8 * s + 8), [f"local:{s}"]) for s in range(8)]
    need = max(simulate(Plan("t", 16, 16, 1, even, schedule="1f1b", recompute=[True] * 8),
                        prof, Cluster.local(8)).peak_memory_bytes.values())
    cluster = Cluster.local(8, memory_gb=1.02 * need / 2**30)
    plan = make_plan(prof, cluster, 16, num_stages=8, replicas=1, num_microbatches=16,
                     startup_slices=1, drain_slices=1, schedules=("1f1b",))
    assert any(plan.recompute)
    assert max(plan.peak_memory_bytes.values()) <= cluster.devices[0].spec.memory_bytes


def test_search_prefers_a_depth_that_fits_without_recomputation():
    """4 devices with 37 MB each, 2 micro-batches per step: 1 stage x 4 fits nothing, 2 x 2
    fits only by recomputing its first stage (and would train more samples per ms), 4 x 1
    fits as it is: the search takes 4 x 1."""
    prof = _profile(params=MB // 4)
    cluster = Cluster.local(4, memory_gb=37 * MB / 2**30)
    pins = {"num_microbatches": 2, "startup_slices": 1, "drain_slices": 1,
            "schedules": ("1f1b",), "use_all_devices": True, "uniform_replicas": True}
    two = make_plan(prof, cluster, 16, num_stages=2, replicas=2, **pins)
    four = make_plan(prof, cluster, 8, num_stages=4, replicas=1, **pins)
    assert two.recompute == [True, False]
    assert not four.recompute
    assert 16 / two.iteration_ms > 8 / four.iteration_ms
    names = [d.name for d in cluster.devices]
    plan = search_plan(prof, cluster, names, 8, num_microbatches=2, startup_slices=1,
                       drain_slices=1, schedules=("1f1b",))
    assert (plan.num_stages, plan.recompute) == (4, [])


def test_plans_without_recompute_load_and_split_schedules_refuse_it():
    stages = [StagePlan((0, 2), ["a"]), StagePlan((2, 4), ["b"])]
    plan = Plan("t", 8, 2, 1, stages, recompute=[True, False])
    data = plan.to_dict()
    assert data["recompute"] == [True, False]
    assert Plan.from_dict(data).recomputes(0)
    old = {k: v for k, v in data.items() if k != "recompute"}  # a plan file from before
    assert not Plan.from_dict(old).recomputes(0)
    assert "recompute" not in Plan("t", 8, 2, 1, stages).to_dict()
    with pytest.raises(PlanError, match="splits the backward"):
        Plan("t", 8, 2, 1, stages, schedule="zb-h1", recompute=[True, False])
    with pytest.raises(PlanError, match="one flag per stage"):
        Plan("t", 8, 2, 1, stages, recompute=[True])
