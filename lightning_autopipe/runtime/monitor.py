"""Step telemetry: where each rank's training step went, beside the simulator's prediction.

The executor records the perf-counter start and end of every action of its last step
(``PipelineExecutor.timeline``); a :class:`StepMonitor` wraps a training step, reads that seam and
turns it into a :class:`StepRecord`: compute per action kind (F, B, W), blocked in receives of
activations (RF) and gradients (RB), sends (SF + SB), the tail after the last action (waiting for
sends, the loss broadcast, the gradient sync), the whole step and the step's peak memory, next to
what :func:`~lightning_autopipe.planner.simulate.simulate` predicts for this rank's device (its
step and its compute per kind). The benchmarks time their pipelines with the same functions
(:func:`breakdown`, :func:`predicted_compute`), so a table and a training log count alike.

Clocks: on the CPU everything is perf-counter time. On CUDA the step itself is timed with CUDA
events (queued work included) and the peak is the caching allocator's over the step; the
per-action split still comes from the executor's host timeline (an action's host time includes
the waits its kernels force). On the CPU the peak is the process's resident high-water mark (the
figure an out-of-memory kill acts on; the plan's tensor-byte prediction is checked by
:mod:`~lightning_autopipe.runtime.memory`).

Rank 0 gathers a summary of every rank's recent window with one small all-gather of a float
tensor per logging interval (:func:`gather_summaries`, with a timeout), so telemetry adds no
collective to the steps in between.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_autopipe.errors import ClusterError, PipelineRuntimeError

__all__ = [
    "Prediction",
    "RankSummary",
    "StepBreakdown",
    "StepMonitor",
    "StepRecord",
    "WARMUP_STEPS",
    "breakdown",
    "gather_summaries",
    "pipeline_prediction",
    "predict_rank",
    "predicted_compute",
    "summarise",
]

_KINDS = ("F", "B", "W", "RF", "RB", "SF", "SB")

#: Steps at the start of every plan (the run's first, and the first after each switch) that a
#: :class:`StepMonitor` measures but keeps out of its window. Such a step pays one-time work that
#: the steps after it do not: lazily made state (autograd and autocast caches, a gradient
#: scaler's tensors), the allocator growing to the step's peak, the first message between two
#: ranks, a compiled stage's first graphs. Medians are robust to one slow step only when the
#: window is long; with a short one (2 steps) the first step alone could make a rank that runs at
#: its planned pace measure at a tenth of it, and so ask for a switch that nothing explains.
WARMUP_STEPS = 1


class _Compute:
    """``compute_ms`` of a record with ``forward_ms``, ``backward_ms`` and ``weight_ms``."""

    @property
    def compute_ms(self) -> float:
        """F + B + W: the time this rank computed."""
        return self.forward_ms + self.backward_ms + self.weight_ms


@dataclass(frozen=True)
class StepBreakdown(_Compute):
    """Where one executor step went, ms (see :func:`breakdown`)."""

    forward_ms: float
    backward_ms: float
    weight_ms: float
    recv_f_ms: float
    recv_b_ms: float
    send_f_ms: float
    send_b_ms: float
    tail_ms: float
    step_ms: float

    def as_dict(self) -> dict[str, float]:
        """The benchmarks' table keys: F, B, W, RF, RB, SF, SB, ``sync`` (the tail), ``step``."""
        return {"F": self.forward_ms, "B": self.backward_ms, "W": self.weight_ms,
                "RF": self.recv_f_ms, "RB": self.recv_b_ms, "SF": self.send_f_ms,
                "SB": self.send_b_ms, "sync": self.tail_ms, "step": self.step_ms}


def breakdown(timeline: Sequence[tuple[Any, float, float]], t0: float, t1: float,
              step_ms: float | None = None) -> StepBreakdown:
    """Sum an executor timeline (``(action, start, end)`` perf-counter seconds) by action kind.

    ``t0`` / ``t1``: perf-counter seconds around the whole step; the tail is ``t1`` minus the end
    of the last action. ``step_ms`` overrides ``(t1 - t0)`` (a CUDA-event time of the step).
    """
    ms = dict.fromkeys(_KINDS, 0.0)
    for a, b, e in timeline:
        kind = a.kind.value
        if kind in ms:
            ms[kind] += (e - b) * 1e3
    tail = (t1 - timeline[-1][2]) * 1e3 if timeline else 0.0
    step = (t1 - t0) * 1e3 if step_ms is None else step_ms
    return StepBreakdown(ms["F"], ms["B"], ms["W"], ms["RF"], ms["RB"], ms["SF"], ms["SB"],
                         tail, step)


def predicted_compute(sim: Any, device: str) -> dict[str, float]:
    """The simulator's compute ms on ``device`` in one step, per kind (F, B, W)."""
    out = dict.fromkeys(("F", "B", "W"), 0.0)
    for e in sim.events:
        if e.device == device and e.kind in out:
            out[e.kind] += e.end_ms - e.start_ms
    return out


