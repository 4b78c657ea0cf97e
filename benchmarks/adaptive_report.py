"""The tables of ``benchmarks/adaptive.py``: pure functions over its runs' step records.

A run is one record per rank (``rows``: per step the wall time on that rank, ``switches`` done
by the step's end and the monitor's breakdown; ``switches``: the strategy's
:class:`~lightning_autopipe.lightning.replan.SwitchRecord` fields; ``first_plan``; ``events``).
Step ``i`` runs under plan ``rows[i - 1]["switches"]`` (0: the first plan); the step in which a
switch is made (it ends in the ``optimizer_step``) is counted apart: its wall time holds the
switch. Step 0 (lazy initialisation) is left out of every median.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.runtime.discover import SLOWER

__all__ = ["Segment", "plan_of_step", "report", "saw_neighbour", "segments",
           "steps_lost"]

BATCH = 32
TARGET_X = 1.40  # slowed, auto: x one fast process
TARGET_PRED = 0.05  # slowed, auto: |measured / predicted - 1| after the last switch
TARGET_FRESH = 0.10  # drift: after each switch, step within this of a plan made fresh
TARGET_COST_STEPS = 2.0  # drift: a switch costs less than this many steps
CONDITIONS = ("alone", "neighbour", "alone again")


class Segment(dict):
    """Steps of one plan under one condition and one calibration: ``run``, ``phase``,
    ``plan`` (index), ``recal`` (re-calibrations of the plan before these steps), ``steps``
    (step indices, the switching step and step 0 left out), ``walls`` (their wall times),
    ``ms`` (median wall), ``ranks`` (per rank: median compute / wait / tail / step of the
    monitor)."""


def plan_of_step(rows: Sequence[dict], i: int) -> int:
    """The plan (0 first, k after the k-th switch) step ``i`` ran under."""
    return int(rows[i - 1]["switches"]) if i else 0


def _phase(i: int, drift: Sequence[int] | None) -> int:
    if not drift:
        return 1  # slowed: the neighbour throughout
    return 0 if i < drift[0] else 1 if i < drift[1] else 2


def _switching(rows: Sequence[dict], i: int) -> bool:
    return int(rows[i]["switches"]) > plan_of_step(rows, i)


def segments(run: Sequence[dict], name: str, drift: Sequence[int] | None) -> list[Segment]:
    """The run's steps grouped by (condition, plan), in order."""
    rows = run[0]["rows"]
    out: list[Segment] = []
    for i in range(1, len(rows)):
        if _switching(rows, i):
            continue
        plan = plan_of_step(rows, i)
        key = (_phase(i, drift), plan, len(_recalibrations(run, plan, i)))
        if not out or (out[-1]["phase"], out[-1]["plan"], out[-1]["recal"]) != key:
            out.append(Segment(run=name, phase=key[0], plan=key[1], recal=key[2], steps=[]))
        out[-1]["steps"].append(i)
    for seg in out:
        seg["samples"] = _plan(run, seg["plan"]).global_batch_size
        seg["walls"] = [rows[i]["wall"] for i in seg["steps"]]
        seg["ms"] = statistics.median(seg["walls"])
        seg["ranks"] = [_rank_medians(r["rows"], seg["steps"]) for r in run]
    return out


def _rank_medians(rows: Sequence[dict], steps: Sequence[int]) -> dict[str, float]:
    def med(fn: Any) -> float:
        vals = [fn(rows[i]) for i in steps if "F" in rows[i]]
        return statistics.median(vals) if vals else float("nan")

    return {"compute": med(lambda r: r["F"] + r["B"] + r["W"]),
            "wait": med(lambda r: r["RF"] + r["RB"]), "tail": med(lambda r: r["sync"]),
            "step": med(lambda r: r["step"])}


def steps_lost(off: Sequence[dict], auto: Sequence[dict], per_step_ms: float,
               drift: Sequence[int]) -> list[float]:
    """Per condition, then in all: the wall time ``off`` took beyond ``auto`` over the same
    steps (step 0 left out), in steps of ``per_step_ms``."""
    a, b = off[0]["rows"], auto[0]["rows"]
    lost = [0.0, 0.0, 0.0]
    for i in range(1, min(len(a), len(b))):  # each step's wall per BATCH samples
        lost[_phase(i, drift)] += (_per_batch(off, i, a[i]["wall"])
                                   - _per_batch(auto, i, b[i]["wall"]))
    return [x / per_step_ms for x in (*lost, sum(lost))]


