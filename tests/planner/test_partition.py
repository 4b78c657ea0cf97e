"""AutoPipe partitioner: balanced cuts vs brute force, the fast 1F1B model vs the simulator,
AutoPipe vs every yardstick and the exact optimum, and the startup slicer."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.analytic import analytic_profile
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.partition import (
    StageLimits,
    autopipe_partition,
    balanced_cuts,
    choose_drain_slices,
    choose_startup_slices,
)
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.pricing import allreduce_ms
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.step import StepShape
from lightning_autopipe.profile import BlockProfile, Profile
from tests.planner.clusters import two_speeds

YARDSTICKS = ("time", "parameters", "uniform", "dapple", "piper")

HETERO = two_speeds("hetero-4")
HETERO8 = Cluster.from_dict({
    "name": "hetero-8", "network_gbps": 10,
    "servers": [
        {"name": "fast", "gpus": 4, "device": {"name": "A", "speed": 1.0, "memory_gb": 16},
         "levels": [{"size": 2, "gbps": 100}, {"size": 4, "gbps": 50}]},
        {"name": "slow", "gpus": 4, "device": {"name": "B", "speed": 0.5, "memory_gb": 16},
         "levels": [{"size": 4, "gbps": 50}]},
    ],
})
HOMO = Cluster.local(4, gbps=20, latency_us=10)


def random_profile(rng: random.Random, n: int, mbs: int = 4) -> Profile:
    blocks = []
    for i in range(n):
        f = rng.uniform(0.5, 4)
        blocks.append(BlockProfile(f"b{i}", f, f * rng.uniform(1.5, 2.5), rng.randint(10**5, 10**8),
                                   rng.randint(10**4, 10**7), rng.randint(10**5, 10**8)))
    return Profile("random", mbs, "test", blocks)


def _all_cuts(n: int, s: int):
    for inner in itertools.combinations(range(1, n), s - 1):
        yield [0, *inner, n]


# ---------------------------------------------------------------------------- balanced cuts
@pytest.mark.parametrize("seed", range(6))
def test_balanced_cuts_equal_brute_force_minmax(seed):
    rng = random.Random(seed)
    for _ in range(10):
        n, s = rng.randint(2, 9), rng.randint(1, 4)
        if s > n:
            continue
        w = [rng.uniform(0.1, 5) for _ in range(n)]
        prefix = list(itertools.accumulate(w, initial=0.0))
        speeds = [rng.choice([0.2, 0.45, 1.0]) for _ in range(s)]

        def cost(c, sp=speeds, pre=prefix, ns=s):
            return max((pre[c[i + 1]] - pre[c[i]]) / sp[i] for i in range(ns))

        best = min(cost(c) for c in _all_cuts(n, s))
        got = balanced_cuts(prefix, speeds)
        assert got is not None
        assert got[0] == 0
        assert got[-1] == n
        assert cost(got) == pytest.approx(best, rel=1e-7)


def test_balanced_cuts_respect_memory_and_report_infeasible():
    rng = random.Random(7)
    for _ in range(30):
        n, s = rng.randint(3, 8), rng.randint(2, 3)
        w = [rng.uniform(0.1, 5) for _ in range(n)]
        prefix = list(itertools.accumulate(w, initial=0.0))
        params = list(itertools.accumulate((rng.randint(1, 10) for _ in range(n)), initial=0))
        mem = list(itertools.accumulate((rng.randint(1, 10) for _ in range(n)), initial=0))
        cap = [rng.randint(15, 40) for _ in range(s)]
        lim = StageLimits(params, mem, -1.0, [float(s - i) for i in range(s)], cap)  # 1 x params
        ok = [c for c in _all_cuts(n, s) if all(lim.ok(i, c[i], c[i + 1]) for i in range(s))]
        got = balanced_cuts(prefix, [1.0] * s, limits=lim)
        if not ok:
            assert got is None
            continue
        best = min(max(prefix[c[i + 1]] - prefix[c[i]] for i in range(s)) for c in ok)
        assert got is not None
        assert all(lim.ok(i, got[i], got[i + 1]) for i in range(s))
        assert max(prefix[got[i + 1]] - prefix[got[i]] for i in range(s)) == pytest.approx(best)


# ---------------------------------------------------------------------------- fast model
def _plan(cuts, groups, batch, m, k):
    return Plan("t", batch, m, k,
                [StagePlan((cuts[i], cuts[i + 1]), groups[i]) for i in range(len(groups))])


def test_fast_model_equals_simulator_without_contention():
    """No shared links in use (one device per stage, free links): replay == simulate()."""
    rng = random.Random(3)
    cl = Cluster.local(6, gbps=1e9, latency_us=0)
    for _ in range(25):
        n, s = rng.randint(4, 12), rng.randint(1, 6)
        s = min(s, n)
        m, k, j = rng.randint(1, 3 * s + 10), rng.randint(1, 3), rng.randint(1, 3)
        batch = m * 4
        prof = random_profile(rng, n)
        cuts = [0, *sorted(rng.sample(range(1, n), s - 1)), n]
        groups = [[f"local:{i}"] for i in range(s)]
        plan = _plan(cuts, groups, batch, m, k)
        plan.drain_slices = j
        est = evaluate(BlockCosts.from_profile(prof), Layout.from_cluster(cl, groups), cuts,
                       plan.step_shape())
        sim = simulate(plan, prof, cl)
        exact = m <= 2 * s + 6  # beyond that the replay extrapolates the steady period
        assert est.iteration_ms == pytest.approx(sim.iteration_ms, rel=1e-9 if exact else 5e-3)
        peaks = [sim.peak_memory_bytes[g[0]] for g in groups]
        assert est.peak_bytes == pytest.approx(peaks, rel=1e-8)  # the simulator rounds to bytes


@pytest.mark.parametrize("optimistic", [False, True])
def test_fast_model_prices_the_reduction_as_the_simulator(optimistic):
    """Replicas on CPUs whose all-reduce sums slowly: the fast model's step == simulate()'s.

    One stage, so that the two models' transfers between replicas (which differ by a few
    percent by design) do not enter; the all-reduce is then the whole difference to free links.
    """
    rng = random.Random(5)
    slow = Cluster.local(4, gbps=20, latency_us=10, reduce_gbps=5)
    for _ in range(10):
        n, r, m = rng.randint(1, 9), rng.randint(2, 4), rng.randint(1, 6)
        batch = m * 4 * r
        prof = random_profile(rng, n)
        groups = [[f"local:{i}" for i in range(r)]]
        layout = Layout.from_cluster(slow, groups, optimistic=optimistic)
        est = evaluate(BlockCosts.from_profile(prof), layout, [0, n], StepShape(batch, m))
        sim = simulate(_plan([0, n], groups, batch, m, 1), prof, slow)
        assert est.iteration_ms == pytest.approx(sim.iteration_ms, rel=1e-9)
        params = sum(b.param_bytes for b in prof.blocks)
        assert sim.allreduce_ms[0] == pytest.approx(allreduce_ms(slow, groups[0], params))


def test_critical_stage_comes_from_the_critical_path_not_the_heaviest_stage():
    fwd = [3.68, 3.34, 1.59, 3.65, 2.15, 2.02, 3.7, 2.17]
    bwd = [10.89, 9.19, 3.69, 8.06, 1.62, 4.09, 10.78, 5.78]
    prof = Profile("crit", 1, "test",
                   [BlockProfile(f"b{i}", f, b, 100, 0, 100) for i, (f, b) in
                    enumerate(zip(fwd, bwd))])
    costs = BlockCosts.from_profile(prof)
    cl = Cluster.local(4, gbps=1e9, latency_us=0)
    layout = Layout.from_cluster(cl, [[f"local:{i}"] for i in range(4)])
    est = evaluate(costs, layout, [0, 2, 4, 6, 8], StepShape(4, 4))
    heaviest = max(range(4), key=est.stage_ms.__getitem__)
    assert heaviest == 0
    assert est.critical_stage == 3  # the last stage's 4 forward+backward pairs are all on it
    assert est.critical_share[3] == pytest.approx(4 * est.stage_ms[3])
    assert sum(est.critical_share) <= est.iteration_ms + 1e-9
    better = autopipe_partition(costs, layout, StepShape(4, 4))
    assert better.estimate.iteration_ms < est.iteration_ms


# ---------------------------------------------------------------------------- vs yardsticks
def _compare(prof, cluster, batch, s, r, m, with_optimal=True):
    got = {}
    for planner in ("autopipe", *YARDSTICKS, *(("optimal",) if with_optimal else ())):
        plan = make_plan(prof, cluster, batch, planner=planner, num_stages=s, replicas=r,
                         num_microbatches=m, memory_check=False)
        assert plan.num_stages == s
        assert {st.replicas for st in plan.stages} == {r}
        got[planner] = plan.iteration_ms
    auto = got["autopipe"]
    for name in YARDSTICKS:
        assert auto <= got[name] * (1 + 1e-9), (name, got)
    if with_optimal:
        assert got["optimal"] <= auto * (1 + 1e-9)
        assert auto <= got["optimal"] * 1.02, got
    return got


@pytest.mark.parametrize("seed", range(8))
def test_autopipe_beats_yardsticks_and_is_within_2pct_of_optimal_random(seed):
    rng = random.Random(seed)
    r = 2 if seed % 4 == 3 else 1
    cluster = HETERO8 if r == 2 else (HETERO if seed % 2 else HOMO)
    n, s, m = rng.randint(6, 10), rng.randint(2, 4), rng.choice([4, 8])
    prof = random_profile(rng, n)
    _compare(prof, cluster, m * r * rng.choice([2, 4]), s, r, m)


def test_autopipe_beats_yardsticks_on_real_shaped_profiles():
    gpt = analytic_profile("gpt", layers=4, hidden=512, heads=8, seq_len=256, vocab=8000,
                           micro_batch_size=2)  # 10 blocks: embedding, 4 x (attn, mlp), head
    got = _compare(gpt, HETERO, 32, 4, 1, 8)
    assert got["uniform"] > got["autopipe"]  # the head and embedding make equal counts uneven
    resnet = analytic_profile("resnet", layers=50, micro_batch_size=8)
    mixed = Cluster.load("conf/cluster/mixed_rack.yaml")
    _compare(resnet, mixed, 256, 4, 4, 8, with_optimal=False)
    _compare(resnet, HETERO8, 64, 4, 2, 8, with_optimal=False)


# ---------------------------------------------------------------------------- startup slicer
def _uniform_profile(n: int) -> Profile:
    return Profile("uniform", 1, "test",
                   [BlockProfile(f"b{i}", 1.0, 2.0, 1000, 1000, 1000) for i in range(n)])


def test_slicer_picks_several_slices_for_a_deep_pipeline():
    prof = _uniform_profile(16)
    cl = Cluster.local(8, gbps=100, latency_us=5)
    one = ("1f1b",)  # what slices do to 1F1B's fill (zero bubble fills it with W instead)
    sliced = make_plan(prof, cl, 64, num_stages=8, replicas=1, num_microbatches=8,
                       schedules=one)
    plain = make_plan(prof, cl, 64, num_stages=8, replicas=1, num_microbatches=8,
                      startup_slices=1, schedules=one)
    assert sliced.startup_slices > 1
    assert sliced.iteration_ms < plain.iteration_ms * 0.97
    costs, layout = BlockCosts.from_profile(prof), Layout.from_cluster(
        cl, [[d] for d in plain.devices])
    k, _ = choose_startup_slices(costs, layout, plain.cuts, StepShape(64, 8))
    assert k > 1


def test_drain_slicer_picks_several_slices_for_a_deep_pipeline():
    prof = _uniform_profile(16)
    cl = Cluster.local(8, gbps=100, latency_us=5)
    one = ("1f1b",)  # what drain slices do to 1F1B's cool-down
    auto = make_plan(prof, cl, 64, num_stages=8, replicas=1, num_microbatches=8, schedules=one)
    whole = make_plan(prof, cl, 64, num_stages=8, replicas=1, num_microbatches=8,
                      startup_slices=auto.startup_slices, drain_slices=1, schedules=one)
    assert auto.drain_slices > 1
    assert auto.iteration_ms < whole.iteration_ms * 0.98
    costs, layout = BlockCosts.from_profile(prof), Layout.from_cluster(
        cl, [[d] for d in whole.devices])
    j, _ = choose_drain_slices(costs, layout, whole.cuts, whole.step_shape())
    assert j > 1
    one = make_plan(prof, Cluster.local(1), 64, num_stages=1, num_microbatches=8)
    assert one.drain_slices == 1  # nothing to overlap on one stage


@pytest.mark.parametrize("case", ["one-stage", "per-action-overhead"])
def test_slicer_picks_one_slice_where_slicing_does_not_pay(case):
    prof = _uniform_profile(8)
    if case == "one-stage":  # nothing to overlap: slices only add per-action costs
        plan = make_plan(prof, Cluster.local(1), 64, num_stages=1, num_microbatches=8)
        assert plan.startup_slices == 1
        return
    cl = Cluster.from_dict({  # every compute action pays 40 ms: more actions cost more
        "name": case, "network_gbps": 100,
        "servers": [{"name": "n", "count": 4, "gpus": 1,
                     "device": {"name": "d", "speed": 1.0, "memory_gb": 16, "overhead_ms": 40},
                     "levels": [{"size": 1, "gbps": 100}]}],
    })
    plan = make_plan(prof, cl, 64, num_stages=4, replicas=1, num_microbatches=8)
    assert (plan.startup_slices, plan.drain_slices) == (1, 1)
    sliced = make_plan(prof, cl, 64, num_stages=4, replicas=1, num_microbatches=8,
                       startup_slices=2)
    assert sliced.iteration_ms > plan.iteration_ms
