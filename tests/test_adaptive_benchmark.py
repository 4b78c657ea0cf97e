"""benchmarks/adaptive_report.py: the closed-loop benchmark's arithmetic on hand-made records.

The benchmark itself trains for minutes on two pinned cores (its committed result is
benchmarks/results/adaptive.md); here its tables are checked against figures computed by hand:
which steps belong to which plan and condition, the steps lost with ``replan="off"``, the
targets it marks as met or missed.
"""

from __future__ import annotations

import pytest

from benchmarks.adaptive_report import plan_of_step, report, segments, steps_lost
from lightning_autopipe.planner.plan import Plan, StagePlan


def _plan(cut: int, ms: float) -> str:
    return Plan("autopipe", 32, 2, 2, [StagePlan((0, cut), ["vm:0"]),
                                       StagePlan((cut, 19), ["vm:1"])],
                iteration_ms=ms).to_json()


def _rank(walls: list[float], switch_after: dict[int, float], first_ms: float = 1000.0,
          plans: dict[int, tuple[int, float]] | None = None) -> dict:
    """One rank's record: ``switch_after`` maps the step index in which a switch is made to
    its measured cost; ``plans``: switch number -> (cut, predicted ms)."""
    rows, done = [], 0
    for i, w in enumerate(walls):
        done += i in switch_after
        rows.append({"wall": w, "switches": done, "load": 0.5, "F": w * 0.3, "B": w * 0.5,
                     "W": 0.0, "RF": w * 0.1, "RB": 0.0, "sync": w * 0.1, "step": w})
    plans = plans or {}
    switches = [
        {"step": i + 1, "reason": "faster", "predicted_step_ms": plans.get(k, (12, 900.0))[1],
         "predicted_cost_ms": 50.0, "cost_ms": cost, "bytes_moved": 1000,
         "plan": _plan(*plans.get(k, (12, 900.0)))}
        for k, (i, cost) in enumerate(sorted(switch_after.items()), start=1)
    ]
    return {"rows": rows, "switches": switches, "first_plan": _plan(10, first_ms),
            "speeds": {"vm:0": 1.0, "vm:1": 1.0}, "setup_s": 20.0, "events": [],
            "verdicts": [{"step": 3, "switch": True, "reason": "faster", "measured_ms": 1500.0,
                          "candidate_ms": 900.0, "speeds": {"vm:1": 0.5}}]}


def _run(walls, switch_after=None, **kw) -> list[dict]:
    return [_rank(walls, switch_after or {}, **kw) for _ in range(2)]


def test_steps_are_grouped_by_plan_and_condition_leaving_out_switching_steps():
    # drift: alone 0-3, neighbour 4-7, alone 8-11; switches made in steps 5 and 9
    walls = [5000, 1000, 1000, 1000, 2000, 2500, 1500, 1500, 1600, 1700, 1000, 1000]
    run = _run(walls, {5: 60.0, 9: 70.0})
    rows = run[0]["rows"]
    assert [plan_of_step(rows, i) for i in range(12)] == [0] * 6 + [1] * 4 + [2] * 2
    segs = segments(run, "drift-auto", (4, 8, 12))
    got = [(s["phase"], s["plan"], s["steps"], s["ms"]) for s in segs]
    assert got == [(0, 0, [1, 2, 3], 1000), (1, 0, [4], 2000), (1, 1, [6, 7], 1500),
                   (2, 1, [8], 1600), (2, 2, [10, 11], 1000)]
    assert segs[2]["ranks"][1] == pytest.approx(
        {"compute": 1200.0, "wait": 150.0, "tail": 150.0, "step": 1500.0})


def test_steps_lost_is_the_extra_wall_time_per_condition_in_steps():
    auto = _run([9, 100, 100, 150, 150, 100])
    off = _run([9, 100, 100, 300, 250, 200])
    assert steps_lost(off, auto, 50.0, (3, 5, 6)) == pytest.approx([0.0, 5.0, 2.0, 7.0])


