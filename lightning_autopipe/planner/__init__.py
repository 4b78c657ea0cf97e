"""Pure planning functions: schedules, simulation, partitioning, mapping and the joint search."""

from lightning_autopipe.planner.analytic import analytic_profile
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.report import format_plan
from lightning_autopipe.planner.search import PLANNERS, make_plan

__all__ = ["PLANNERS", "Plan", "StagePlan", "analytic_profile", "format_plan", "make_plan"]
