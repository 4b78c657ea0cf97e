"""Simulator: closed forms, hand-computed timelines, contention, all-reduce, memory, traces."""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from pathlib import Path

import pytest

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import ClusterError, PlanError
from lightning_autopipe.planner.fluid import FluidLinks
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.pricing import allreduce_ms
from lightning_autopipe.planner.schedule import Kind, gpipe, one_f_one_b
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.timeline import write_chrome_trace, write_png
from lightning_autopipe.profile import BlockProfile, Profile

MBS = 4  # profile micro-batch size


def _profile(fwd, bwd, act=0, mem=0, params=0) -> Profile:  # noqa: ANN001
    n = len(fwd)
    act = act if isinstance(act, list) else [act] * n
    mem = mem if isinstance(mem, list) else [mem] * n
    params = params if isinstance(params, list) else [params] * n
    return Profile(
        "toy",
        MBS,
        "cpu",
        [BlockProfile(f"b{i}", fwd[i], bwd[i], params[i], act[i], mem[i]) for i in range(n)],
    )


def _server(name: str, gpus: int, speed: float = 1.0, gbps: float = math.inf, **kw) -> dict:  # noqa: ANN003
    return {
        "name": name,
        "gpus": gpus,
        "device": {"name": "x", "speed": speed, "memory_gb": 80, **kw},
        "levels": [{"size": gpus, "gbps": gbps, "latency_us": 0}],
    }


def _free(n: int) -> Cluster:
    """Links that cost nothing: infinite bandwidth, no latency."""
    return Cluster.from_dict({"name": "free", "servers": [_server("s", n)]})


def _chain(num_stages: int, m: int, k: int = 1, devices: list[str] | None = None) -> Plan:
    devices = devices or [f"s:{i}" for i in range(num_stages)]
    return Plan(
        "test",
        MBS * m,
        m,
        k,
        [StagePlan((i, i + 1), [devices[i]]) for i in range(num_stages)],
    )


def _reference_replay(schedule, fwd, bwd, k) -> float:  # noqa: ANN001
    """Independent list-scheduling replay of a compute-only schedule with free transfers."""
    stages = sorted(schedule)
    done: dict = {}
    free = dict.fromkeys(stages, 0.0)
    ptr = dict.fromkeys(stages, 0)
    moved = True
    while moved:
        moved = False
        for s in stages:
            while ptr[s] < len(schedule[s]):
                a = schedule[s][ptr[s]]
                fw = a.kind is Kind.FORWARD
                dep = (s - 1 if fw else s + 1, a.kind, a.unit)
                if dep[0] in free and dep not in done:
                    break
                cost = (fwd[s] if fw else bwd[s]) / (k if a.microbatch == 0 else 1)
                start = max(free[s], done.get(dep, 0.0))
                free[s] = done[(s, a.kind, a.unit)] = start + cost
                ptr[s] += 1
                moved = True
    return max(free.values())


def test_plain_1f1b_matches_the_closed_form() -> None:
    rng = random.Random(0)
    for _ in range(25):
        num_stages, m = rng.randint(1, 7), rng.randint(1, 10)
        # heaviest stage last and the same forward/backward split everywhere: the closed form
        # sum_s (f_s + b_s) + (m - 1) max_s (f_s + b_s) is then exact
        fwd = sorted(rng.uniform(0.5, 3.0) for _ in range(num_stages))
        bwd = [2 * f for f in fwd]
        res = simulate(_chain(num_stages, m), _profile(fwd, bwd), _free(num_stages))
        tot = [f + b for f, b in zip(fwd, bwd)]
        assert res.iteration_ms == pytest.approx(sum(tot) + (m - 1) * max(tot), rel=1e-12)