def _runs(slowed_after_ms: float, cost_ms: float) -> dict:
    single = {"rows": [1500.0, 1500.0], "load": 0.4}
    slowed_auto = _run([3000, 1200, 1200, 1210] + [slowed_after_ms] * 4, {3: cost_ms},
                       plans={1: (13, 1000.0)})
    slowed_off = _run([3000] + [1200] * 7)
    drift = [3000] + [1000] * 3 + [1500] * 4 + [1000] * 4
    drift_auto = _run(drift, {5: cost_ms, 9: cost_ms},
                      plans={1: (13, 1100.0), 2: (10, 1000.0)})
    drift_off = _run([3000] + [1000] * 3 + [1800] * 4 + [1300] * 4)
    return {"single": single, "slowed-auto": slowed_auto, "slowed-off": slowed_off,
            "drift-auto": drift_auto, "drift-off": drift_off}


def test_report_marks_the_targets_from_the_measured_figures():
    text = report(_runs(1000.0, 100.0), "cmd", (4, 8, 12))
    assert text.startswith("command: cmd")
    # after the last switch 1000 ms vs one process 1500 ms: 1.5x, predicted 1000 ms
    assert "auto after its last switch 1.500x one process (>= 1.4: met; off: 1.250x)" in text
    assert "measured / predicted 1.000 (within 5%: met; " in text
    # drift switch 1 -> neighbour under plan 1 (1500 ms) against slowed-off's 1200 ms: 1.25x
    assert "| drift-auto | 6 | faster | 1100 | 1500 | 1.250 (MISSED) |" in text
    # switch 2 -> alone again (1000 ms) against the first plan's 1000 ms; cost 0.1 step
    assert "| drift-auto | 10 | faster | 1000 | 1000 | 1.000 (met) | 50 / 100 | 0.10 (met)" in text
    # off: 4 x 300 ms more with the neighbour, 4 x 300 ms after it, in steps of 1000 ms
    assert "alone 0.0, neighbour 1.2, alone again 1.2, in all 2.4" in text


def test_report_misses_a_slow_step_and_a_costly_switch():
    text = report(_runs(1300.0, 5000.0), "cmd", (4, 8, 12))
    assert "1.154x one process (>= 1.4: MISSED" in text
    assert "measured / predicted 1.300 (within 5%: MISSED; " in text
    assert "| 50 / 5000 | 5.00 (MISSED) |" in text


def test_a_slowed_only_report_uses_the_one_process_timed_beside_each_run():
    runs = _runs(1000.0, 100.0)
    del runs["drift-auto"], runs["drift-off"]
    # slowed-auto's neighbours in time ran one process at 2000 ms, slowed-off's at 1200 ms
    runs["single-near"] = {"slowed-auto": [2000.0, 2000.0], "slowed-off": [1200.0, 1200.0]}
    for rank in runs["slowed-off"]:
        rank["speeds"] = {"vm:0": 1.0, "vm:1": 0.5}
    text = report(runs, "cmd", (4, 8, 12))
    assert "## Drift" not in text
    assert "auto after its last switch 2.000x one process (>= 1.4: met; off: 1.000x)" in text
    # discovery of slowed-auto saw two alike ranks: its rows are flagged, slowed-off's are not
    assert "INVALID: slowed-auto's discovery did not see the neighbour" in text
    assert "INVALID: slowed-off" not in text


def test_a_recalibrated_plan_is_measured_against_its_new_prediction():
    """No switch, one re-calibration after step 3 (index 2 ends it): the steps before it are
    measured against the plan-time prediction, those after against the re-calibrated one,
    in segments of their own; the drift reference is still the whole first plan."""
    runs = _runs(1000.0, 100.0)
    slowed = _run([3000, 1600, 1500, 1010, 1000, 990], first_ms=1500.0)
    for rank in slowed:
        rank["recalibrations"] = [{"step": 3, "speeds": {"vm:0": 1.5}, "predicted_before_ms":
                                   1500.0, "predicted_ms": 1000.0, "measured_step_ms": 1550.0}]
    runs["slowed-auto"] = slowed
    segs = segments(slowed, "slowed-auto", None)
    assert [(s["plan"], s["recal"], s["steps"]) for s in segs] == [(0, 0, [1, 2]),
                                                                  (0, 1, [3, 4, 5])]
    text = report(runs, "cmd", (4, 8, 12))
    assert "| slowed-auto, plan 0 | 1-2 (2) |" in text
    assert "| slowed-auto, plan 0, re-calibrated after step 3 | 3-5 (3) |" in text
    assert ("measured / predicted 1.000 (within 5%: met; the prediction its telemetry made "
            "for steps 3-5 (3): plan 0, re-calibrated after step 3)") in text