def _per_batch(run: Sequence[dict], i: int, ms: float) -> float:
    """Step ``i``'s ``ms`` restated per ``BATCH`` samples (a plan with replicas trains more)."""
    return ms * BATCH / _plan(run, plan_of_step(run[0]["rows"], i)).global_batch_size


def _recalibrations(run: Sequence[dict], plan: int, i: int) -> list[dict]:
    """The re-calibrations of plan ``plan`` in force at step ``i`` (each ends the step
    ``step`` counts, as a switch does: step indices from ``step`` on run after it)."""
    start = run[0]["switches"][plan - 1]["step"] if plan else 0
    return [r for r in run[0].get("recalibrations", []) if start < r["step"] <= i]


def _predicted(run: Sequence[dict], seg: Segment) -> float:
    """The step the run's telemetry predicted for the segment: the plan's at the speeds it was
    made for, or those of its last re-calibration before the segment."""
    recal = _recalibrations(run, seg["plan"], seg["steps"][0])
    if recal:
        return float(recal[-1]["predicted_ms"])
    if seg["plan"] == 0:
        return Plan.from_json(run[0]["first_plan"]).iteration_ms
    return float(run[0]["switches"][seg["plan"] - 1]["predicted_step_ms"])


def _label(run: Sequence[dict], seg: Segment) -> str:
    recal = _recalibrations(run, seg["plan"], seg["steps"][0])
    return f"plan {seg['plan']}" + (f", re-calibrated after step {recal[-1]['step']}"
                                    if recal else "")


def _plan(run: Sequence[dict], plan: int) -> Plan:
    return Plan.from_json(run[0]["first_plan"] if plan == 0
                          else run[0]["switches"][plan - 1]["plan"])


def _samples(run: Sequence[dict], seg: Segment) -> int:
    """Samples per step of the segment's plan: the loader's batch times the replicas."""
    return _plan(run, seg["plan"]).global_batch_size


def _layout(run: Sequence[dict], plan: int) -> str:
    p = _plan(run, plan)
    blocks = "/".join(f"{s.blocks[0]}-{s.blocks[1]}@{'+'.join(s.devices)}" for s in p.stages)
    shares = f" batches {'+'.join(map(str, p.replica_batches))}" if p.replica_batches else ""
    return (f"{blocks} m{p.num_microbatches} k{p.startup_slices} j{p.drain_slices} "
            f"{p.schedule}{shares}")


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(runs: dict[str, Any], command: str, drift: Sequence[int]) -> str:
    """The whole markdown report (see ``benchmarks/adaptive.py``): the slowed section when
    its two runs are there, the drift section when its two are."""
    names = [k for k in ("slowed-auto", "slowed-off", "drift-auto", "drift-off") if k in runs]
    segs = {k: segments(runs[k], k, None if k.startswith("slowed") else drift) for k in names}
    single = statistics.median(runs["single"]["rows"])
    lines = [f"command: {command}", ""]
    lines += [
        "discovered speeds: " + "; ".join(
            f"{k}: {runs[k][0]['speeds']} (setup {runs[k][0]['setup_s']:.0f} s)"
            for k in segs),
        f"one process on the fast core: {single:.0f} ms/step (load average "
        f"{runs['single']['load']:.2f})", "",
    ]
    slowed = "slowed-auto" in segs and "slowed-off" in segs
    if slowed:
        lines += _slowed(runs, segs, single)
    if "drift-auto" in segs and "drift-off" in segs:
        lines += _drift(runs, segs, drift, slowed)
    lines += ["", "Every re-plan check of the auto runs (rank 0's verdict; speeds: measured / "
              "planned):", ""]
    for name in ("slowed-auto", "drift-auto"):
        for v in runs.get(name, [{}])[0].get("verdicts", []):
            speeds = ", ".join(f"{d} x{r:.2f}" for d, r in v["speeds"].items())
            lines.append(f"- {name} after step {v['step']}: {'SWITCH' if v['switch'] else 'keep'}"
                         f" (measured {v['measured_ms']:.0f} ms, candidate "
                         f"{v['candidate_ms']:.0f} ms; {speeds}): {v['reason']}")
    return "\n".join(lines)