def test_free_links_match_an_independent_replay() -> None:
    rng = random.Random(1)
    for _ in range(40):
        num_stages, m, k = rng.randint(1, 6), rng.randint(1, 8), rng.randint(1, 3)
        fwd = [rng.uniform(0.5, 3.0) for _ in range(num_stages)]
        bwd = [rng.uniform(1.0, 3.0) * f for f in fwd]
        plan = _chain(num_stages, m, k)
        plan.global_batch_size = MBS * m * k  # micro-batches of k * MBS samples
        gen = rng.choice([one_f_one_b, gpipe])
        sch = gen(num_stages, m, k)
        res = simulate(plan, _profile(fwd, bwd), _free(num_stages), schedule=sch)
        scaled_f, scaled_b = [f * k for f in fwd], [b * k for b in bwd]
        want = _reference_replay(sch, scaled_f, scaled_b, k)
        assert res.iteration_ms == pytest.approx(want, rel=1e-12)
        busy = sum(res.busy_ms.values())
        assert busy == pytest.approx(m * k * sum(fwd) + m * k * sum(bwd), rel=1e-12)
        assert res.bubble_fraction == pytest.approx(1 - busy / num_stages / want, abs=1e-12)


def _compute(res) -> list[tuple[str, str, float, float]]:  # noqa: ANN001
    return sorted(
        (e.device, e.label, e.start_ms, e.end_ms) for e in res.events if e.kind in ("F", "B")
    )


def test_hand_computed_two_stage_timeline_with_transfers() -> None:
    # 2 stages, m = 2. Forward 1 / 2 ms, backward 2 / 4 ms. Link: 8 Gb/s = 1e6 bytes/ms and
    # 100 us latency, activations 0.5 MB per micro-batch: every transfer takes 0.5 + 0.1 ms.
    prof = _profile([1.0, 2.0], [2.0, 4.0], act=500_000)
    cl = Cluster.from_dict(
        {
            "name": "two",
            "servers": [
                {
                    "name": "s",
                    "gpus": 2,
                    "device": {"name": "x", "speed": 1.0, "memory_gb": 80},
                    "levels": [{"size": 2, "gbps": 8, "latency_us": 100}],
                }
            ],
        }
    )
    res = simulate(_chain(2, 2), prof, cl)
    want = [
        ("s:0", "0F0.0", 0.0, 1.0),
        ("s:0", "0F1.0", 1.0, 2.0),
        ("s:0", "0B0.0", 8.2, 10.2),  # gradient of 0 sent at 7.6, arrives 8.2
        ("s:0", "0B1.0", 14.2, 16.2),
        ("s:1", "1F0.0", 1.6, 3.6),  # activation of 0 sent at 1.0, arrives 1.6
        ("s:1", "1B0.0", 3.6, 7.6),
        ("s:1", "1F1.0", 7.6, 9.6),
        ("s:1", "1B1.0", 9.6, 13.6),
    ]
    got = _compute(res)
    assert [g[:2] for g in got] == [w[:2] for w in sorted(want)]
    for g, w in zip(got, sorted(want)):
        assert g[2:] == pytest.approx(w[2:], abs=1e-9)
    sends = sorted((e.label, e.start_ms, e.end_ms) for e in res.events if e.kind in ("SF", "SB"))
    for (label, start, end), (wl, ws, we) in zip(
        sends,
        [("0SF0.0", 1.0, 1.6), ("0SF1.0", 2.0, 2.6), ("1SB0.0", 7.6, 8.2), ("1SB1.0", 13.6, 14.2)],
    ):
        assert label == wl
        assert start == pytest.approx(ws)
        assert end == pytest.approx(we)
    assert res.iteration_ms == pytest.approx(16.2)
    assert res.busy_ms == pytest.approx({"s:0": 6.0, "s:1": 12.0})
    assert res.bubble_fraction == pytest.approx(1 - 9.0 / 16.2)
    assert res.stage_ms == pytest.approx([3.0, 6.0])


