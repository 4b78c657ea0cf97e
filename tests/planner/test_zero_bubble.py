"""ZB-H1 with startup and drain slices: the generator's rules, the validator, memory, exact
hand-computed timelines and its bubble against 1F1B's."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.compiled import inflight_of, lists
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.replay import ascii_timeline, validate
from lightning_autopipe.planner.schedule import (
    Action,
    Kind,
    lower_communication,
    one_f_one_b,
    parse_schedule,
    unit_sizes,
)
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.zero_bubble import zb_h1
from lightning_autopipe.profile import BlockProfile, Profile

SHAPES = [(s, m, k, j) for s, m, k, j in itertools.product(range(1, 9), range(1, 13),
                                                             range(1, 5), range(1, 5))
          if j == 1 or m >= 2]


@pytest.mark.parametrize("stages", range(1, 9))
def test_validator_accepts_zb_h1_with_and_without_slices(stages):
    for s, m, k, j in SHAPES:
        if s == stages:
            validate(zb_h1(s, m, k, j), m, k, j)
            validate(lower_communication(zb_h1(s, m, k, j)), m, k, j)


def test_every_w_follows_its_own_b_and_memory_stays_within_1f1b():
    for s, m, k, j in SHAPES[::7]:
        zb, base = zb_h1(s, m, k, j), one_f_one_b(s, m, k, j)
        for st, acts in zb.items():
            pos = {(a.kind, a.unit): i for i, a in enumerate(acts)}
            assert all(pos[(Kind.WEIGHT, u)] > pos[(Kind.BACKWARD, u)]
                       for kind, u in pos if kind is Kind.WEIGHT)
            # F/B order is 1F1B's
            assert [a for a in acts if a.kind is not Kind.WEIGHT] == base[st]
        fracs = [x / 12 for x in unit_sizes(12, m, k, j)]
        held = inflight_of(lists("zb-h1", s, m, k, j), fracs)
        held_1f1b = inflight_of(lists("1f1b", s, m, k, j), fracs)
        assert max(held) <= max(held_1f1b) + 1e-12, (s, m, k, j)


def _broken(text: str) -> dict[int, list[Action]]:
    return parse_schedule(text)


@pytest.mark.parametrize(("text", "why"), [
    ("0: 0F0.0 0W0.0 0B0.0", r"0W0.0 before its input backward 0B0.0"),
    ("0: 0F0.0 0B0.0\n1: 1F0.0 1B0.0 1W0.0", r"stage 0 lacks 0W0.0"),
    ("0: 0F0.0 0B0.0 1W0.0\n1: 1F0.0 1B0.0 1W0.0", r"listed under stage 0"),
    ("0: 0F0.0 0B0.0 0W0.0 0W0.0", r"runs 0W0.0 twice"),
])
def test_validator_rejects_broken_zero_bubble_schedules(text, why):
    with pytest.raises(ScheduleError, match=why):
        validate(_broken(text), 1, 1)


def _profile(blocks: list[tuple[float, float, float | None, float | None]]) -> Profile:
    """Blocks of (forward, backward, input part, weight part) ms at 4 samples."""
    return Profile("zb", 4, "ref", [
        BlockProfile(f"b{i}", f, b, 1000, 1000, 1000, backward_input_ms=bi, backward_weight_ms=bw)
        for i, (f, b, bi, bw) in enumerate(blocks)])


def _free(n: int) -> Cluster:
    return Cluster.from_dict({"name": "free", "servers": [{
        "name": "s", "gpus": n, "device": {"name": "d", "speed": 1.0, "memory_gb": 80},
        "levels": [{"size": n, "gbps": math.inf, "latency_us": 0}]}]})


def _chain(n: int, m: int, schedule: str) -> Plan:
    return Plan("t", 4 * m, m, 1, [StagePlan((s, s + 1), [f"s:{s}"]) for s in range(n)],
                schedule=schedule)


def test_hand_computed_two_stage_timeline():
    # stage 0: F 1, whole backward 3 (the first stage's W: it has no input gradient)
    # stage 1: F 2, B 2, W 1. Free links. By hand: s0 F0 [0,1] F1 [1,2]; s1 F0 [1,3] B0 [3,5]
    # F1 [5,7] B1 [7,9] W0 [9,10] W1 [10,11]; s0 B0 at 5 (empty) W0 [5,8] B1 at 9 W1 [9,12].
    prof = _profile([(1.0, 3.0, 1.0, 2.0), (2.0, 3.0, 2.0, 1.0)])
    res = simulate(_chain(2, 2, "zb-h1"), prof, _free(2))
    assert res.iteration_ms == pytest.approx(12.0, abs=1e-9)
    got = sorted((e.device, e.label, e.start_ms, e.end_ms) for e in res.events
                 if e.kind in ("F", "B", "W"))
    want = sorted([
        ("s:0", "0F0.0", 0, 1), ("s:0", "0F1.0", 1, 2), ("s:0", "0B0.0", 5, 5),
        ("s:0", "0W0.0", 5, 8), ("s:0", "0B1.0", 9, 9), ("s:0", "0W1.0", 9, 12),
        ("s:1", "1F0.0", 1, 3), ("s:1", "1B0.0", 3, 5), ("s:1", "1F1.0", 5, 7),
        ("s:1", "1B1.0", 7, 9), ("s:1", "1W0.0", 9, 10), ("s:1", "1W1.0", 10, 11),
    ])
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [x for g in got for x in g[2:]] == pytest.approx([x for w in want for x in w[2:]])
    one = simulate(_chain(2, 2, "1f1b"), prof, _free(2))
    assert one.iteration_ms == pytest.approx(14.0)  # 1F1B sends the gradient after B + W
    assert res.bubble_fraction < one.bubble_fraction


def test_hand_computed_three_stage_timeline():
    # F 1 everywhere; stage 0's backward 2 (all W), stages 1 and 2: B 1, W 1; m = 3.
    prof = _profile([(1.0, 2.0, 1.0, 1.0), (1.0, 2.0, 1.0, 1.0), (1.0, 2.0, 1.0, 1.0)])
    res = simulate(_chain(3, 3, "zb-h1"), prof, _free(3))
    assert res.iteration_ms == pytest.approx(11.0, abs=1e-9)
    ends = {e.label: e.end_ms for e in res.events if e.kind in ("F", "B", "W")}
    assert ends["2B2.0"] == pytest.approx(8)
    assert ends["1W0.0"] == pytest.approx(8)
    assert ends["0W2.0"] == pytest.approx(11)
    assert ends["2W2.0"] == pytest.approx(11)
    one = simulate(_chain(3, 3, "1f1b"), prof, _free(3))
    assert res.iteration_ms < one.iteration_ms
    assert res.bubble_fraction < one.bubble_fraction


def test_zb_bubble_is_smaller_than_1f1b_on_balanced_pipelines():
    for stages, m, k in itertools.product((2, 4, 6), (4, 8), (1, 2)):
        prof = _profile([(1.0, 2.0, None, None)] * stages)
        plan = {s: _chain(stages, m, s) for s in ("zb-h1", "1f1b")}
        for p in plan.values():
            p.startup_slices = k
        zb = simulate(plan["zb-h1"], prof, _free(stages))
        one = simulate(plan["1f1b"], prof, _free(stages))
        assert zb.iteration_ms < one.iteration_ms, (stages, m, k)


def test_zb_plan_json_round_trips_and_an_unknown_schedule_names_the_known_ones():
    plan = _chain(2, 2, "zb-h1")
    assert Plan.from_json(plan.to_json()).schedule == "zb-h1"
    data = plan.to_dict() | {"schedule": "zb-h9"}
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zb-h9'.*'1f1b'.*'zb-h1'"):
        Plan.from_dict(data)


def test_ascii_timeline_draws_the_deferred_weight_gradients():
    text = ascii_timeline(zb_h1(4, 4, 2), 2)
    assert "A" in text  # upper case: W, continued by ~
    assert "D~" in text
    first = text.splitlines()[0]
    assert first.index("aa") < first.index("AA")  # the slices' B before their W