@dataclass(frozen=True)
class Prediction(_Compute):
    """What the simulator predicts for one rank's step: the step, compute per kind, the bubble,
    the peak memory, and the speed the plan's cluster gives this rank's device type."""

    device: str
    step_ms: float
    forward_ms: float
    backward_ms: float
    weight_ms: float
    bubble: float
    peak_memory_bytes: int
    speed: float

    @classmethod
    def unknown(cls, device: str, plan: Any, speed: float = math.nan) -> Prediction:
        """No profile to simulate (a plan given without one): the plan's own step and peak
        only; the compute per kind, and so the measured speed, are unknown (NaN)."""
        step = float(plan.iteration_ms) if plan.iteration_ms else math.nan
        return cls(device, step, math.nan, math.nan, math.nan, float(plan.bubble_fraction or
                   math.nan), int(plan.peak_memory_bytes.get(device, 0)), float(speed))


def predict_rank(plan: Any, profile: Any, cluster: Any, device: str, sim: Any = None
                 ) -> Prediction:
    """The simulator's prediction for the rank driving ``device`` (``sim``: a ready
    ``simulate(plan, profile, cluster)``, else it is run here)."""
    if sim is None:
        from lightning_autopipe.planner.simulate import simulate

        sim = simulate(plan, profile, cluster)
    comp = predicted_compute(sim, device)
    speed = cluster.device(device).spec.speed
    return Prediction(device, float(sim.iteration_ms), comp["F"], comp["B"], comp["W"],
                      float(sim.bubble_fraction), int(plan.peak_memory_bytes.get(device, 0)),
                      float(speed))


def pipeline_prediction(pipe: Any) -> Prediction:
    """This rank's :class:`Prediction` for a
    :class:`~lightning_autopipe.runtime.build.LocalPipeline`: its plan simulated on its profile
    and cluster, or the plan's own figures without a profile."""
    lay = pipe.layout
    device = pipe.plan.stages[lay.stage].devices[lay.replica]
    if pipe.profile is not None and pipe.cluster is not None:
        return predict_rank(pipe.plan, pipe.profile, pipe.cluster, device)
    speed = math.nan
    if pipe.cluster is not None:
        try:
            speed = float(pipe.cluster.device(device).spec.speed)
        except ClusterError:  # a plan for other device names than the cluster's
            speed = math.nan
    return Prediction.unknown(device, pipe.plan, speed)


@dataclass(frozen=True)
class StepRecord:
    """One rank's measured training step (ms, bytes), with its step number."""

    step: int
    measured: StepBreakdown
    peak_memory_bytes: int


@dataclass(frozen=True)
class RankSummary:
    """One rank's window of steps, reduced robustly (medians), beside its prediction.

    ``speed`` is the device speed the measurements imply, in the cluster's units (relative to
    the profile's device): the plan's speed times predicted / measured compute, the median of
    the per-step ratios (one slow step moves it by nothing). ``speed_planned`` is the plan's.
    """

    rank: int
    stage: int
    replica: int
    steps: int
    step_ms: float
    compute_ms: float
    forward_ms: float
    backward_ms: float
    weight_ms: float
    recv_ms: float
    send_ms: float
    tail_ms: float
    peak_memory_bytes: float
    speed: float
    speed_planned: float
    predicted_step_ms: float
    predicted_compute_ms: float
    predicted_bubble: float
    predicted_memory_bytes: float

    @property
    def speed_ratio(self) -> float:
        """Measured over planned speed (below 1: slower than the plan assumed)."""
        return self.speed / self.speed_planned if self.speed_planned > 0 else math.nan

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(getattr(self, f.name)) for f in fields(self)],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RankSummary:
        vals = t.tolist()
        kw: dict[str, Any] = {}
        for f, v in zip(fields(cls), vals):
            kw[f.name] = int(v) if f.name in ("rank", "stage", "replica", "steps") else float(v)
        return cls(**kw)