def test_hand_computed_three_stage_timeline_with_startup_slices() -> None:
    # 3 stages, m = 2, micro-batch 0 in k = 2 slices; forward 2 ms and backward 4 ms per
    # micro-batch on every stage (1 and 2 ms per slice), free links.
    prof = _profile([2.0] * 3, [4.0] * 3)
    sliced = simulate(_chain(3, 2, 2), prof, _free(3))
    want = {
        "s:0": [("0F0.0", 0, 1), ("0F0.1", 1, 2), ("0F1.0", 2, 4), ("0B0.0", 8, 10),
                ("0B0.1", 10, 12), ("0B1.0", 18, 22)],
        "s:1": [("1F0.0", 1, 2), ("1F0.1", 2, 3), ("1F1.0", 4, 6), ("1B0.0", 6, 8),
                ("1B0.1", 8, 10), ("1B1.0", 14, 18)],
        "s:2": [("2F0.0", 2, 3), ("2B0.0", 3, 5), ("2F0.1", 5, 6), ("2B0.1", 6, 8),
                ("2F1.0", 8, 10), ("2B1.0", 10, 14)],
    }  # fmt: skip
    got = _compute(sliced)
    assert got == sorted((d, lab, float(s), float(e)) for d, v in want.items() for lab, s, e in v)
    assert sliced.iteration_ms == 22.0
    # plain 1F1B on the same pipeline: (S - 1 + m) (f + b) = 24; slicing saves
    # min((S - 1) f (1 - 1/k), b) = min(2, 4) = 2
    assert simulate(_chain(3, 2, 1), prof, _free(3)).iteration_ms == 24.0


def test_startup_slices_shorten_a_deep_pipeline() -> None:
    prof = _profile([1.0] * 8, [2.0] * 8, act=2_000_000)
    free = {k: simulate(_chain(8, 8, k), prof, _free(8)).iteration_ms for k in (1, 2, 4)}
    assert free[1] == pytest.approx(15 * 3.0)  # (S - 1 + m)(f + b)
    assert free[2] == pytest.approx(free[1] - 2.0)  # saves min(7 * 1 * 0.5, b = 2)
    assert free[4] == pytest.approx(free[1] - 2.0)
    pcie = Cluster.load(Path(__file__).resolve().parents[2] / "conf/cluster/pcie_2x8.yaml")
    devs = [d.name for d in pcie.devices][::2]  # 8 stages spread over both servers
    real = {k: simulate(_chain(8, 8, k, devs), prof, pcie).iteration_ms for k in (1, 2)}
    assert real[2] < real[1]


@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 2.0), (2.0, 1.0), (1.0, 3.0)])
def test_startup_slices_save_exactly_the_bound_on_balanced_pipelines(fwd, bwd) -> None:  # noqa: ANN001
    # micro-batch 1 enters after all slices left stage 0, so at best the last stage starts
    # it S f after the step begins: slicing saves min((S - 1) f (1 - 1/k), b) and no more
    for num_stages, m, k in itertools.product(range(2, 7), range(2, 6), range(2, 5)):
        prof = _profile([fwd] * num_stages, [bwd] * num_stages)
        times = {}
        for kk in (1, k):
            plan = _chain(num_stages, m, kk)
            plan.global_batch_size = MBS * k * m  # micro-batch: k profiles' worth of samples
            times[kk] = simulate(plan, prof, _free(num_stages)).iteration_ms
        f, b = fwd * k, bwd * k
        assert times[1] == pytest.approx((num_stages - 1 + m) * (f + b))
        saving = min((num_stages - 1) * f * (1 - 1 / k), b)
        assert times[k] == pytest.approx(times[1] - saving), (num_stages, m, k)


@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 2.0), (2.0, 1.0), (1.0, 3.0)])
def test_drain_slices_save_exactly_the_mirrored_bound(fwd, bwd) -> None:  # noqa: ANN001
    # time reversal of the startup case: the last micro-batch's backward leaves stage S-1 in
    # slices, so the cool-down tail shrinks by min((S - 1) b (1 - 1/j), f), and no more
    for num_stages, m, j in itertools.product(range(2, 6), range(2, 5), range(2, 5)):
        prof = _profile([fwd] * num_stages, [bwd] * num_stages)
        times = {}
        for jj in (1, j):
            plan = _chain(num_stages, m)
            plan.drain_slices = jj
            plan.global_batch_size = MBS * j * m
            times[jj] = simulate(plan, prof, _free(num_stages)).iteration_ms
        f, b = fwd * j, bwd * j
        saving = min((num_stages - 1) * b * (1 - 1 / j), f)
        assert times[j] == pytest.approx(times[1] - saving), (num_stages, m, j)
        both = _chain(num_stages, m, 2)  # startup and drain slices add up (m >= 2)
        both.drain_slices, both.global_batch_size = j, MBS * j * m * 2
        start = _chain(num_stages, m, 2)
        start.global_batch_size = both.global_batch_size
        t_both = simulate(both, prof, _free(num_stages)).iteration_ms
        t_start = simulate(start, prof, _free(num_stages)).iteration_ms
        assert t_both < t_start