def saw_neighbour(run: Sequence[dict], slowed: str = "vm:1") -> bool:
    """Whether discovery made the slowed rank a slower type (speed below ``1 / SLOWER``): a
    slowed run whose discovery did not see the neighbour does not test the slowed case."""
    return float(run[0]["speeds"].get(slowed, 1.0)) < 1.0 / SLOWER


def _near(runs: dict[str, Any], name: str, single: float) -> float:
    """One process timed just before and after run ``name`` (else the whole run's median)."""
    near = runs.get("single-near", {}).get(name)
    return statistics.median(near) if near else single


def _slowed(runs: dict[str, Any], segs: dict[str, list[Segment]], single: float) -> list[str]:
    sa = runs["slowed-auto"]
    lines = [
        "## Slowed from the start", "",
        "| run | steps | samples/s | x one process | step ms | predicted ms | measured / "
        "predicted | plan | load | rank: compute / wait / tail ms |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
        f"| one process, fast core | {len(runs['single']['rows'])} | {BATCH / single * 1e3:.2f}"
        f" | 1.000 | {single:.0f} | - | - | 1 process | {runs['single']['load']:.2f} | - |",
    ]
    for seg in segs["slowed-auto"] + segs["slowed-off"]:
        lines.append(_seg_row(seg, runs[seg["run"]], _near(runs, seg["run"], single)))
    last, off = segs["slowed-auto"][-1], segs["slowed-off"][-1]
    x = _x(_near(runs, "slowed-auto", single), last, sa)
    ratio = last["ms"] / _predicted(sa, last)
    off_x = _x(_near(runs, "slowed-off", single), off, runs["slowed-off"])
    lines += ["", f"targets: auto after its last switch {x:.3f}x one process (>= {TARGET_X}: "
              f"{_mark(x >= TARGET_X)}; off: {off_x:.3f}x); measured / predicted {ratio:.3f} "
              f"(within {TARGET_PRED:.0%}: {_mark(abs(ratio - 1) <= TARGET_PRED)}; the "
              f"prediction its telemetry made for steps {_span(last)}: {_label(sa, last)})"]
    if "single-near" in runs:
        lines.append("(x one process: against one process timed just before and after each "
                     "run, " + ", ".join(f"{k} {_near(runs, k, single):.0f} ms"
                                         for k in ("slowed-auto", "slowed-off")) + ")")
    for name in ("slowed-auto", "slowed-off"):
        if not saw_neighbour(runs[name]):
            lines.append(f"INVALID: {name}'s discovery did not see the neighbour (speeds "
                         f"{runs[name][0]['speeds']}: vm:1 not below 1/{SLOWER} of vm:0); other "
                         "load on the fast core hid it, so its rows do not test the slowed case")
    lines.append("")
    return lines + _switch_table({"slowed-auto": sa}, segs, None, None)


def _drift(runs: dict[str, Any], segs: dict[str, list[Segment]], drift: Sequence[int],
           slowed: bool) -> list[str]:
    da, do = runs["drift-auto"], runs["drift-off"]
    # a plan made fresh for a condition: the faster of the two runs' first plans, each
    # discovered and planned under it (the neighbour's: the slowed runs', when they ran)
    fresh_alone = min(_plan_ms(segs[k], 0, 0) for k in ("drift-auto", "drift-off"))
    fresh_neighbour = (min(_plan_ms(segs[k], 0, 1) for k in ("slowed-auto", "slowed-off"))
                       if slowed else float("nan"))
    lines = [
        "", f"## Drift: the neighbour from step {drift[0]} to step {drift[1]} of {drift[2]}", "",
        "| run | condition | steps | step ms | predicted ms | plan | rank: compute / wait / "
        "tail ms |", "|---|---|---|---:|---:|---|---|",
    ]
    for seg in segs["drift-auto"] + segs["drift-off"]:
        run = runs[seg["run"]]
        ranks = _ranks(seg)
        lines.append(f"| {seg['run']}, {_label(run, seg)} | {CONDITIONS[seg['phase']]} | "
                     f"{_span(seg)} | "
                     f"{seg['ms']:.0f} | {_predicted(run, seg):.0f} | "
                     f"{_layout(run, seg['plan'])} | {ranks} |")
    lines += ["", "Each drift switch against a plan made fresh for its conditions, the faster "
              f"first plan of the two runs discovered under them (neighbour: the slowed runs', "
              f"{fresh_neighbour:.0f} ms; alone: the drift runs', {fresh_alone:.0f} ms):", ""]
    lines += _switch_table({"drift-auto": da}, segs, fresh_alone, fresh_neighbour)
    lost = steps_lost(do, da, fresh_alone, drift)
    lines += ["", f"steps lost with replan='off' (its extra wall time over the auto run's, in "
              f"steps of {fresh_alone:.0f} ms): alone {lost[0]:.1f}, neighbour {lost[1]:.1f}, "
              f"alone again {lost[2]:.1f}, in all {lost[3]:.1f}"]
    return lines


