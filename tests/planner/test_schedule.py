"""Schedules: generators accepted by the validator, broken ones rejected with a marked grid."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner import schedule as sched_mod
from lightning_autopipe.planner.generators import build_schedule
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.replay import ascii_timeline, format_grid, validate
from lightning_autopipe.planner.schedule import (
    Action,
    Kind,
    format_schedule,
    forward_only,
    gpipe,
    lower_communication,
    one_f_one_b,
    parse_actions,
    parse_schedule,
    unit_sizes,
    units,
)

SHAPES = list(itertools.product(range(1, 9), range(1, 13), range(1, 5)))


def _textbook_1f1b(num_stages: int, m: int) -> dict[int, list[str]]:
    """Plain 1F1B as usually written: warm-up forwards, then one forward one backward."""
    out = {}
    for s in range(num_stages):
        warm = min(num_stages - s - 1, m)
        acts = [f"{s}F{i}.0" for i in range(warm)]
        for i in range(m - warm):
            acts += [f"{s}F{warm + i}.0", f"{s}B{i}.0"]
        acts += [f"{s}B{i}.0" for i in range(m - warm, m)]
        out[s] = acts
    return out


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_generators_pass_the_validator(num_stages: int) -> None:
    for m, k in itertools.product(range(1, 13), range(1, 5)):
        validate(one_f_one_b(num_stages, m, k), m, k)
        validate(gpipe(num_stages, m, k), m, k)
        validate(lower_communication(one_f_one_b(num_stages, m, k)), m, k)
    for m, k, j in itertools.product(range(1, 7), range(1, 4), range(2, 5)):
        validate(one_f_one_b(num_stages, m, k, j), m, k, j)
        validate(gpipe(num_stages, m, k, j), m, k, j)
        validate(lower_communication(one_f_one_b(num_stages, m, k, j)), m, k, j)
    validate(forward_only(num_stages, 5), 5, 1)


@pytest.mark.parametrize(("num_stages", "m"), [(1, 1), (2, 5), (4, 4), (5, 3), (8, 12)])
def test_plain_1f1b_is_the_textbook_schedule(num_stages: int, m: int) -> None:
    got = {s: [str(a) for a in acts] for s, acts in one_f_one_b(num_stages, m).items()}
    assert got == _textbook_1f1b(num_stages, m)


def test_sliced_1f1b_keeps_1f1b_memory_bound_and_starts_backward_early() -> None:
    for num_stages, m, k in SHAPES:
        sch = one_f_one_b(num_stages, m, k)
        for s, acts in sch.items():
            held = peak = 0.0
            for a in acts:
                size = 1 / k if a.microbatch == 0 else 1.0
                held += size if a.kind is Kind.FORWARD else -size
                peak = max(peak, held)
            assert peak <= min(num_stages - s, m) + 1e-9, (num_stages, m, k, s)
        last = [str(a) for a in sch[num_stages - 1]]
        lead = [f"{num_stages - 1}{x}0.{j}" for j in range(k) for x in "FB"]
        assert last[: 2 * k] == lead  # F0.0 B0.0 F0.1 B0.1 ... on the last stage


def test_gpipe_forwards_everything_first() -> None:
    sch = gpipe(3, 4, 2)
    for acts in sch.values():
        kinds = [a.kind for a in acts]
        assert kinds == [Kind.FORWARD] * 5 + [Kind.BACKWARD] * 5
        assert [a.unit for a in acts[:5]] == units(4, 2)
        assert [a.unit for a in acts[5:]] == units(4, 2)[::-1]


def test_drain_sliced_1f1b_keeps_the_memory_bound_and_ends_in_slices() -> None:
    for num_stages, m, k in SHAPES:
        for j in (2, 3):
            sch = one_f_one_b(num_stages, m, k, j)
            last_mb = m - 1
            for s, acts in sch.items():
                held = peak = 0.0
                for a in acts:
                    n = k if a.microbatch == 0 else j if a.microbatch == last_mb else 1
                    held += (1 / n) * (1 if a.kind is Kind.FORWARD else -1)
                    peak = max(peak, held)
                assert peak <= min(num_stages - s, m) + 1e-9, (num_stages, m, k, j, s)
            if m >= 2:
                tail = [str(a) for a in sch[num_stages - 1]][-2 * j :]
                assert tail == [f"{num_stages - 1}{x}{last_mb}.{i}" for i in range(j) for x in "FB"]
    assert units(1, 2, 3) == [(0, 0), (0, 1)]  # one micro-batch: only startup slices
    assert units(3, 2, 3) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert unit_sizes(5, 3, 2, 3) == [3, 2, 5, 2, 2, 1]


def test_docstring_timeline_is_generated_by_the_code() -> None:
    doc = sched_mod.one_f_one_b.__doc__
    for k in (1, 2):
        for line in ascii_timeline(one_f_one_b(4, 4, k), k).splitlines():
            assert line in doc
    for j in (1, 2):
        for line in ascii_timeline(one_f_one_b(2, 3, 1, j), 1, drain_slices=j).splitlines():
            assert line[len("stage 0 ") :] in doc


def test_text_round_trip() -> None:
    for num_stages, m, k in [(1, 1, 1), (3, 5, 2), (8, 12, 4), (4, 11, 3)]:
        for sch in (one_f_one_b(num_stages, m, k), gpipe(num_stages, m, k)):
            low = lower_communication(sch)
            assert parse_schedule(format_schedule(sch)) == sch
            assert parse_schedule(format_schedule(low)) == low
            for acts in low.values():
                assert parse_actions(" ".join(str(a) for a in acts)) == acts
    assert Action.parse("12SB3.1") == Action(12, Kind.SEND_B, 3, 1)
    for bad in ("2X0.1", "F0.1", "2F0", "2F0.1x"):
        with pytest.raises(ScheduleError, match="cannot parse action"):
            Action.parse(bad)
    with pytest.raises(ScheduleError, match="cannot parse schedule line"):
        parse_schedule("stage0 0F0.0")


def test_build_schedule_dispatches_on_the_plan() -> None:
    plan = Plan("t", 8, 4, 2, [StagePlan((0, 1), ["a"]), StagePlan((1, 2), ["b"])])
    assert build_schedule(plan) == one_f_one_b(2, 4, 2)
    plan.schedule = "gpipe"
    assert build_schedule(plan) == gpipe(2, 4, 2)
    plan.schedule = "zigzag"
    with pytest.raises(ScheduleError, match="unknown schedule 'zigzag'"):
        build_schedule(plan)


def test_generator_arguments_are_checked() -> None:
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer, got 0"):
        one_f_one_b(2, 0)
    with pytest.raises(ScheduleError, match="startup_slices must be a positive integer"):
        gpipe(2, 2, 0)
    with pytest.raises(ScheduleError, match="drain_slices must be a positive integer"):
        one_f_one_b(2, 2, 1, 0)


def _rejects(schedule: dict, m: int, k: int, reason: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule, m, k)
    msg = str(info.value)
    assert reason in msg
    assert "step | stage 0" in msg  # the grid
    marked = re.findall(r">([^<\s]*)<", msg)
    assert len(marked) == 1, msg  # exactly one marked cell
    return marked[0]


def _parse(lines: dict[int, str]) -> dict[int, list[Action]]:
    return {s: parse_actions(t) for s, t in lines.items()}


def test_rejects_backward_before_forward() -> None:
    sch = one_f_one_b(3, 4, 2)
    acts = sch[1]
    i, j = acts.index(Action(1, Kind.FORWARD, 1)), acts.index(Action(1, Kind.BACKWARD, 1))
    acts[i], acts[j] = acts[j], acts[i]
    assert _rejects(sch, 4, 2, "stage 1 runs 1B1.0 before its forward 1F1.0") == "1B1.0"


def test_rejects_missing_and_duplicated_actions() -> None:
    sch = one_f_one_b(3, 4, 1)
    sch[2].remove(Action(2, Kind.BACKWARD, 3))
    assert _rejects(sch, 4, 1, "stage 2 lacks 2B3.0") == "?"
    sch = one_f_one_b(3, 4, 1)
    sch[0].append(Action(0, Kind.FORWARD, 2))
    assert _rejects(sch, 4, 1, "stage 0 runs 0F2.0 twice") == "0F2.0"
    sch = one_f_one_b(2, 2, 2)
    sch[0][0] = Action(0, Kind.FORWARD, 0, 5)
    assert _rejects(sch, 2, 2, "names unit (0, 5)") == "0F0.5"
    sch = one_f_one_b(2, 2, 1)
    sch[1][0] = Action(0, Kind.FORWARD, 0)
    assert _rejects(sch, 2, 1, "0F0.0 is listed under stage 1") == "0F0.0"


def test_rejects_a_swap_that_deadlocks() -> None:
    # stage 1 wants micro-batch 1 before giving back the gradient of 0; stage 0 waits for it
    sch = _parse({0: "0F0.0 0B0.0 0F1.0 0B1.0", 1: "1F0.0 1F1.0 1B0.0 1B1.0"})
    marked = _rejects(sch, 2, 1, "deadlock")
    assert marked in ("0B0.0", "1F1.0")
    low = lower_communication(sch)
    marked = _rejects(low, 2, 1, "deadlock")
    assert marked in ("0RB0.0", "1RF1.0")


def test_rejects_mismatched_send_and_receive() -> None:
    low = lower_communication(one_f_one_b(2, 3, 1))
    # stage 1 receives micro-batch 1 first although stage 0 sends 0 first
    s1 = low[1]
    a, b = s1.index(Action(1, Kind.RECV_F, 0)), s1.index(Action(1, Kind.RECV_F, 1))
    s1[a], s1[b] = s1[b], s1[a]
    assert _rejects(low, 3, 1, "the next message from stage 0 is 0SF0.0") == "1RF1.0"
    # a send nobody receives
    low = lower_communication(one_f_one_b(2, 3, 1))
    low[1].remove(Action(1, Kind.RECV_F, 2))
    low[1].remove(Action(1, Kind.SEND_B, 2))
    low[0].remove(Action(0, Kind.RECV_B, 2))
    marked = _rejects(low, 3, 1, "receiving its input")
    assert marked == "1F2.0"
    low = lower_communication(one_f_one_b(2, 2, 1))
    low[0].append(Action(0, Kind.SEND_F, 1))
    assert _rejects(low, 2, 1, "0SF1.0 is sent but never received") == "0SF1.0"
    low = lower_communication(one_f_one_b(2, 2, 1))
    low[1].append(Action(1, Kind.SEND_F, 1))
    assert _rejects(low, 2, 1, "to stage 2, which does not exist") == "1SF1.0"


def test_compute_schedule_is_also_checked_after_lowering() -> None:
    # forwards out of order between stages: fine by unit, but the runtime's channels are FIFO
    sch = _parse({0: "0F0.0 0F1.0 0B0.0 0B1.0", 1: "1F1.0 1F0.0 1B0.0 1B1.0"})
    assert _rejects(sch, 2, 1, "after lowering") == "1RF1.0"


def test_format_grid_shows_replay_steps() -> None:
    grid = format_grid(one_f_one_b(2, 2, 1), mark=(1, 1)).splitlines()
    assert grid[0].split() == ["step", "|", "stage", "0", "stage", "1"]
    assert grid[1].split() == ["0", "|", "0F0.0"]
    assert grid[2].split() == ["1", "|", "0F1.0", ">1F0.0<"]
    assert grid[3].split() == ["2", "|", "1B0.0"]