def _two_servers(nic_gbps: float) -> Cluster:
    return Cluster.from_dict(
        {
            "name": "two-servers",
            "network_gbps": nic_gbps,
            "network_latency_us": 0,
            "servers": [{**_server("a", 2), "count": 1}, {**_server("b", 2), "count": 1}],
        }
    )


def _transfers(res, kind: str = "SF") -> list[float]:  # noqa: ANN001
    return [e.end_ms - e.start_ms for e in res.events if e.kind == kind]


def test_transfers_sharing_a_nic_take_longer() -> None:
    # 8 Gb/s NIC = 1e6 bytes/ms; one micro-batch of activations is 1e6 bytes: 1 ms alone
    prof = _profile([1.0, 1.0], [1.0, 1.0], act=1_000_000)
    cl = _two_servers(8)
    alone = simulate(_chain(2, 1, 1, ["a:0", "b:0"]), prof, cl)
    assert _transfers(alone) == pytest.approx([1.0])
    both = Plan(
        "t", 2 * MBS, 1, 1, [StagePlan((0, 1), ["a:0", "a:1"]), StagePlan((1, 2), ["b:0", "b:1"])]
    )
    shared = simulate(both, prof, cl)
    assert _transfers(shared) == pytest.approx([2.0, 2.0])  # both leave through a's NIC at once
    assert shared.iteration_ms == pytest.approx(alone.iteration_ms + 2.0)
    crossed = Plan(
        "t", 2 * MBS, 1, 1, [StagePlan((0, 1), ["a:0", "b:1"]), StagePlan((1, 2), ["b:0", "a:1"])]
    )
    assert _transfers(simulate(crossed, prof, cl)) == pytest.approx([1.0, 1.0])  # opposite ways


def test_max_min_fair_share_with_a_staggered_start() -> None:
    # replica 1 is twice as fast, so its send starts 0.5 ms earlier: it has the NIC alone for
    # 0.5 ms (0.5 MB), then both share it (0.5 MB/ms each): it ends at 1 + 1.0 = 2.0 ms;
    # the other then runs alone again: 1 MB - 0.5 MB shared = 0.5 MB more, ending at 2.5 ms.
    cl = Cluster.from_dict(
        {
            "name": "mixed",
            "network_gbps": 8,
            "network_latency_us": 0,
            "servers": [_server("a", 1), _server("f", 1, speed=2.0), _server("b", 2)],
        }
    )
    prof = _profile([1.0, 1.0], [1.0, 1.0], act=1_000_000)
    plan = Plan(
        "t", 2 * MBS, 1, 1, [StagePlan((0, 1), ["a:0", "f:0"]), StagePlan((1, 2), ["b:0", "b:1"])]
    )
    res = simulate(plan, prof, cl)
    sends = sorted((e.start_ms, e.end_ms) for e in res.events if e.kind == "SF")
    assert [x for s in sends for x in s] == pytest.approx([0.5, 2.0, 1.0, 2.5])


def test_allreduce_is_priced_by_the_ring_formula() -> None:
    cl = Cluster.load(Path(__file__).resolve().parents[2] / "conf/cluster/mixed_rack.yaml")
    devs = ["pcie0:0", "pcie0:1", "pcie0:2", "pcie0:3"]
    nbytes = 40_000_000
    prof = _profile([1.0], [2.0], params=nbytes)
    plan = Plan("t", 4 * MBS, 1, 1, [StagePlan((0, 1), devs)])
    res = simulate(plan, prof, cl)
    # ring 0-1-2-3-0 on PCIe: the 64 Gb/s socket edge is the slowest, 2 us latency per step
    ring = 2 * 3 / 4 * nbytes / (64 * BYTES_PER_MS_PER_GBPS) + 2 * 3 * 2.0 / 1e3
    assert res.allreduce_ms[0] == pytest.approx(ring, rel=1e-9)
    assert res.allreduce_ms[0] == pytest.approx(allreduce_ms(cl, devs, nbytes), rel=1e-9)
    compute = 3.0 / 0.45  # the V100s run at 0.45 of the profiled speed
    assert res.iteration_ms == pytest.approx(compute + ring, rel=1e-9)
    ars = [e for e in res.events if e.kind == "AR"]
    assert sorted(e.device for e in ars) == devs


