"""Step telemetry through the Trainer's logger: what the strategy calls around each step.

Every rank measures every training step (:class:`~lightning_autopipe.runtime.monitor.
StepMonitor`); every ``log_every_n_steps`` steps all ranks join one small all-gather of their
window summaries and rank 0 hands these metrics to every logger of the Trainer (CSV,
TensorBoard ...), at the Trainer's global step:

* ``autopipe/step_ms`` (the slowest rank's median step over the window) and
  ``autopipe/step_ms_predicted`` (the simulator's step for the running plan at the speeds it
  assumes: those it was planned with, until a re-plan check re-calibrates them to the
  measured ones, :mod:`~lightning_autopipe.lightning.replan`);
* ``autopipe/bubble`` (1 - mean compute / step) and ``autopipe/bubble_predicted``;
* per rank ``r``: ``autopipe/speed/rank<r>`` (the device speed its compute implies, in the
  cluster's units) and ``autopipe/speed_planned/rank<r>``, ``autopipe/compute_ms/rank<r>``,
  ``autopipe/wait_ms/rank<r>`` (blocked in receives), ``autopipe/tail_ms/rank<r>``,
  ``autopipe/peak_mem_mb/rank<r>`` and ``autopipe/peak_mem_mb_predicted/rank<r>``.

A value that cannot be known (no profile to predict from: a plan given as it is) is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_autopipe.runtime.monitor import (
    RankSummary,
    StepMonitor,
    gather_summaries,
    pipeline_prediction,
)

__all__ = ["forget_monitor", "metrics_of", "monitor_of", "reprice_monitor", "training_step"]

_ATTR = "_autopipe_monitor"  # where the strategy's monitor is kept (rebuilt with its pipeline)


def monitor_of(strategy: Any) -> StepMonitor | None:
    """The strategy's step monitor (None before its first training step)."""
    return getattr(strategy, _ATTR, None)


def forget_monitor(strategy: Any) -> None:
    """Drop the strategy's step monitor: the next training step starts a new one, whose first
    step is a warm-up again (a ``fit`` after another: the stage moved back from the CPU)."""
    if hasattr(strategy, _ATTR):
        delattr(strategy, _ATTR)


def reprice_monitor(strategy: Any) -> None:
    """The running pipeline's cluster was re-calibrated to measured speeds: its monitor
    predicts from it from now on (``step_ms_predicted``, ``speed_planned`` ...). The window is
    kept: a summary reduces its steps against the prediction it is taken with."""
    mon = monitor_of(strategy)
    if mon is not None and mon.executor is strategy.pipeline.executor:
        mon.prediction = pipeline_prediction(strategy.pipeline)


@contextmanager
def training_step(strategy: Any, step: int | None) -> Iterator[None]:
    """Around ``executor.train_step``: measure the step; on a logging step, gather every
    rank's summary (collective: every rank runs every training step) and log on rank 0."""
    pipe = strategy.pipeline
    mon = monitor_of(strategy)
    if mon is None or mon.executor is not pipe.executor:
        mon = StepMonitor.for_pipeline(pipe, window=strategy.options.replan_window)
        setattr(strategy, _ATTR, mon)
    with mon.step(step):
        yield
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    every = int(getattr(trainer, "log_every_n_steps", 0) or 0) if trainer is not None else 0
    if every <= 0 or mon.steps_seen % every:
        return
    rows = gather_summaries(mon.summary(), strategy.options.timeout)
    if strategy.global_rank != 0 or not trainer.loggers:
        return
    metrics = metrics_of(rows)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def metrics_of(rows: list[RankSummary]) -> dict[str, float]:
    """The logged metrics of every rank's summary (see the module docstring); NaNs left out."""
    step = max(r.step_ms for r in rows)
    compute = sum(r.compute_ms for r in rows) / len(rows)
    out = {
        "autopipe/step_ms": step,
        "autopipe/step_ms_predicted": rows[0].predicted_step_ms,
        "autopipe/bubble": 1.0 - compute / step if step > 0 else math.nan,
        "autopipe/bubble_predicted": rows[0].predicted_bubble,
    }
    for r in rows:
        out[f"autopipe/speed/rank{r.rank}"] = r.speed
        out[f"autopipe/speed_planned/rank{r.rank}"] = r.speed_planned
        out[f"autopipe/compute_ms/rank{r.rank}"] = r.compute_ms
        out[f"autopipe/wait_ms/rank{r.rank}"] = r.recv_ms
        out[f"autopipe/tail_ms/rank{r.rank}"] = r.tail_ms
        out[f"autopipe/peak_mem_mb/rank{r.rank}"] = r.peak_memory_bytes / 2**20
        if r.predicted_memory_bytes > 0:
            out[f"autopipe/peak_mem_mb_predicted/rank{r.rank}"] = (
                r.predicted_memory_bytes / 2**20)
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}