def _plan_ms(segs: Sequence[Segment], plan: int, phase: int) -> float:
    """The median step of plan ``plan`` in condition ``phase`` per ``BATCH`` samples, over its
    segments (one plan re-calibrated keeps its layout: its steps are one sample)."""
    walls = [w * BATCH / s["samples"] for s in segs if (s["plan"], s["phase"]) == (plan, phase)
             for w in s["walls"]]
    return statistics.median(walls) if walls else float("nan")


def _ranks(seg: Segment) -> str:
    return "; ".join(f"{r}: {d['compute']:.0f} / {d['wait']:.0f} / {d['tail']:.0f}"
                     for r, d in enumerate(seg["ranks"]))


def _span(seg: Segment) -> str:
    return f"{seg['steps'][0]}-{seg['steps'][-1]} ({len(seg['steps'])})"


def _x(single: float, seg: Segment, run: Sequence[dict]) -> float:
    """Samples per second of the segment over one process's (``single`` ms per ``BATCH``)."""
    return (_samples(run, seg) / seg["ms"]) / (BATCH / single)


def _seg_row(seg: Segment, run: Sequence[dict], single: float) -> str:
    pred = _predicted(run, seg)
    load = statistics.mean(run[0]["rows"][i]["load"] for i in seg["steps"])
    rate = _samples(run, seg) / seg["ms"] * 1e3
    return (f"| {seg['run']}, {_label(run, seg)} | {_span(seg)} | {rate:.2f}"
            f" | {_x(single, seg, run):.3f} | {seg['ms']:.0f} | {pred:.0f} | "
            f"{seg['ms'] / pred:.3f} | {_layout(run, seg['plan'])} | {load:.2f} | "
            f"{_ranks(seg)} |")


def _switch_table(runs: dict[str, Any], segs: dict[str, list[Segment]], fresh_alone: Any,
                  fresh_neighbour: Any) -> list[str]:
    fresh = fresh_alone is not None
    lines = ["| run | after step | reason | predicted ms | measured after ms | "
             + ("x fresh plan | " if fresh else "")
             + "cost predicted / measured ms | cost in steps | bytes moved |",
             "|---|---:|---|---:|---:|" + ("---:|" if fresh else "") + "---:|---:|---:|"]
    for name, run in runs.items():
        for k, sw in enumerate(run[0]["switches"], start=1):
            after = next((s for s in segs[name] if s["plan"] == k), None)
            ms = after["ms"] if after else float("nan")
            cost_steps = sw["cost_ms"] / ms if after else float("nan")
            row = (f"| {name} | {sw['step']} | {sw['reason']} | {sw['predicted_step_ms']:.0f} "
                   f"| {ms:.0f} | ")
            if fresh:  # per BATCH samples, as _plan_ms gives the fresh plans'
                ref = fresh_neighbour if after and after["phase"] == 1 else fresh_alone
                rel = (ms * BATCH / after["samples"] if after else ms) / ref
                row += f"{rel:.3f} ({_mark(rel <= 1 + TARGET_FRESH)}) | "
            row += (f"{sw['predicted_cost_ms']:.0f} / {sw['cost_ms']:.0f} | {cost_steps:.2f} "
                    f"({_mark(cost_steps < TARGET_COST_STEPS)}) | {sw['bytes_moved']} |")
            lines.append(row)
    if len(lines) == 2:
        lines.append("| (no switch) |" + " - |" * (7 if fresh else 6))
    return lines