def test_allreduce_adds_the_reduction_of_the_slowest_reducer() -> None:
    # gloo on CPUs: links of 30 Gb/s, but each rank sums its share at 10 Gb/s
    cl = Cluster.local(3, gbps=30, latency_us=100, reduce_gbps=10)
    devs = ["local:0", "local:1", "local:2"]
    nbytes = 30_000_000
    res = simulate(Plan("t", 3 * MBS, 1, 1, [StagePlan((0, 1), devs)]),
                   _profile([1.0], [2.0], params=nbytes), cl)
    ring = 2 * 2 / 3 * nbytes / (30 * BYTES_PER_MS_PER_GBPS) + 2 * 2 * 100 / 1e3
    reduce = 2 / 3 * nbytes / (10 * BYTES_PER_MS_PER_GBPS)
    assert res.allreduce_ms[0] == pytest.approx(ring + reduce, rel=1e-9)
    assert res.allreduce_ms[0] == pytest.approx(allreduce_ms(cl, devs, nbytes), rel=1e-9)
    assert res.iteration_ms == pytest.approx(3.0 + ring + reduce, rel=1e-9)


def test_peak_memory_counts_parameters_optimizer_and_activations() -> None:
    params, mem = [1000, 3000], [100, 10]
    prof = _profile([1.0, 1.0], [1.0, 1.0], mem=mem, params=params)
    one = simulate(_chain(2, 4), prof, _free(2))
    # 1F1B: stage 0 holds 2 micro-batches in flight, the last stage 1; Adam-like state = 2x
    assert one.peak_memory_bytes == {"s:0": 1000 * 4 + 2 * 100, "s:1": 3000 * 4 + 10}
    gp = simulate(_chain(2, 4), prof, _free(2), schedule=gpipe(2, 4))
    assert gp.peak_memory_bytes == {"s:0": 1000 * 4 + 4 * 100, "s:1": 3000 * 4 + 4 * 10}
    sgd = simulate(_chain(2, 4), prof, _free(2), optimizer_bytes_per_param_byte=0.0)
    assert sgd.peak_memory_bytes["s:0"] == 1000 * 2 + 2 * 100
    # micro-batches of 8 samples (2x the profiled 4): activations scale with samples
    big = _chain(2, 4)
    big.global_batch_size = 2 * MBS * 4
    assert simulate(big, prof, _free(2)).peak_memory_bytes["s:1"] == 3000 * 4 + 20


def test_uneven_replicas_split_every_unit() -> None:
    # stage 0 on one device, stage 1 on two: each stage-1 replica takes half of every unit
    prof = _profile([2.0, 2.0], [4.0, 4.0], act=1_000)
    plan = Plan("t", MBS * 2, 2, 2, [StagePlan((0, 1), ["s:0"]), StagePlan((1, 2), ["s:1", "s:2"])])
    res = simulate(plan, prof, _free(3))
    assert res.busy_ms == pytest.approx({"s:0": 12.0, "s:1": 6.0, "s:2": 6.0})
    sends = [e for e in res.events if e.kind == "SF"]
    assert len(sends) == 3 * 2  # 3 units, each to both replicas
    assert res.stage_ms == pytest.approx([6.0, 3.0])


