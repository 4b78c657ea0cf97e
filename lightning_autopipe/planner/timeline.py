"""Pictures of a simulated step: a Chrome/Perfetto trace and a PNG Gantt chart."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_autopipe.extras import import_extra
from lightning_autopipe.planner.simulate import Event, SimResult

__all__ = ["write_chrome_trace", "write_png", "chrome_trace"]

_COLOURS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B", "SF": "#9D9D9D", "SB": "#BAB0AC",
            "AR": "#E45756"}
_COMPUTE = ("F", "B", "W", "AR")


def _lanes(events: list[Event]) -> list[int]:
    """Greedy interval packing: the lane of each (start-sorted) transfer so none overlap."""
    ends: list[float] = []
    out = []
    for e in events:
        for i, end in enumerate(ends):
            if end <= e.start_ms:
                ends[i] = e.end_ms
                out.append(i)
                break
        else:
            ends.append(e.end_ms)
            out.append(len(ends) - 1)
    return out


def chrome_trace(result: SimResult) -> dict:
    """The trace as a dict: one process per device, compute on thread 0, transfers below it.

    Times are microseconds (the format's unit). Transfers that overlap get extra threads so
    every thread's slices nest, as the viewers require.
    """
    order = {d: i for i, d in enumerate(result.devices)}
    out: list[dict] = []
    for d, pid in order.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": d}})
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}}
        )
    by_dev: dict[str, list[Event]] = {d: [] for d in order}
    for e in result.events:
        if e.kind in _COMPUTE:
            out.append(_x(e, order[e.device], 0, e.label))
        else:
            by_dev[e.device].append(e)
    for d, evs in by_dev.items():
        evs.sort(key=lambda e: e.start_ms)
        lanes = _lanes(evs)
        for lane in sorted(set(lanes)):
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": order[d],
                    "tid": 1 + lane,
                    "args": {"name": f"send {lane}"},
                }
            )
        for e, lane in zip(evs, lanes):
            out.append(_x(e, order[d], 1 + lane, f"{e.label}->{e.peer}"))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            "iteration_ms": result.iteration_ms,
            "bubble_fraction": result.bubble_fraction,
        },
    }


def _x(e: Event, pid: int, tid: int, name: str) -> dict:
    return {
        "ph": "X",
        "name": name,
        "cat": e.kind,
        "pid": pid,
        "tid": tid,
        "ts": e.start_ms * 1e3,
        "dur": max(0.0, e.end_ms - e.start_ms) * 1e3,
        "args": {"stage": e.stage, "unit": list(e.unit) if e.unit else None, "peer": e.peer},
    }


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    """Write the step as Chrome/Perfetto ``traceEvents`` JSON (open in ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(chrome_trace(result)))


def write_png(result: SimResult, path: str | Path, *, title: str | None = None) -> None:
    """Write a Gantt chart: devices top to bottom, time left to right.

    Forward, backward and all-reduce are full-height bars (slices of micro-batch 0 show as
    short bars, labelled where they are wide enough: ``mb.slice``, ``chunk:mb.slice`` when a
    device holds several chunks); transfers are thin bars under the sender.
    """
    matplotlib = import_extra("matplotlib", "the timeline picture (timeline.png)")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    devs = result.devices
    row = {d: i for i, d in enumerate(devs)}
    span = max(result.iteration_ms, 1e-9)
    fig_h = 1.2 + 0.35 * len(devs)
    fig, ax = plt.subplots(figsize=(14, min(fig_h, 40)))
    bars: dict[tuple[str, bool], tuple[list, list]] = {}
    held: dict[str, set[int]] = {}
    for e in result.events:
        held.setdefault(e.device, set()).add(e.stage)
    chunked = any(len(c) > 1 for c in held.values())  # label bars with their chunk too
    for e in result.events:
        compute = e.kind in _COMPUTE
        xs, ys = bars.setdefault((e.kind, compute), ([], []))
        xs.append((e.start_ms, max(e.end_ms - e.start_ms, span * 1e-4)))
        ys.append(row[e.device])
        width = e.end_ms - e.start_ms
        if compute and e.kind != "AR" and width > span / 40 and len(devs) <= 32:
            ax.text(
                e.start_ms + width / 2,
                row[e.device],
                (f"{e.stage}:" if chunked else "") + f"{e.unit[0]}.{e.unit[1]}" if e.unit
                else "",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    for (kind, compute), (xs, ys) in bars.items():
        h, off = (0.7, 0.0) if compute else (0.12, 0.42)
        for y in sorted(set(ys)):
            seg = [x for x, yy in zip(xs, ys) if yy == y]
            ax.broken_barh(
                seg,
                (y - h / 2 + off, h),
                facecolors=_COLOURS.get(kind, "#999999"),
                edgecolor="white" if compute else "none",
                linewidth=0.4,
            )
    ax.set_yticks(range(len(devs)))
    ax.set_yticklabels(devs, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)")
    ax.set_title(
        title or f"iteration {result.iteration_ms:.2f} ms, bubble {result.bubble_fraction:.1%}"
    )
    kinds = {e.kind for e in result.events}
    names = {
        "F": "forward",
        "B": "input backward" if "W" in kinds else "backward",
        "W": "weight backward",
        "SF": "send act.",
        "SB": "send grad",
        "AR": "all-reduce",
    }
    ax.legend(
        handles=[Patch(color=c, label=names[k]) for k, c in _COLOURS.items()
                 if k != "W" or "W" in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08 if len(devs) > 8 else -0.2),
        fontsize=7,
        ncol=6,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
