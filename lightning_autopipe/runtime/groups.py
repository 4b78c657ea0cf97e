"""Where each rank sits in a plan (stage, replica, neighbours) and the process groups it needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_autopipe.errors import ClusterError, PlanError
from lightning_autopipe.planner.plan import Plan

__all__ = ["RankLayout", "ProcessGroups", "layout_for_rank", "build_groups", "destroy_groups"]


@dataclass(frozen=True)
class RankLayout:
    """This rank's place in the stage x replica grid of a plan.

    ``grid[s][r]`` is the global rank running stage ``s`` of data-parallel replica ``r``. Replica
    ``r`` of stage ``s`` talks to replica ``r`` of stages ``s - 1`` and ``s + 1``; the ranks of
    one stage (one row) all-reduce their gradients.
    """

    rank: int
    stage: int
    replica: int
    grid: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.grid)

    @property
    def num_replicas(self) -> int:
        return len(self.grid[0])

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous stage in this replica (activations come from it)."""
        return None if self.is_first else self.grid[self.stage - 1][self.replica]

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next stage in this replica (gradients come from it)."""
        return None if self.is_last else self.grid[self.stage + 1][self.replica]

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        """Ranks holding a replica of this rank's stage."""
        return self.grid[self.stage]

    @property
    def pipeline_ranks(self) -> tuple[int, ...]:
        """Ranks of this rank's replica, first stage first."""
        return tuple(row[self.replica] for row in self.grid)

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last stage of this replica: it computes the loss."""
        return self.grid[-1][self.replica]


def layout_for_rank(plan: Plan, device_names: Sequence[str], rank: int) -> RankLayout:
    """Place ``rank`` in ``plan``; ``device_names[i]`` is the device global rank ``i`` drives.

    Raises:
        ClusterError: a device of the plan is not among the launched devices.
        PlanError: the plan does not use every launched rank exactly once, or its stages have
            different replica counts.
    """
    names = [str(d) for d in device_names]
    if len(set(names)) != len(names):
        raise ClusterError(f"device names must be unique, got {names}")
    rank_of = {name: i for i, name in enumerate(names)}
    _ = plan.replicas  # raises PlanError when the stages have different widths
    grid: list[tuple[int, ...]] = []
    for s, stage in enumerate(plan.stages):
        missing = [d for d in stage.devices if d not in rank_of]
        if missing:
            raise ClusterError(
                f"stage {s} of the plan runs on {missing}, which are not among the launched "
                f"devices {names}; make the plan for this cluster or launch on its devices"
            )
        grid.append(tuple(rank_of[d] for d in stage.devices))
    used = sorted(r for row in grid for r in row)
    if used != list(range(len(names))):
        idle = sorted(set(range(len(names))) - set(used))
        raise PlanError(
            f"the plan uses {len(used)} devices {plan.devices} but {len(names)} processes were "
            f"launched (ranks {idle} would idle); launch exactly {len(used)} processes or make a "
            "plan that uses every device"
        )
    if not 0 <= rank < len(names):
        raise ClusterError(f"rank {rank} is outside the {len(names)} launched processes")
    for s, row in enumerate(grid):
        if rank in row:
            return RankLayout(rank=rank, stage=s, replica=row.index(rank), grid=tuple(grid))
    raise AssertionError("unreachable: every rank is in the grid")  # pragma: no cover


@dataclass
class ProcessGroups:
    """The groups one rank uses; built collectively (every rank creates every group).

    Attributes:
        layout: this rank's place in the grid.
        dp: the data-parallel group of this rank's stage (gradient all-reduce, loss average).
        pipeline: the group of this rank's replica (loss broadcast, global gradient norm).
        ties: for each tie set (index into the list given to :func:`build_groups`) that includes
            this rank's stage, the group of this replica's ranks holding a copy.
    """

    layout: RankLayout
    dp: Any
    pipeline: Any
    ties: dict[int, Any] = field(default_factory=dict)
    created: list[Any] = field(default_factory=list)


def build_groups(
    layout: RankLayout,
    tie_stage_sets: Sequence[Sequence[int]] = (),
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> ProcessGroups:
    """Create the data-parallel, pipeline and tie groups; every rank must call this together.

    Groups are created in one fixed order (all stage rows, then all replica columns, then each
    tie set per replica) on every rank, as ``torch.distributed.new_group`` requires.

    Args:
        layout: this rank's place (the grid is the same on every rank).
        tie_stage_sets: for each set of tied parameters, the stages that hold a copy.
        backend: ``"gloo"``/``"nccl"``; ``None`` uses the world group's backend.
        timeout: applied to every group, so a stuck peer fails instead of hanging.
    """
    grid = layout.grid
    created: list[Any] = []

    def new(ranks: Sequence[int]) -> Any:
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        created.append(group)
        return group

    dp = pipeline = None
    for s, row in enumerate(grid):
        g = new(row)
        if s == layout.stage:
            dp = g
    for r in range(layout.num_replicas):
        g = new([row[r] for row in grid])
        if r == layout.replica:
            pipeline = g
    ties: dict[int, Any] = {}
    for t, stages in enumerate(tie_stage_sets):
        stages = sorted(set(stages))
        if len(stages) < 2:
            continue
        for r in range(layout.num_replicas):
            g = new([grid[s][r] for s in stages])
            if r == layout.replica and layout.stage in stages:
                ties[t] = g
    return ProcessGroups(layout=layout, dp=dp, pipeline=pipeline, ties=ties, created=created)


def destroy_groups(groups: ProcessGroups) -> None:
    """Release the sub-groups (the world group stays for the next ``fit``)."""
    for g in groups.created:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    groups.created.clear()
