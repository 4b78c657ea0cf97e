"""Where each rank sits in a plan (stage, replica, its chunks and their neighbours) and the
process groups it needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_autopipe.errors import ClusterError, PlanError
from lightning_autopipe.planner.plan import Plan

__all__ = [
    "ChunkLayout",
    "RankLayout",
    "ProcessGroups",
    "layout_for_rank",
    "build_groups",
    "destroy_groups",
    "gather_by_rank",
]


@dataclass(frozen=True)
class ChunkLayout:
    """One chunk of a rank (a contiguous piece of the model) and where its neighbours run.

    ``chunk`` is the global chunk index in model order. A neighbour chunk on the same rank is
    *local* (``prev_local`` / ``next_local``): tensors pass to it directly, with no message, and
    ``prev_rank`` / ``next_rank`` are None for it as for a missing one. ``lane_in`` /
    ``lane_out`` tell apart the messages of this chunk's input and output boundary from those
    of other boundaries between the same two ranks (several chunks per rank; 0 with one).
    """

    chunk: int
    num_chunks: int
    prev_rank: int | None
    next_rank: int | None
    prev_local: bool = False
    next_local: bool = False
    lane_in: int = 0
    lane_out: int = 0

    @property
    def stage(self) -> int:
        """The chunk's index (what an action's ``stage`` names)."""
        return self.chunk

    @property
    def is_first(self) -> bool:
        return self.chunk == 0

    @property
    def is_last(self) -> bool:
        return self.chunk == self.num_chunks - 1


@dataclass(frozen=True)
class RankLayout:
    """This rank's place in the stage x replica grid of a plan.

    ``grid[s][r]`` is the global rank running stage ``s`` of data-parallel replica ``r``. Replica
    ``r`` of stage ``s`` talks to replica ``r`` of stages ``s - 1`` and ``s + 1``; the ranks of
    one stage (one row) all-reduce their gradients.

    With several chunks per rank the model is cut into ``len(placement)`` chunks and
    ``placement[c]`` is the row (pipeline position) holding chunk ``c``; ``stage`` stays this
    rank's row, :attr:`chunks` lists its chunks and :meth:`chunk` their neighbours. An empty
    ``placement`` is one chunk per row (chunk ``c`` on row ``c``).
    """

    rank: int
    stage: int
    replica: int
    grid: tuple[tuple[int, ...], ...]
    placement: tuple[int, ...] = ()

    @property
    def num_chunks(self) -> int:
        """Pieces the model is cut into (rows x chunks per rank)."""
        return len(self.placement) or len(self.grid)

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.num_stages

    def position(self, chunk: int) -> int:
        """The row holding ``chunk``."""
        return self.placement[chunk] if self.placement else chunk

    @property
    def chunks(self) -> tuple[int, ...]:
        """This rank's chunks in model order."""
        return tuple(c for c in range(self.num_chunks) if self.position(c) == self.stage)

    def chunk_rank(self, chunk: int) -> int:
        """Global rank holding ``chunk`` in this rank's replica."""
        return self.grid[self.position(chunk)][self.replica]

    def chunk(self, c: int) -> ChunkLayout:
        """Chunk ``c`` of this rank with its neighbours (local ones: no messages)."""
        n, rows = self.num_chunks, self.num_stages
        here = self.position(c)
        prev_local = c > 0 and self.position(c - 1) == here
        next_local = c < n - 1 and self.position(c + 1) == here
        return ChunkLayout(
            chunk=c,
            num_chunks=n,
            prev_rank=None if c == 0 or prev_local else self.chunk_rank(c - 1),
            next_rank=None if c == n - 1 or next_local else self.chunk_rank(c + 1),
            prev_local=prev_local,
            next_local=next_local,
            # boundary b (between chunks b - 1 and b) joins the same two ranks as boundary
            # b + rows at most (looped and V placement), so (b - 1) // rows tells them apart
            lane_in=max(c - 1, 0) // rows,
            lane_out=c // rows,
        )

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
        """This rank holds the model's first chunk (it reads the batch's inputs)."""
        return self.position(0) == self.stage

    @property
    def is_last(self) -> bool:
        """This rank holds the model's last chunk (it computes the loss)."""
        return self.position(self.num_chunks - 1) == self.stage

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous stage in this replica (activations come from it); with
        several chunks per rank, that of this rank's first chunk."""
        return self.chunk(self.chunks[0]).prev_rank

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next stage in this replica (gradients come from it); with
        several chunks per rank, that of this rank's first chunk."""
        return self.chunk(self.chunks[0]).next_rank

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
        """Global rank of the last stage (chunk) of this replica: it computes the loss."""
        return self.chunk_rank(self.num_chunks - 1)


def layout_for_rank(plan: Plan, device_names: Sequence[str], rank: int) -> RankLayout:
    """Place ``rank`` in ``plan``; ``device_names[i]`` is the device global rank ``i`` drives.

    A plan with several chunks per rank lists its chunks in model order, each with the devices
    of the ranks holding it; the rows of the grid are the distinct device lists in the order
    they first appear (the chunks ``0 .. p-1`` of looped and V placement alike), and each
    chunk's row is where its devices are.

    Raises:
        ClusterError: a device of the plan is not among the launched devices.
        PlanError: the plan does not use every launched rank exactly once, its stages have
            different replica counts, or a device list overlaps another without being it.
    """
    names = [str(d) for d in device_names]
    if len(set(names)) != len(names):
        raise ClusterError(f"device names must be unique, got {names}")
    rank_of = {name: i for i, name in enumerate(names)}
    _ = plan.replicas  # raises PlanError when the stages have different widths
    grid: list[tuple[int, ...]] = []
    placement: list[int] = []
    for s, stage in enumerate(plan.stages):
        missing = [d for d in stage.devices if d not in rank_of]
        if missing:
            raise ClusterError(
                f"stage {s} of the plan runs on {missing}, which are not among the launched "
                f"devices {names}; make the plan for this cluster or launch on its devices"
            )
        row = tuple(rank_of[d] for d in stage.devices)
        if row not in grid:
            grid.append(row)
        placement.append(grid.index(row))
    used = sorted(r for row in grid for r in row)
    if len(used) != len(set(used)):
        raise PlanError(
            f"the plan's stages put devices {plan.devices} in overlapping groups; the chunks "
            "of one rank must list exactly the same devices (one group per pipeline position)"
        )
    if used != list(range(len(names))):
        idle = sorted(set(range(len(names))) - set(used))
        raise PlanError(
            f"the plan uses {len(used)} devices {sorted(set(plan.devices))} but {len(names)} "
            f"processes were launched (ranks {idle} would idle); launch exactly {len(used)} "
            "processes or make a plan that uses every device"
        )
    if not 0 <= rank < len(names):
        raise ClusterError(f"rank {rank} is outside the {len(names)} launched processes")
    counts = {placement.count(r) for r in range(len(grid))}
    if len(counts) != 1:
        raise PlanError(
            f"the plan gives its pipeline positions different numbers of chunks "
            f"{[placement.count(r) for r in range(len(grid))]}; every rank holds the same number"
        )
    chunked = tuple(placement) if len(placement) > len(grid) else ()
    for s, row in enumerate(grid):
        if rank in row:
            return RankLayout(rank=rank, stage=s, replica=row.index(rank), grid=tuple(grid),
                              placement=chunked)
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


def gather_by_rank(tensor: Tensor, group: Any) -> dict[int, Tensor]:
    """Every rank's ``tensor`` (one shape) over ``group``, keyed by global rank (collective)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return {dist.get_global_rank(group, i): t for i, t in enumerate(parts)}
