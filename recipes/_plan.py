"""Plans in the recipes: the report printed at the start of a run, and ``--plan-only``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

__all__ = ["PlanReport", "plan_only"]

PLAN_BANNER = "== AutoPipe plan =="


class PlanReport(pl.Callback):
    """On rank 0 at fit start: print the strategy's plan, save it, draw its timeline."""

    def __init__(self, run_dir: Path, model_name: str) -> None:
        self.run_dir = Path(run_dir)
        self.model_name = model_name
        self.files: list[Path] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None or trainer.global_rank != 0:
            return
        profile = getattr(trainer.strategy, "profile", None)
        cluster = getattr(trainer.strategy, "cluster", None)
        self.files = _show(plan, profile, cluster, self.run_dir, source=None)


def _show(plan: Any, profile: Any, cluster: Any, run_dir: Path, source: str | None) -> list[Path]:
    from lightning_autopipe.planner import format_plan
    from lightning_autopipe.planner.timeline import write_png

    print(PLAN_BANNER)
    if source:
        print(f"profile: {source}")
    print(format_plan(plan, profile) if profile is not None else plan.to_json(indent=1))
    run_dir.mkdir(parents=True, exist_ok=True)
    files = [run_dir / "plan.json"]
    plan.save(files[0])
    if profile is not None and cluster is not None:
        from lightning_autopipe.planner.simulate import simulate

        files.append(run_dir / "timeline.png")
        write_png(simulate(plan, profile, cluster), files[-1])
    return files


def plan_only(cfg: Any, run_dir: Path) -> int:
    """Print the plan ``cfg`` would get on ``cfg.cluster`` and draw it; launch nothing."""
    raise NotImplementedError
