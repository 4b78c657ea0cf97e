"""Device types with their own measured profiles: every planner prices a block on the device
that holds it from that type's profile; the scalar speed is only the fallback."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import yaml

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ClusterError
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile

KINDS = ("attn", "mlp")


def _profile(times: dict[str, tuple[float, float]], n: int, device: str) -> Profile:
    """``n / 2`` attention blocks, then as many MLP blocks, with the given (forward, backward) ms.

    (Grouped so that a stage's mix of the two, and with it the old device's slowdown, depends on
    where the cut falls.)
    """
    kinds = [KINDS[0]] * (n // 2) + [KINDS[1]] * (n - n // 2)
    blocks = [BlockProfile(f"b{i}.{k}", *times[k], 10**6, 10**5, 10**6)
              for i, k in enumerate(kinds)]
    return Profile("gpt", 4, device, blocks)


REF = _profile({"attn": (1.0, 2.0), "mlp": (1.0, 2.0)}, 8, "new")
# an older device: 4x slower on attention, only 1.5x on the MLP (2.75x on the whole model)
OLD = _profile({"attn": (4.0, 8.0), "mlp": (1.5, 3.0)}, 8, "old")
OLD_SPEED = 2.0 / 5.5


def _cluster(old_profile: Profile | None, gbps: float = math.inf) -> Cluster:
    old = {"name": "old", "speed": OLD_SPEED, "memory_gb": 16}
    cl = Cluster.from_dict({
        "name": "two-types", "network_gbps": gbps, "network_latency_us": 0,
        "servers": [
            {"name": "a", "gpus": 2, "device": {"name": "new", "speed": 1.0, "memory_gb": 16},
             "levels": [{"size": 2, "gbps": gbps, "latency_us": 0}]},
            {"name": "b", "gpus": 2, "device": old,
             "levels": [{"size": 2, "gbps": gbps, "latency_us": 0}]},
        ],
    })
    if old_profile is None:
        return cl
    b = cl.servers[1]
    typed = replace(b.device, profile=old_profile, profile_path="old.json")
    return Cluster(cl.name, cl.network_gbps, cl.network_latency_us,
                   [cl.servers[0], replace(b, device=typed)])


def test_a_stage_is_priced_on_its_own_devices_profile():
    """Hand-computed: one micro-batch through [0, 3) on the new device, [3, 8) on the old one."""
    cl = _cluster(OLD)
    plan = Plan("t", 4, 1, 1, [StagePlan((0, 3), ["a:0"]), StagePlan((3, 8), ["b:0"])])
    # new: blocks 0-2 (attention) at 1 ms forward, 2 ms backward each;
    # old: blocks 3-7 = one attention, four MLP: forward 4 + 4 x 1.5 = 10, backward 20
    want = 3 * 1.0 + 10.0 + 20.0 + 3 * 2.0
    res = simulate(plan, REF, cl)
    assert res.iteration_ms == pytest.approx(want, rel=1e-12)
    assert res.stage_ms == pytest.approx([9.0, 30.0])
    costs = BlockCosts.from_profile(REF, cl)
    est = evaluate(costs, Layout.from_cluster(cl, [["a:0"], ["b:0"]]), [0, 3, 8],
                   plan.step_shape())
    assert est.iteration_ms == pytest.approx(want, rel=1e-12)
    # the same device without its profile: the reference over the speed (5 blocks x 3 / 0.3636)
    scalar = simulate(plan, REF, _cluster(None))
    assert scalar.stage_ms[1] == pytest.approx(5 * 3.0 / OLD_SPEED)


def test_the_per_type_plan_beats_the_scalar_speed_plan_on_the_real_devices():
    truth = _cluster(OLD, gbps=100)
    blind = _cluster(None, gbps=100)
    pins = dict(num_stages=2, replicas=1, num_microbatches=8, startup_slices=1, drain_slices=1,
                devices=["a:0", "b:0"])
    typed = make_plan(REF, truth, 32, **pins)
    scalar = make_plan(REF, blind, 32, **pins)
    assert typed.cuts != scalar.cuts
    on_truth = simulate(scalar, REF, truth).iteration_ms
    assert typed.iteration_ms < on_truth * 0.97, (typed.cuts, scalar.cuts)


def test_exact_optimum_with_device_profiles_equals_brute_force():
    cl = _cluster(OLD, gbps=50)
    devs = [d.name for d in cl.devices]
    batch, m = 16, 4
    best = float("inf")
    for cuts in ([0, *c, 8] for c in itertools.combinations(range(1, 8), 1)):
        for order in itertools.permutations(devs, 2):
            for k, j, sch in itertools.product((1, 2, 4), (1, 2, 4), ("1f1b", "zb-h1")):
                plan = Plan("bf", batch, m, k, [StagePlan((cuts[i], cuts[i + 1]), [order[i]])
                                                for i in range(2)], drain_slices=j, schedule=sch)
                best = min(best, simulate(plan, REF, cl).iteration_ms)
    got = make_plan(REF, cl, batch, planner="optimal", num_stages=2, replicas=1,
                    num_microbatches=m, max_startup_slices=4, memory_check=False)
    assert got.iteration_ms == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("planner", ["autopipe", "dapple", "piper", "time"])
def test_every_planner_accepts_device_profiles_and_the_simulator_confirms(planner):
    cl = _cluster(OLD, gbps=50)
    plan = make_plan(REF, cl, 32, planner=planner, memory_check=False)
    assert plan.iteration_ms == pytest.approx(simulate(plan, REF, cl).iteration_ms)


def test_dapple_prices_the_old_device_from_its_profile():
    truth = _cluster(OLD, gbps=100)
    pins = dict(num_stages=2, replicas=1, num_microbatches=8, devices=["a:0", "b:0"])
    typed = make_plan(REF, truth, 32, planner="dapple", **pins)
    blind = make_plan(REF, _cluster(None, gbps=100), 32, planner="dapple", **pins)
    assert blind.cuts == [0, 4, 8]  # one device type to DAPPLE: an even split
    assert typed.cuts != blind.cuts
    assert typed.iteration_ms < simulate(blind, REF, truth).iteration_ms


def test_cluster_file_with_profiles_round_trips(tmp_path):
    OLD.save(tmp_path / "old.json")
    data = _cluster(None).to_dict()
    data["servers"][1]["devices"] = {1: {"name": "old-measured", "speed": OLD_SPEED,
                                         "memory_gb": 16, "profile": "old.json"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    cl = Cluster.load(tmp_path / "c.yaml")
    assert cl.device("b:1").spec.profile.names == OLD.names
    assert cl.device("b:1").spec.name == "old-measured"
    assert cl.device("b:0").spec.profile is None
    again = Cluster.from_dict(yaml.safe_load(cl.to_yaml()), base=tmp_path)
    assert again.device("b:1").spec.profile.names == OLD.names
    assert again.to_dict() == cl.to_dict()


def test_a_profile_of_other_blocks_is_refused_with_the_fix():
    other = Profile("resnet", 4, "old", REF.blocks[:5])
    with pytest.raises(ClusterError, match=r"old.*5 blocks.*8.*profile the device type again"):
        make_plan(REF, _cluster(other), 32)
    renamed = Profile(REF.model, 4, "old", [replace(b, name=f"layer.{i}")
                                            for i, b in enumerate(REF.blocks)])
    with pytest.raises(ClusterError, match=r"block 0 is 'layer.0' there and '.+' here"):
        make_plan(REF, _cluster(renamed), 32)


def test_a_missing_profile_file_names_the_file_and_the_fix(tmp_path):
    data = _cluster(None).to_dict()
    data["servers"][1]["device"]["profile"] = "missing.json"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterError, match=r"missing.json.*drop the profile key"):
        Cluster.load(tmp_path / "c.yaml")



def test_a_device_profile_measured_at_another_micro_batch_plans_the_same(tmp_path):
    """An old device type's own profile restated at 4x the micro-batch (4x the times, the same
    cost per sample) describes the same device: the same plan (the partitioner compared its
    times at 32 samples with the reference's at 1 and planned a step 2x slower)."""
    mb = 2**20
    rows = [(3.3, 7.8, 11.3, 21.5, 36, 16, 24), (4.9, 11.8, 11.6, 42.3, 42, 16, 57),
            (1.8, 3.8, 4.4, 4.0, 10, 10, 53), (1.9, 3.8, 4.0, 12.4, 7, 14, 36),
            (4.7, 9.6, 9.7, 28.9, 32, 4, 8), (1.9, 4.6, 3.4, 17.6, 28, 3, 47),
            (1.1, 1.9, 3.1, 6.1, 32, 9, 41), (0.5, 1.1, 1.9, 3.8, 39, 13, 50),
            (1.3, 2.1, 4.8, 8.0, 5, 12, 16), (0.8, 1.3, 2.5, 3.1, 41, 1, 8),
            (2.3, 4.3, 7.2, 15.8, 25, 13, 59)]
    ref = Profile("m", 1, "new", [BlockProfile(f"b{i}", r[0], r[1], r[4] * mb, r[5] * mb,
                                               r[6] * mb) for i, r in enumerate(rows)])
    plans = []
    for mbs in (8, 32):
        old = Profile("m", mbs, "old", [BlockProfile(f"b{i}", r[2] * mbs / 8, r[3] * mbs / 8,
                                                     r[4] * mb, r[5] * mb, r[6] * mb)
                                        for i, r in enumerate(rows)])
        old.save(tmp_path / f"old{mbs}.json")
        cl = Cluster.from_dict({"name": "c", "network_gbps": 25, "servers": [
            {"name": "a", "gpus": 2, "device": {"name": "new", "speed": 1.0, "memory_gb": 40},
             "levels": [{"size": 2, "gbps": 100}]},
            {"name": "b", "gpus": 2, "device": {"name": "old", "speed": 0.4, "memory_gb": 40,
                                                "profile": f"old{mbs}.json"},
             "levels": [{"size": 2, "gbps": 100}]}]}, base=tmp_path)
        plans.append(make_plan(ref, cl, 16))
    a, b = plans
    assert (b.cuts, b.devices, b.schedule) == (a.cuts, a.devices, a.schedule)
    assert b.iteration_ms == pytest.approx(a.iteration_ms, rel=1e-9)
