"""The replay's lower bound (``planner/bound.py``) bounds it, and searching with it changes
nothing.

* the anchors of a long step, extended from the two shorter steps the replay uses, equal the
  anchors of the whole step compiled, for every registered generator;
* the bound never exceeds the replay of the whole step (random durations, with and without
  link queues), nor the fast model's estimate where it replays the whole step;
* the partitioner, the final local search and the slicers end where they end with every
  candidate replayed (same cuts, estimates, runners-up, evaluation and step counts) while
  replaying fewer.
"""

from __future__ import annotations

import math
import random

import pytest

from lightning_autopipe.planner import partition, slicer
from lightning_autopipe.planner.bound import _contract, bound_batch, bound_ends, contracted
from lightning_autopipe.planner.compiled import compiled, extrapolation_point
from lightning_autopipe.planner.costmodel import evaluate
from lightning_autopipe.planner.generators import SCHEDULES
from lightning_autopipe.planner.layout import Layout
from lightning_autopipe.planner.mapping import candidate_groupings
from lightning_autopipe.planner.partition import autopipe_partition
from lightning_autopipe.planner.polish import bound_many, evaluate_many, polish
from lightning_autopipe.planner.scalar import replay as _replay
from lightning_autopipe.planner.slicer import choose_drain_slices, choose_startup_slices
from lightning_autopipe.planner.step import StepShape

from ._random import random_costs
from .search_cases import CASES


def _close(a: tuple, b: tuple) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-9) for x, y in zip(a, b))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_extended_anchors_equal_the_whole_step_and_bound_its_replay(schedule):
    rng = random.Random(schedule)
    for stages in (1, 2, 3, 5, 8):
        m0 = extrapolation_point(stages)
        for m in (3, m0 + 1, m0 + stages + 1, m0 + stages + 4, 3 * m0 + 7):
            for k, j in ((1, 1), (2, 1), (1, 3), (4, 2)):
                ext = contracted(schedule, stages, m, k, 8, j)
                whole = _contract(compiled(schedule, stages, m, k, 8, j))[2]
                assert ext is not None
                assert (ext.stage, ext.code, ext.prev, ext.cross, ext.cut, ext.last) == (
                    whole.stage, whole.code, whole.prev, whole.cross, whole.cut, whole.last)
                assert all(_close(a, b) for a, b in zip(ext.gap + ext.tail,
                                                        whole.gap + whole.tail))
                comp = compiled(schedule, stages, m, k, 8, j)
                kinds = 3 if comp.split else 2
                for queue in (True, False):
                    var = [[rng.random() for _ in range(stages)] for _ in range(kinds)]
                    call = [[rng.random() * 0.1 for _ in range(stages)] for _ in range(kinds)]
                    cut = [rng.random() for _ in range(stages - 1)]
                    lat = tuple(rng.random() * 0.1 for _ in range(stages - 1))
                    ends = _replay(comp, var, call, cut, lat, [0.0] * stages, queue)[0]
                    low = bound_ends(ext, var, call, cut, lat)
                    assert all(b <= e * (1 + 1e-12) for b, e in zip(low, ends))
                    # one stage bounds a step: the bound is near the replay, not just below
                    assert max(low) >= 0.5 * max(ends)


def _case(seed: int):
    rng = random.Random(4100 + seed)
    _, cluster, costs, devs = random_costs(rng, rng.randint(12, 60))
    stages = rng.randint(2, min(8, len(devs)))
    groups = next(iter(candidate_groupings(cluster, devs, stages, 1).values()))
    m = rng.randint(1, extrapolation_point(stages))  # replayed whole: the bound is exact
    batch = m * rng.choice([2, 4])
    return rng, costs, Layout.from_cluster(cluster, groups), stages, m, batch


@pytest.mark.parametrize("seed", range(8))
def test_the_bound_is_below_every_estimate_and_fits_is_exact(seed):
    rng, costs, layout, stages, m, batch = _case(seed)
    n = costs.num_blocks
    cands = [sorted(rng.sample(range(1, n), stages - 1)) for _ in range(12)]
    cands = [[0, *c, n] for c in cands]
    for schedule in ("1f1b", "zb-h1", "gpipe"):
        for mm, exact in ((m, False), (3 * stages + 9, True)):
            step = StepShape(mm * (batch // m), mm, 2, schedule=schedule)
            low = bound_batch(costs, layout, cands, step, exact=exact)
            for c, (b, fits) in zip(cands, low):
                e = evaluate(costs, layout, c, step, exact=exact, critical_path=False)
                assert b <= e.iteration_ms
                assert fits == e.fits


def _unbounded(cuts_list):
    return [(-math.inf, True)] * len(cuts_list)  # prunes nothing


@pytest.mark.parametrize("seed", range(10))
def test_searches_with_the_bound_end_where_they_end_replaying_everything(seed, monkeypatch):
    rng, costs, layout, stages, m, batch = _case(seed)
    schedule = rng.choice(["1f1b", "zb-h1"])
    step = StepShape(batch, m, 1, schedule=schedule)
    kw = dict(max_evaluations=rng.choice([40, 120, 400]))
    got = autopipe_partition(costs, layout, step, **kw)
    walked = polish(got.cuts, lambda cs: evaluate_many(costs, layout, cs, step),
                    lambda cs: bound_many(costs, layout, cs, step))
    k = choose_startup_slices(costs, layout, got.cuts, step, 4)
    j = choose_drain_slices(costs, layout, got.cuts, step, 4)
    with monkeypatch.context() as patch:
        patch.setattr(partition, "bound_batch", lambda *a, **k: _unbounded(a[2]))
        patch.setattr(slicer, "bound_batch", lambda *a, **k: _unbounded(a[2]))
        ref = autopipe_partition(costs, layout, step, **kw)
        ref_k = choose_startup_slices(costs, layout, got.cuts, step, 4)
        ref_j = choose_drain_slices(costs, layout, got.cuts, step, 4)
    ref_walk = polish(got.cuts, lambda cs: evaluate_many(costs, layout, cs, step))
    assert (got.cuts, got.estimate, got.alternatives, got.evaluations, got.steps) == (
        ref.cuts, ref.estimate, ref.alternatives, ref.evaluations, ref.steps)
    assert got.replays < got.evaluations <= ref.replays
    assert walked == ref_walk
    assert (k, j) == (ref_k, ref_j)


def test_the_whole_search_plans_the_same_with_and_without_the_bound(monkeypatch):
    """On the seeded cases of the search-quality reference (``search_cases.py``): the same
    plan, cut for cut, and the same predicted step."""
    from lightning_autopipe.planner import make_plan, search

    from .search_cases import case

    def plans():
        out = []
        for seed in range(0, CASES, 5):
            profile, cluster, batch = case(seed)
            p = make_plan(profile, cluster, batch, memory_check=False)
            out.append((p.cuts, [list(s.devices) for s in p.stages], p.num_microbatches,
                        p.startup_slices, p.drain_slices, p.schedule, p.iteration_ms))
        return out

    got = plans()
    with monkeypatch.context() as patch:
        patch.setattr(partition, "bound_batch", lambda *a, **k: _unbounded(a[2]))
        patch.setattr(slicer, "bound_batch", lambda *a, **k: _unbounded(a[2]))
        patch.setattr(search, "bound_many", lambda *a, **k: _unbounded(a[2]))
        want = plans()
    assert got == want
