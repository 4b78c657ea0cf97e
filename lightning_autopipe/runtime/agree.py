"""Setup's second phase: rank 0 plans (or checks the given plan) and every rank receives it.

Rank 0 sends one :class:`PlanMessage` to every rank: the plan, the profile it was made from and
the seed every rank initialises a meta-device stage from, or the error that stopped it (every
rank must learn of a failure, or the others would wait forever in the next collective). The
cluster is not sent: every rank resolved or discovered the same one itself, collectively
(:mod:`~lightning_autopipe.runtime.measure`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_autopipe import errors
from lightning_autopipe.errors import PipelineRuntimeError, PlanError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.profile import Profile
from lightning_autopipe.runtime.checks import check_plan_for_run
from lightning_autopipe.runtime.measure import Measurement

__all__ = ["Agreement", "PlanMessage", "agree", "check_fingerprint"]


@dataclass(frozen=True)
class PlanMessage:
    """What rank 0 broadcasts after planning: the plan, or the error that stopped it.

    Plan and profile travel as their JSON (what every rank, rank 0 included, decodes, so all
    hold equal objects). A failed message has ``error_kind`` (the exception's class name; an
    :class:`~lightning_autopipe.errors.AutoPipeError` is re-raised as that class on every
    rank) and ``error`` (its message) and no plan.
    """

    plan: str | None = None
    profile: str | None = None
    seed: int = 0
    error_kind: str | None = None
    error: str | None = None

    @classmethod
    def planned(cls, plan: Plan, profile: Profile | None, seed: int) -> PlanMessage:
        return cls(plan=plan.to_json(), profile=profile.to_json() if profile is not None
                   else None, seed=int(seed))

    @classmethod
    def failed(cls, exc: BaseException) -> PlanMessage:
        return cls(error_kind=type(exc).__name__, error=str(exc))

    @property
    def ok(self) -> bool:
        """Rank 0 planned: the message holds a plan."""
        return self.error_kind is None and self.plan is not None

    def raise_error(self, cause: BaseException | None = None) -> None:
        """Raise rank 0's error on this rank (``cause``: this rank's own failure, if any)."""
        kind, message = self.error_kind or "error", self.error or "no plan was sent"
        cls = getattr(errors, kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.AutoPipeError):
            raise cls(f"(raised on rank 0) {message}") from cause
        raise PipelineRuntimeError(
            f"rank 0 failed while profiling/planning: {kind}: {message}"
        ) from cause


@dataclass(frozen=True)
class Agreement:
    """What every rank holds after :func:`agree`: the same plan, profile and seed."""

    plan: Plan
    profile: Profile | None
    seed: int


def agree(
    blocks: Any,
    measured: Measurement,
    options: AutoPipeOptions,
    replica_batch: int,
    *,
    rank: int,
    broadcast: Callable[[Any, int], Any],
) -> Agreement:
    """Rank 0 plans from ``measured`` (or checks ``options``' given plan) and broadcasts it.

    Collective through ``broadcast(obj, src) -> obj`` (the strategy's, or any object
    broadcast). Rank 0's error is raised on every rank: there as itself, elsewhere as the same
    :class:`~lightning_autopipe.errors.AutoPipeError` class (other errors as a
    :class:`PipelineRuntimeError` naming it), caused by the rank's own profiling failure if it
    had one.
    """
    failure: BaseException | None = None
    message: PlanMessage | None = None
    if rank == 0:
        try:
            plan = _plan_on_rank0(blocks, measured, options, replica_batch)
            # every rank initialises a meta-device stage from rank 0's seed
            message = PlanMessage.planned(plan, measured.profile, torch.initial_seed())
        except Exception as exc:  # every rank must learn of it, or they would wait forever
            failure = exc
            message = PlanMessage.failed(exc)
    message = broadcast(message, 0)
    if not isinstance(message, PlanMessage):
        raise PipelineRuntimeError(
            f"rank 0's plan arrived as a {type(message).__name__}, not a PlanMessage: every "
            "rank must run the same version of lightning_autopipe"
        )
    if not message.ok:
        if failure is not None:
            raise failure
        message.raise_error(cause=measured.failure)
    if measured.failure is not None:
        exc = measured.failure
        warnings.warn(
            f"rank {rank}: profiling (as load while rank 0 profiled) failed with "
            f"{type(exc).__name__}: {exc}; rank 0 profiled fine, continuing with its plan",
            stacklevel=3,
        )
    assert message.plan is not None
    profile = Profile.from_json(message.profile) if message.profile is not None else None
    return Agreement(Plan.from_json(message.plan), profile, message.seed)


def _plan_on_rank0(
    blocks: Any, measured: Measurement, options: AutoPipeOptions, replica_batch: int
) -> Plan:
    """A plan searched from the measured profile and cluster, or the given one, checked."""
    if measured.failure is not None:  # rank 0's own profiling failed
        raise measured.failure
    if options.plan is None:
        plan = search_plan(
            measured.profile, measured.cluster, measured.names, replica_batch,
            planner=options.planner, schedules=options.schedules,
            optimizer_factor=options.optimizer_factor, balance=options.balance_replicas,
            **options.pins
        )
        check_fingerprint(plan, blocks)
        return plan
    plan = options.given_plan()
    check_fingerprint(plan, blocks)
    check_plan_for_run(plan, replica_batch, measured.cluster)
    return plan


def check_fingerprint(plan: Plan, blocks: Any) -> None:
    """Refuse a plan made for another model or granularity than ``blocks``."""
    mine = getattr(blocks, "fingerprint", None)
    if plan.fingerprint and mine and plan.fingerprint != mine:
        raise PlanError(
            f"the plan was made for a model with fingerprint {plan.fingerprint} but this model's "
            f"blocks have {mine}; re-plan for this model (or drop `plan=`)"
        )
    if plan.num_blocks != len(blocks):
        raise PlanError(
            f"the plan covers {plan.num_blocks} blocks but the model splits into {len(blocks)}; "
            "re-plan for this model and granularity"
        )