def summarise(records: Sequence[StepRecord], prediction: Prediction, rank: int, stage: int,
              replica: int = 0, steps: int | None = None) -> RankSummary:
    """Medians of a window of :class:`StepRecord` (robust to one slow step) and the speed they
    imply (see :class:`RankSummary`); ``steps`` overrides the count it reports (default: how
    many records).

    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("summarise needs at least one StepRecord")
    ms = [r.measured for r in records]

    def med(values: Sequence[float]) -> float:
        return float(statistics.median(values))

    ratios = [prediction.compute_ms / m.compute_ms for m in ms if m.compute_ms > 0]
    speed = prediction.speed * med(ratios) if ratios else math.nan  # NaN stays NaN
    return RankSummary(
        rank=rank, stage=stage, replica=replica,
        steps=len(records) if steps is None else int(steps),
        step_ms=med([m.step_ms for m in ms]),
        compute_ms=med([m.compute_ms for m in ms]),
        forward_ms=med([m.forward_ms for m in ms]),
        backward_ms=med([m.backward_ms for m in ms]),
        weight_ms=med([m.weight_ms for m in ms]),
        recv_ms=med([m.recv_f_ms + m.recv_b_ms for m in ms]),
        send_ms=med([m.send_f_ms + m.send_b_ms for m in ms]),
        tail_ms=med([m.tail_ms for m in ms]),
        peak_memory_bytes=float(max(r.peak_memory_bytes for r in records)),
        speed=speed, speed_planned=prediction.speed,
        predicted_step_ms=prediction.step_ms,
        predicted_compute_ms=prediction.compute_ms,
        predicted_bubble=prediction.bubble,
        predicted_memory_bytes=float(prediction.peak_memory_bytes),
    )


class StepMonitor:
    """Measures every training step of one rank and keeps the last ``window`` of them, after
    its first ``warmup`` steps (:data:`WARMUP_STEPS`; a monitor is made afresh for every plan).

    Attributes:
        records: the window (at most ``window`` steps, none of the first ``warmup``).
        last: the step measured last, warm-up or not (None before the first).

    Args:
        executor: the rank's executor (its ``timeline`` is read after each step).
        prediction: the simulator's prediction for this rank (:func:`predict_rank`).
        rank, stage, replica: this rank's global rank, stage and replica.
        device: the torch device the stage runs on (CUDA: events and the allocator's peak).
        window: how many recent steps :meth:`summary` reduces.
        warmup: how many first steps stay out of the window.
    """

    def __init__(self, executor: Any, prediction: Prediction, *, rank: int, stage: int,
                 replica: int = 0, device: torch.device | str = "cpu", window: int = 10,
                 warmup: int = WARMUP_STEPS) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {warmup}")
        self.executor = executor
        self.prediction = prediction
        self.rank, self.stage, self.replica = rank, stage, replica
        self.device = torch.device(device)
        self.records: deque[StepRecord] = deque(maxlen=window)
        self.warmup = warmup
        self.last: StepRecord | None = None
        self._warm: list[StepRecord] = []
        self._count = 0

    @classmethod
    def for_pipeline(cls, pipe: Any, window: int = 10) -> StepMonitor:
        """The monitor of a :class:`~lightning_autopipe.runtime.pipeline.LocalPipeline`."""
        lay = pipe.layout
        return cls(pipe.executor, pipeline_prediction(pipe), rank=lay.rank, stage=lay.stage,
                   replica=lay.replica, device=pipe.executor.device, window=window)

    @property
    def steps_seen(self) -> int:
        """Training steps measured so far."""
        return self._count

    @contextmanager
    def step(self, number: int | None = None) -> Iterator[None]:
        """Around one ``executor.train_step``: measures it and appends its record."""
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        events = None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        t0 = time.perf_counter()
        yield
        step_ms = None
        if events is not None:
            events[1].record()
            events[1].synchronize()
        t1 = time.perf_counter()
        if events is not None:
            step_ms = float(events[0].elapsed_time(events[1]))
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = _resident_peak_bytes()
        measured = breakdown(self.executor.timeline, t0, t1, step_ms)
        self.add(StepRecord(self._count if number is None else int(number), measured, peak))

    def add(self, record: StepRecord) -> None:
        """Count one measured step: into the window once the warm-up steps are past."""
        (self._warm if self._count < self.warmup else self.records).append(record)
        self.last = record
        self._count += 1

    def summary(self) -> RankSummary:
        """This rank's recent window, reduced (see :func:`summarise`). Before the window has a
        step, the warm-up steps reduced, reporting 0 steps (a logging step that early still
        has figures; a re-plan check sees no window).

        Raises:
            ValueError: no step measured yet.
        """
        if self.records:
            return summarise(list(self.records), self.prediction, self.rank, self.stage,
                             self.replica)
        return summarise(self._warm, self.prediction, self.rank, self.stage, self.replica,
                         steps=0)


def gather_summaries(summary: RankSummary, timeout: float | timedelta, group: Any = None
                     ) -> list[RankSummary]:
    """Every rank's summary, in rank order (collective over ``group``; one float tensor each).

    A 1-rank or uninitialised world returns ``[summary]``.

    Raises:
        PipelineRuntimeError: a peer did not join within ``timeout`` (it failed or hangs).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [summary]
    mine = summary.to_tensor()
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    try:
        dist.all_gather(rows, mine, group=group, async_op=True).wait(timeout=wait)
    except Exception as exc:
        raise PipelineRuntimeError(
            f"rank {summary.rank}: the step-telemetry all-gather did not complete within "
            f"{wait.total_seconds():.0f} s ({type(exc).__name__}: {exc}); a peer failed or is "
            "stuck: its own error names the cause"
        ) from exc
    return [RankSummary.from_tensor(r.cpu()) for r in rows]


def _resident_peak_bytes() -> int:
    """The process's resident-set high-water mark (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
