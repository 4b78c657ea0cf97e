"""When the strategy re-plans, and what it reports: the Lightning side of live re-planning.

The boundary is the end of the strategy's ``optimizer_step`` (after ``super()``: the optimizer
and any gradient scaler have stepped, no gradients are in flight, Lightning has not counted the
step yet). With ``replan="auto"`` and automatic optimization, every ``replan_window`` steps
after a plan's first (warm-up) step and no sooner than ``replan_min_steps`` after the last
switch or the start of the ``fit`` (:func:`~lightning_autopipe.runtime.speeds.check_due`;
each ``fit`` measures afresh, :meth:`Replanner.start_fit`), every rank's telemetry window is
gathered; rank 0 decides (:func:`~lightning_autopipe.runtime.replan.propose`), every
rank receives its verdict (:func:`~lightning_autopipe.runtime.replan.agree_switch`) and on a
switch every rank moves to the new plan in memory (the strategy's ``_switch_to``). Rank 0 then
prints the plan table again with the reason, and keeps every plan beside ``cluster.yaml``:
``plan.json`` is the running one, ``plans/plan-<step>.json`` the history (``plan-0`` the
first). ``replan="off"`` never gathers nor switches. A manual-optimization module is never
re-planned (its ``optimizer.step`` calls need not end the step).

A pipeline carries the cluster its plan was priced on: after a switch, the cluster with the
speeds measured at that check; when a check keeps the plan but a rank measures more than 5%
away from its planned speed (discovery timed every rank profiling flat out, training shares
the machine otherwise), the pipeline is re-calibrated to the measured speeds (no migration, no
new plan: :class:`Recalibration`). Its telemetry then predicts the step for the speeds it
runs at, and the next check measures against them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_autopipe.lightning import telemetry
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.report import plan_table
from lightning_autopipe.runtime.monitor import gather_summaries
from lightning_autopipe.runtime.replan import (
    SwitchMessage,
    agree_switch,
    optimizer_state_ratio,
    propose,
    verdict_cluster,
)
from lightning_autopipe.runtime.speeds import check_due, speeds_moved

__all__ = ["Recalibration", "Replanner", "SwitchRecord", "write_plan"]

_UNKNOWN_REMAINING = 1000  # steps assumed left when the Trainer cannot say (no max_steps)


@dataclass(frozen=True)
class SwitchRecord:
    """One switch: after which training step, why, what was predicted and what it cost
    (``bytes``: predicted, ``bytes_moved``: what the migration sent, over every rank)."""

    step: int
    reason: str
    measured_step_ms: float
    predicted_step_ms: float
    predicted_cost_ms: float
    cost_ms: float
    bytes: int
    bytes_moved: int
    speeds: dict[str, float]
    plan: str


@dataclass(frozen=True)
class Recalibration:
    """A check that kept the running plan but moved the speeds it is priced at to the
    measured ones: the step predicted before and after, and the one measured."""

    step: int
    speeds: dict[str, float]
    predicted_before_ms: float
    predicted_ms: float
    measured_step_ms: float


@dataclass
class Replanner:
    """One strategy's re-planning state (kept across its ``fit`` calls).

    Attributes:
        steps: optimizer steps counted at the boundary so far.
        checks: boundaries at which the ranks gathered their telemetry and rank 0 decided.
        switches: every switch made, in order.
        recalibrations: every check that kept the plan at measured speeds, in order.
    """

    steps: int = 0
    last_switch: int = 0
    checks: int = 0
    switches: list[SwitchRecord] = field(default_factory=list)
    recalibrations: list[Recalibration] = field(default_factory=list)
    last_verdict: SwitchMessage | None = None

    def start_fit(self, strategy: Any) -> None:
        """At every ``fit``'s setup (every rank): the fit's steps are measured afresh (a new
        monitor, its first step a warm-up) and its checks count from its start, as after a
        switch, whether the pipeline is the one kept from an earlier call or a new one."""
        telemetry.forget_monitor(strategy)
        self.last_switch = self.steps

    def after_optimizer_step(self, strategy: Any) -> None:
        """At the boundary (every rank): maybe re-plan; see the module docstring."""
        options = strategy.options
        module = strategy.lightning_module
        if options.replan != "auto" or strategy.pipeline is None or module is None:
            return
        if not getattr(module, "automatic_optimization", True):
            return
        self.steps += 1
        since = self.steps - self.last_switch
        monitor = telemetry.monitor_of(strategy)
        if monitor is None or not check_due(since, options, monitor.warmup):
            return
        if not monitor.records:
            return
        self.checks += 1
        rows = gather_summaries(monitor.summary(), options.timeout)
        pipe = strategy.pipeline
        message = None
        if strategy.global_rank == 0:
            message = propose(
                pipe, rows, options, step=self.steps,
                remaining_steps=_remaining(module.trainer, self.steps),
                steps_since_switch=since,
                optimizer_ratio=optimizer_state_ratio(strategy.optimizers,
                                                      list(pipe.stage.parameters())),
            )
        message = agree_switch(message, rank=strategy.global_rank, step=self.steps,
                               broadcast=strategy.broadcast)
        self.last_verdict = message
        if not message.switch:
            self._recalibrate(strategy, message)
            return
        start = time.perf_counter()
        old = pipe
        plan = message.new_plan()
        stats = strategy._switch_to(plan, self.steps, verdict_cluster(old, message))
        cost_ms = (time.perf_counter() - start) * 1e3
        if stats is not None:  # the next switch's rebuild: this one's whole local part
            strategy.pipeline.build_ms = max(cost_ms - stats.seconds * 1e3, 0.0)
        self.last_switch = self.steps
        record = SwitchRecord(self.steps, message.reason, message.measured_step_ms,
                              message.candidate_step_ms, message.switch_cost_ms, cost_ms,
                              message.switch_bytes, int(stats.total_bytes) if stats else -1,
                              dict(message.speeds), message.plan or "")
        self.switches.append(record)
        if strategy.global_rank == 0:
            _report(strategy, old, plan, message, record)

    def _recalibrate(self, strategy: Any, message: SwitchMessage) -> None:
        """Every rank, on a verdict that keeps the plan: when it priced the running plan and a
        rank measured away from its planned speed, the pipeline takes the measured speeds."""
        pipe = strategy.pipeline
        if not (math.isfinite(message.running_step_ms) and speeds_moved(dict(message.speeds))):
            return
        before = telemetry.monitor_of(strategy)
        was = before.prediction.step_ms if before is not None else math.nan
        pipe.cluster = verdict_cluster(pipe, message)  # priced: the pipeline has a cluster
        telemetry.reprice_monitor(strategy)
        record = Recalibration(self.steps, dict(message.speeds), float(was),
                               float(message.running_step_ms), float(message.measured_step_ms))
        self.recalibrations.append(record)
        if strategy.global_rank == 0:
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            speeds = ", ".join(f"{d} x{r:.2f}" for d, r in message.speeds)
            rank_zero_info(
                f"autopipe: after step {record.step} the plan is kept at the measured speeds "
                f"({speeds} of planned): predicted {record.predicted_ms:.1f} ms per step "
                f"(was {record.predicted_before_ms:.1f} ms), measured "
                f"{record.measured_step_ms:.1f} ms")


def write_plan(run_dir: Path, plan: Plan, step: int) -> None:
    """``run_dir/plan.json`` (the running plan) and ``run_dir/plans/plan-<step>.json``."""
    (run_dir / "plans").mkdir(parents=True, exist_ok=True)
    text = plan.to_json()
    (run_dir / "plans" / f"plan-{step}.json").write_text(text)
    (run_dir / "plan.json").write_text(text)


def _remaining(trainer: Any, steps: int) -> int:
    total = getattr(trainer, "max_steps", -1)
    if total is None or total < 0:
        try:
            total = trainer.estimated_stepping_batches
        except Exception:  # a loader without a length: unknown
            total = math.inf
    if not math.isfinite(total):
        return _UNKNOWN_REMAINING
    return max(int(total) - steps, 0)


def _report(strategy: Any, old: Any, plan: Plan, message: SwitchMessage,
            record: SwitchRecord) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    planned = {d.name: d.spec.speed for d in old.cluster.devices} if old.cluster else {}
    speeds = ", ".join(f"{d} x{r:.2f} of planned {planned.get(d, math.nan):.2f}"
                       for d, r in message.speeds)
    lines = [
        f"autopipe: re-planned after step {record.step}: {message.reason}",
        f"  measured speeds: {speeds}",
        f"  measured step {message.measured_step_ms:.1f} ms (planned "
        f"{old.plan.iteration_ms:.1f} ms); new plan predicted {message.candidate_step_ms:.1f} ms",
        f"  switch: {record.bytes_moved / 2**20:.2f} MiB moved (predicted "
        f"{record.bytes / 2**20:.2f}), predicted {record.predicted_cost_ms:.0f} ms, took "
        f"{record.cost_ms:.0f} ms",
        plan_table(plan, strategy.pipeline.profile, strategy.pipeline.cluster),
    ]
    rank_zero_info("\n".join(lines))
    run_dir = strategy._plan_dir()
    if run_dir is not None:
        write_plan(run_dir, plan, record.step)
