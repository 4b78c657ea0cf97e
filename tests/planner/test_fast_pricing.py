"""The faster pricing equals the reference pricing, and the search is never worse than the
planner before it.

* the level-by-level replay of many candidates (``planner/levels.py``) equals the scalar
  replay to the bit, on a grid of schedules, depths, micro-batch and slice counts, with and
  without link queues;
* ``evaluate_batch`` equals ``evaluate`` one candidate at a time (estimates, critical path
  included), for one layout and for one layout per candidate; past the extrapolation point
  this also holds the shorter replay resumed from the longer one's shared prefix
  (``planner/extrapolate.py``, taken by the scalar path) equal to the whole replay;
* level 1's array scoring (``planner/shapes.py``) equals the scalar closed form it replaced
  (kept below as the reference), shape for shape and bit for bit;
* on 50 seeded random profiles and clusters the whole search predicts a step no longer than
  the planner before these changes did (its figures frozen in ``data/search_reference.json``,
  written by ``search_cases.py`` run against that planner).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS
from lightning_autopipe.planner import costmodel, make_plan
from lightning_autopipe.planner.compiled import B, compiled, extrapolation_point
from lightning_autopipe.planner.costmodel import evaluate, evaluate_batch
from lightning_autopipe.planner.extrapolate import _tail
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.levels import replay_levels
from lightning_autopipe.planner.mapping import candidate_groupings, speed_order
from lightning_autopipe.planner.polish import neighbours
from lightning_autopipe.planner.pricing import allreduce_ms, peak_memory_bytes, unit_ms
from lightning_autopipe.planner.scalar import replay as _replay
from lightning_autopipe.planner.shapes import (
    microbatch_choices,
    model_figures,
    score_shapes,
    stage_replica_pairs,
)
from lightning_autopipe.planner.step import StepShape

from ._random import random_cluster, random_costs, random_profile
from .search_cases import CASES, case

REFERENCE = Path(__file__).parent / "data" / "search_reference.json"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_level_replay_equals_the_scalar_replay_to_the_bit(schedule):
    rng = random.Random(schedule)
    for stages in (1, 2, 3, 5, 9):
        for m, k, j in ((1, 1, 1), (1, 3, 1), (4, 2, 2), (9, 1, 3), (23, 4, 2)):
            comp = compiled(schedule, stages, m, k, 4, j)
            kinds = 3 if comp.split else 2
            for queue in (True, False):
                count = 3
                var = [[[rng.random() for _ in range(stages)] for _ in range(kinds)]
                       for _ in range(count)]
                call = [[[rng.random() * 0.1 for _ in range(stages)] for _ in range(kinds)]
                        for _ in range(count)]
                cut = [[rng.random() * 0.5 for _ in range(stages - 1)] for _ in range(count)]
                lat = [[rng.random() * 0.1 for _ in range(stages - 1)] for _ in range(count)]
                finish, started = replay_levels(
                    comp, np.array(var).transpose(1, 2, 0), np.array(call).transpose(1, 2, 0),
                    np.array(cut).reshape(count, -1).T, np.array(lat).reshape(count, -1).T,
                    queue, True)
                for i in range(count):
                    ref, _, via = _replay(comp, var[i], call[i], cut[i], tuple(lat[i]),
                                          [0.0] * stages, queue)
                    assert finish[:, i].tolist() == ref, (stages, m, k, j, queue)
                    assert started[:, i].tolist() == via, (stages, m, k, j, queue)


@pytest.mark.parametrize("seed", range(6))
def test_evaluate_batch_equals_evaluate_one_by_one(seed, monkeypatch):
    rng = random.Random(300 + seed)
    profile, cluster, costs, devs = random_costs(rng, rng.randint(30, 90))
    stages = rng.randint(2, min(12, len(devs)))
    m = rng.choice([1, stages, 3 * stages + 9])  # past the extrapolation point too
    batch = m * rng.choice([2, 4])  # two startup / drain slices need two samples
    layouts = [Layout.from_cluster(cluster, g, optimistic=opt)
               for g in candidate_groupings(cluster, devs, stages, 1).values()
               for opt in (False, True)]  # with link queues and without
    base = [round(i * costs.num_blocks / stages) for i in range(stages)] + [costs.num_blocks]
    cands = [base] + neighbours(base)[:40]
    for schedule in ("1f1b", "zb-h1"):
        kw = dict(schedule=schedule, drain_slices=rng.choice([1, 2]) if m > 1 else 1)
        sliced, whole = StepShape(batch, m, 2, **kw), StepShape(batch, m, 1, **kw)
        with monkeypatch.context() as patch:  # the batches go level by level
            patch.setattr(costmodel, "_LEVEL_WIDTH", 0.0)
            many = evaluate_batch(costs, layouts[0], cands, sliced)
            per_layout = evaluate_batch(costs, layouts, [base] * len(layouts), whole,
                                        critical_path=False)
        fresh = BlockCosts.from_profile(profile)  # nothing kept from the batches (memo.py)
        assert many == [evaluate(fresh, layouts[0], c, sliced) for c in cands]
        fresh = BlockCosts.from_profile(profile)
        assert per_layout == [evaluate(fresh, lay, base, whole, critical_path=False)
                              for lay in layouts]


def test_a_kept_estimate_is_the_estimate_and_keeps_its_critical_path():
    """A cut list priced again within one search comes from ``memo.py``: equal to pricing it
    anew, also on an equal layout built again; one priced without its critical path does not
    answer a request for it."""
    rng = random.Random(77)
    profile = random_profile(rng, 40)
    cluster = random_cluster(rng)
    devs = [d.name for d in cluster.devices]
    groups = next(iter(candidate_groupings(cluster, devs, 2, 1).values()))
    layout = Layout.from_cluster(cluster, groups)
    costs = BlockCosts.from_profile(profile)
    cuts = [0, 17, 40]
    plain = evaluate(costs, layout, cuts, StepShape(64, 8), critical_path=False)
    full = evaluate(costs, Layout.from_cluster(cluster, groups), cuts, StepShape(64, 8))
    assert full is not plain
    assert any(full.critical_share)
    assert evaluate(costs, layout, cuts, StepShape(64, 8), critical_path=False) is full  # kept
    assert full == evaluate(BlockCosts.from_profile(profile), layout, cuts, StepShape(64, 8))
    assert evaluate(costs, layout, cuts, StepShape(64, 4)) != full  # another shape: anew


def _reference_shapes(costs, cluster, devs, batch, pins, use_all, optimizer_factor,
                      max_slices):
    """Level 1 as the planner scored it one shape at a time (the reference)."""
    order = speed_order(cluster, devs)
    specs = [cluster.device(d).spec for d in order]
    nd, n = len(order), costs.num_blocks
    # which (S, R) pairs are allowed and the model's figures are not what this test holds:
    # those are shared, the scores are the scalar formula written out
    work, big, params, mem, act, mbs = model_figures(costs)
    out = []
    for s, r in stage_replica_pairs(pins, n, nd, batch, use_all):
        chunks = [specs[i * r : (i + 1) * r] for i in range(s)]
        speeds = [min(x.speed for x in c) for c in chunks]
        cap = min(min(x.memory_bytes for x in c) for c in chunks)
        ovh = max(x.overhead_ms for c in chunks for x in c)
        sum_sp = sum(speeds)
        ar = allreduce_ms(cluster, order[:r], int(params / s)) if r > 1 else 0.0
        hop = xfer = 0.0
        for c in range(s - 1):
            a, b = order[c * r], order[(c + 1) * r]
            ms = act / mbs / (cluster.bandwidth_gbps(a, b) * BYTES_PER_MS_PER_GBPS)
            if cluster.device(a).server != cluster.device(b).server:
                ms *= r
            hop = max(hop, cluster.latency_us(a, b) / 1e3 + ms * mbs)
            xfer = max(xfer, ms)
        base = max(work / sum_sp + 0.5 * work / n / min(speeds), big / max(speeds))
        fixed = min(sum(costs.fixed(0, n)) / sum_sp, base)

        def tau(samples, base=base, fixed=fixed, ovh=ovh, xfer=xfer):
            return max(unit_ms(base, fixed, samples / mbs, 1.0, 2 * ovh), xfer * samples)

        def term(fill, size, pin, limit, tau=tau):
            qs = [pin] if pin else range(1, min(limit, size) + 1)
            return min((q + fill) * tau(size / q) for q in qs)

        k_pin, j_pin = pins["startup_slices"], pins["drain_slices"]
        limit = max_slices if s > 1 else 1
        for m in [pins["num_microbatches"]] if pins["num_microbatches"] else (
                microbatch_choices(batch, r)):
            if (batch // r) % m or batch // (r * m) < max(k_pin or 1, j_pin or 1):
                continue
            size = batch // (m * r)
            scale = size / mbs
            if m == 1:
                est = term(s - 1, size, k_pin, limit)
            else:
                est = (m - 2) * tau(size) + sum(
                    term((s - 1) / 2, size, pin, limit) for pin in (k_pin, j_pin))
            est += 2 * (s - 1) * hop * scale + ar
            need = peak_memory_bytes(params / s, mem / s * scale, min(s, m), optimizer_factor)
            out.append((s, r, m, est, need <= cap))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_array_shape_scores_equal_the_scalar_closed_form(seed):
    rng = random.Random(900 + seed)
    _, cluster, costs, devs = random_costs(rng, rng.randint(5, 120))
    batch = 64 * rng.choice([1, 3, 4])
    free = dict.fromkeys(("num_stages", "replicas", "num_microbatches", "startup_slices",
                          "drain_slices"))
    pinned = {**free, "startup_slices": 2, "drain_slices": 3}
    for pins in (free, pinned):
        for use_all in (False, True):
            got = score_shapes(costs, cluster, devs, batch, pins, use_all, 2.0, 8)
            want = _reference_shapes(costs, cluster, devs, batch, pins, use_all, 2.0, 8)
            assert [(x.stages, x.replicas, x.microbatches, x.score, x.fits)
                    for x in got] == want


def test_the_search_is_never_worse_than_the_planner_before_it():
    reference = {int(k): v for k, v in json.loads(REFERENCE.read_text()).items()}
    assert sorted(reference) == list(range(CASES))
    worse = []
    for seed in range(CASES):
        profile, cluster, batch = case(seed)
        got = make_plan(profile, cluster, batch, memory_check=False).iteration_ms
        if got > reference[seed] * (1 + 1e-9):
            worse.append((seed, got, reference[seed]))
    assert not worse, worse


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_the_scalar_replay_equals_its_reference_to_the_bit(schedule):
    """Whole replays with and without link queues, the transfer record, and a shorter step
    resumed from a longer one's shared prefix (``planner/extrapolate.py``)."""
    rng = random.Random("scalar" + schedule)
    for stages in (1, 2, 4, 7):
        m0 = extrapolation_point(stages)
        win = stages + 1
        for k, j in ((1, 1), (3, 1), (2, 2)):
            comp = compiled(schedule, stages, m0 + win, k, 4, j)
            short = compiled(schedule, stages, m0, k, 4, j)
            kinds = 3 if comp.split else 2
            var = [[rng.random() for _ in range(stages)] for _ in range(kinds)]
            call = [[rng.random() * 0.1 for _ in range(stages)] for _ in range(kinds)]
            cut = [rng.random() * 0.5 for _ in range(stages - 1)]
            lat = tuple(rng.random() * 0.1 for _ in range(stages - 1))
            ar = [rng.random() for _ in range(stages)]
            for queue in (True, False):
                rec, ref_rec = [0.0] * len(comp.order), [0.0] * len(comp.order)
                got = _replay(comp, var, call, cut, lat, ar, queue, record=rec)
                assert got == _reference_replay(comp, var, call, cut, lat, ar, queue,
                                                record=ref_rec)
                assert rec == ref_rec
                tail = _tail(schedule, stages, m0, win, k, 4, j)
                state = tail.resume(got[1], rec if queue else None, stages - 1)
                again = tail.resume(got[1], rec if queue else None, stages - 1)
                assert _replay(short, var, call, cut, lat, ar, queue, resume=state) == (
                    _reference_replay(short, var, call, cut, lat, ar, queue, resume=again))
                # the resumed step's ends (its start causes are the whole step's business)
                assert _replay(short, var, call, cut, lat, ar, queue, resume=state)[:2] == (
                    _replay(short, var, call, cut, lat, ar, queue)[:2])