def test_stage_ms_is_what_the_timeline_charges_a_whole_micro_batch() -> None:
    # per-call costs (fixed parts) and micro-batches of 2x the profiled samples: a linear
    # scaling of the profiled time would say 2 * (3 + 5) = 16 ms per stage
    blocks = [BlockProfile(f"b{i}", 3.0, 5.0, 0, 0, 0, forward_fixed_ms=1.0,
                           backward_fixed_ms=2.0) for i in range(2)]
    prof = Profile("toy", MBS, "cpu", blocks)
    cl = Cluster.from_dict({"name": "slow", "servers": [_server("s", 2, speed=0.5,
                                                                   overhead_ms=0.25)]})
    plan = _chain(2, 3)
    plan.global_batch_size = 3 * 2 * MBS
    res = simulate(plan, prof, cl)
    for s in range(2):
        whole = [e for e in res.events
                 if e.stage == s and e.unit == (1, 0) and e.kind in ("F", "B")]
        assert len(whole) == 2
        assert res.stage_ms[s] == pytest.approx(sum(e.end_ms - e.start_ms for e in whole))
    assert res.stage_ms[0] == pytest.approx(((1 + 2 * 2) + (2 + 3 * 2)) / 0.5 + 2 * 0.25)


def test_device_speed_and_overhead() -> None:
    cl = Cluster.from_dict(
        {"name": "slow", "servers": [_server("s", 2, speed=0.5, overhead_ms=0.25)]}
    )
    res = simulate(_chain(2, 1), _profile([1.0, 1.0], [2.0, 2.0]), cl)
    assert res.busy_ms == pytest.approx({"s:0": 6.5, "s:1": 6.5})
    assert res.stage_ms == pytest.approx([6.5, 6.5])
    assert res.iteration_ms == pytest.approx(2 * 2.25 + 2 * 4.25)  # F, F, B, B in a chain


def test_bad_plans_are_rejected() -> None:
    prof = _profile([1.0], [1.0])
    with pytest.raises(PlanError, match="plan covers blocks \\[0, 2\\).*has 1 blocks"):
        simulate(_chain(2, 1), prof, _free(2))
    with pytest.raises(ClusterError, match="no device 'x:0'"):
        simulate(_chain(1, 1, devices=["x:0"]), prof, _free(1))
    bad = _chain(1, 3)
    bad.global_batch_size = 10
    with pytest.raises(PlanError, match="not divisible"):
        simulate(bad, prof, _free(1))


def test_trace_and_png_are_written(tmp_path: Path) -> None:
    prof = _profile([1.0, 2.0, 1.5], [2.0, 4.0, 3.0], act=1_000_000, params=10_000_000)
    cl = _two_servers(10)
    plan = Plan(
        "t",
        MBS * 8,
        4,
        2,
        [StagePlan((0, 2), ["a:0", "a:1"]), StagePlan((2, 3), ["b:0", "b:1"])],
    )
    res = simulate(plan, prof, cl)
    trace = tmp_path / "t.json"
    write_chrome_trace(res, trace)
    data = json.loads(trace.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.events)
    assert {e["name"] for e in xs if e["cat"] == "F"} >= {"0F0.0", "0F0.1", "1F3.0"}
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {"a:0", "a:1", "b:0", "b:1"}
    for e in xs:  # per thread, slices never overlap (viewers need proper nesting)
        assert e["dur"] >= 0
    by_thread: dict = {}
    for e in xs:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
    png = tmp_path / "t.png"
    write_png(res, png)
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 100
    assert img.shape[1] > 500


def test_fluid_links_share_max_min_fairly() -> None:
    # resource A (10 bytes/ms) carries flows 1 and 2, B (4 bytes/ms) carries flow 1 only:
    # B caps flow 1 at 4, so flow 2 gets the remaining 6 of A (not an equal 5 / 5 split)
    heap: list = []
    links = FluidLinks({"A": 10.0, "B": 4.0}.__getitem__, heap, itertools.count().__next__,
                       lambda flow, ver: (7, flow, ver))
    links.start(0.0, 40.0, ("A", "B"), "one")
    links.start(0.0, 30.0, ("A",), "two")
    links.settle(0.0)
    done = {}
    while heap:
        t, _, (kind, flow, ver) = heapq.heappop(heap)
        assert kind == 7
        if links.finish(flow, ver):
            done[flow.payload] = t
            links.settle(t)
    # flow 2: 30 bytes at 6/ms ends at 5; flow 1: 20 bytes by then, 20 more at 4/ms -> 10
    assert done == pytest.approx({"two": 5.0, "one": 10.0})
