"""Affine block costs: fixed (per-call) + per-sample parts, from the profile to the planner."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from lightning_autopipe import profile_blocks, split_model
from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import BlockProfile, Profile, affine_ms, fit_affine

MBS = 4


def _profile(fwd, bwd, ffix=0.0, bfix=0.0, n=2) -> Profile:  # noqa: ANN001
    return Profile(
        "toy", MBS, "cpu",
        [BlockProfile(f"b{i}", fwd, bwd, 0, 0, 0, forward_fixed_ms=ffix, backward_fixed_ms=bfix)
         for i in range(n)],
    )


def _free(n: int) -> Cluster:
    return Cluster.from_dict({"name": "free", "servers": [{
        "name": "s", "gpus": n, "device": {"name": "x", "speed": 1.0, "memory_gb": 80},
        "levels": [{"size": n, "gbps": math.inf, "latency_us": 0}]}]})


def _two_stages(batch: int, m: int, k: int = 1) -> Plan:
    return Plan("test", batch, m, k, [StagePlan((0, 1), ["s:0"]), StagePlan((1, 2), ["s:1"])])


def _fast(profile: Profile, plan: Plan, cluster: Cluster) -> float:
    layout = Layout.from_cluster(cluster, [list(s.devices) for s in plan.stages])
    return evaluate(BlockCosts.from_profile(profile), layout, [0, 1, 2],
                    plan.step_shape()).iteration_ms


def test_affine_ms_is_linear_without_a_fixed_part():
    assert affine_ms(8.0, 0.0, 0.25) == 8.0 * 0.25
    assert affine_ms(8.0, 2.0, 0.25) == 2.0 + 6.0 * 0.25
    assert affine_ms(8.0, 2.0, 1.0) == 8.0  # at the profiled size: the measured time


def test_two_stage_pipeline_with_fixed_costs_matches_hand_computation():
    # micro-batches of 2 samples, profiled at 4: f = 2 + (4 - 2) / 2 = 3, b = 2 + (8 - 2) / 2 = 5
    # 1F1B, 2 equal stages, 2 micro-batches, free links: (m + S - 1) (f + b) = 3 * 8
    prof, plan, cl = _profile(4.0, 8.0, 2.0, 2.0), _two_stages(4, 2), _free(2)
    assert simulate(plan, prof, cl).iteration_ms == pytest.approx(24.0)
    assert _fast(prof, plan, cl) == pytest.approx(24.0)
    # linear model: f = 2, b = 4 -> 18
    lin = _profile(4.0, 8.0)
    assert simulate(plan, lin, cl).iteration_ms == pytest.approx(18.0)
    assert _fast(lin, plan, cl) == pytest.approx(18.0)


def test_zero_fixed_reproduces_the_linear_model_exactly():
    cl = _free(2)
    old = Profile("toy", MBS, "cpu",
                  [BlockProfile(f"b{i}", 1.5 + i, 2.5, 0, 64, 0) for i in range(2)])
    new = Profile("toy", MBS, "cpu", [BlockProfile(f"b{i}", 1.5 + i, 2.5, 0, 64, 0, 0.0, 0.0)
                                      for i in range(2)])
    for plan in (_two_stages(24, 3, 2), _two_stages(8, 2), _two_stages(16, 4, 3)):
        assert simulate(plan, new, cl).iteration_ms == simulate(plan, old, cl).iteration_ms
        assert _fast(new, plan, cl) == _fast(old, plan, cl)


def test_fast_model_agrees_with_simulator_on_startup_slices_with_fixed_costs():
    prof, cl = _profile(4.0, 8.0, 1.5, 3.0), _free(2)
    for plan in (_two_stages(16, 2, 2), _two_stages(24, 3, 3)):
        assert _fast(prof, plan, cl) == pytest.approx(simulate(plan, prof, cl).iteration_ms)
    # slices pay the fixed part once each: slicing costs more than with linear costs
    lin = _profile(4.0, 8.0)
    d_aff = (simulate(_two_stages(16, 2, 2), prof, cl).iteration_ms
             - simulate(_two_stages(16, 2, 1), prof, cl).iteration_ms)
    d_lin = (simulate(_two_stages(16, 2, 2), lin, cl).iteration_ms
             - simulate(_two_stages(16, 2, 1), lin, cl).iteration_ms)
    assert d_aff > d_lin


def test_fit_recovers_fixed_and_per_sample_parts():
    fixed, per = 1.25, 0.5
    t = {n: fixed + per * n for n in (2, 4, 8)}
    assert fit_affine(4, t[4], 8, t[8]) == pytest.approx(fixed)
    assert fit_affine(2, t[2], 4, t[4]) == pytest.approx(fixed)
    # per-sample part follows: (t(mbs) - fixed) / mbs
    assert (t[8] - fit_affine(4, t[4], 8, t[8])) / 8 == pytest.approx(per)


def test_fit_clamps_noise():
    assert fit_affine(2, 1.5, 4, 4.0) == 0.0  # small run too fast: no negative fixed part
    assert fit_affine(2, 5.0, 4, 4.0) == pytest.approx(3.6)  # small run slower than big: 0.9 t
    with pytest.raises(ValueError, match="n_small < n_big"):
        fit_affine(4, 1.0, 4, 1.0)


def test_json_round_trip_with_and_without_fixed_keys():
    lin = _profile(4.0, 8.0)
    d = lin.to_dict()
    assert all("forward_fixed_ms" not in b and "backward_fixed_ms" not in b for b in d["blocks"])
    assert Profile.from_json(lin.to_json()) == lin
    aff = _profile(4.0, 8.0, 1.0, 0.0)
    d = json.loads(aff.to_json())
    assert d["blocks"][0]["forward_fixed_ms"] == 1.0
    assert "backward_fixed_ms" not in d["blocks"][0]
    assert Profile.from_json(aff.to_json()) == aff
    # the documented form (no fixed keys) loads with zero fixed parts
    doc = {"model": "gpt2", "micro_batch_size": 4, "device": "cpu",
           "blocks": [{"name": "h.0", "forward_ms": 1.2, "backward_ms": 2.5, "param_bytes": 1,
                       "activation_bytes": 2, "memory_bytes": 3}]}
    b = Profile.from_dict(doc).blocks[0]
    assert (b.forward_fixed_ms, b.backward_fixed_ms) == (0.0, 0.0)


def test_planner_prefers_fewer_larger_micro_batches_when_fixed_costs_are_large():
    cl = Cluster.local(2)
    lin = _profile(4.0, 8.0, n=4)
    aff = _profile(4.0, 8.0, 3.6, 7.2, n=4)
    kw = {"num_stages": 2, "replicas": 1, "startup_slices": 1}
    m_lin = make_plan(lin, cl, 64, **kw).num_microbatches
    m_aff = make_plan(aff, cl, 64, **kw).num_microbatches
    assert m_aff < m_lin, (m_aff, m_lin)


def test_profile_blocks_fits_fixed_parts_within_bounds():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    blocks = split_model(model, (x,))
    prof = profile_blocks(blocks, (x,), warmup=1, repeats=3)
    for b in prof.blocks:
        assert 0.0 <= b.forward_fixed_ms <= 0.9 * b.forward_ms + 1e-12
        assert 0.0 <= b.backward_fixed_ms <= 0.9 * b.backward_ms + 1e-12
    plain = profile_blocks(blocks, (x,), warmup=0, repeats=1, fit_fixed=False)
    assert all(b.forward_fixed_ms == b.backward_fixed_ms == 0.0 for b in plain.blocks)
    one = profile_blocks(blocks, (x[:1],), warmup=0, repeats=1)  # batch 1: nothing to fit
    assert all(b.forward_fixed_ms == b.backward_fixed_ms == 0.0 for b in one.blocks)