def _reference_replay(comp, var, per_call, cut_ms, lat, ar, queue=True, *, record=None,
                      resume=None):
    """The scalar replay as it was before its per-action lookups were flattened: the
    reference that ``planner/scalar.py``'s ``replay`` equals to the bit.

    The loop stays written out here, independent of the module it checks; the arguments, the
    results and the link model are ``scalar.replay``'s, whose docstring says what they mean,
    so neither its typed signature nor that description is copied.
    """
    fracs = comp.fracs
    order = comp.order
    via = [False] * len(order)  # True: started by the cross-stage message
    if resume is None:
        end = [0.0] * len(order)
        todo: Sequence[int] = range(len(order))
        free_f = [0.0] * len(cut_ms)  # when each cut's link is next free, per direction
        free_b = [0.0] * len(cut_ms)
    else:
        end, todo, free_f, free_b = resume
    for n in todo:
        s, code, u, prev, cross = order[n]
        t = end[prev] if prev >= 0 else 0.0
        if cross >= 0:
            is_b = code == B
            c = s if is_b else s - 1
            dur = cut_ms[c] * fracs[u]
            sent = end[cross]
            if queue:
                free = free_b if is_b else free_f
                if free[c] > sent:
                    sent = free[c]
                free[c] = sent + dur
                if record is not None:
                    record[n] = free[c]
            tc = sent + dur + lat[c]
            if tc > t:
                t = tc
                via[n] = True
        end[n] = t + var[code][s] * fracs[u] + per_call[code][s]
    finish = [end[comp.last[s]] + ar[s] for s in range(len(ar))]
    return finish, end, via
