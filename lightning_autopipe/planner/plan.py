"""The Plan (stages, their devices, micro-batching, slices; round-trips to JSON) and the
Proposal a planner makes before it is scored."""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.generators import check_schedule, splits_backward
from lightning_autopipe.planner.placement import chunk_ranks
from lightning_autopipe.planner.step import StepShape

__all__ = ["StagePlan", "Plan", "Proposal"]


@dataclass
class Proposal:
    """A planner's answer before scoring: device groups per rank position, cuts (per chunk
    with several chunks per rank), m, k, j, the schedule and its chunks per rank."""

    groups: list[list[str]]
    cuts: list[int]
    num_microbatches: int
    startup_slices: int = 1
    drain_slices: int = 1
    schedule: str = "1f1b"
    chunks_per_rank: int = 1
    placement: str = "looped"

    def step_shape(self, batch: int, optimizer_factor: float = 2.0) -> StepShape:
        """How this proposal cuts a step of ``batch`` samples, what the fast model prices."""
        return StepShape(batch, self.num_microbatches, self.startup_slices,
                         drain_slices=self.drain_slices, schedule=self.schedule,
                         optimizer_factor=optimizer_factor)


@dataclass
class StagePlan:
    """One pipeline stage: a half-open block range and the devices that replicate it.

    ``stage_ms`` is forward + backward time of one micro-batch of the stage on its (slowest)
    device, as the planner's cost model sees it.
    """

    blocks: tuple[int, int]
    devices: list[str]
    stage_ms: float = 0.0

    def __post_init__(self) -> None:
        self.blocks = (int(self.blocks[0]), int(self.blocks[1]))
        self.devices = [str(d) for d in self.devices]
        if not 0 <= self.blocks[0] < self.blocks[1]:
            raise PlanError(f"stage block range {list(self.blocks)} is empty or negative")
        if not self.devices:
            raise PlanError(f"stage with blocks {list(self.blocks)} has no devices")

    @property
    def replicas(self) -> int:
        return len(self.devices)


@dataclass
class Plan:
    """A complete training layout, as the planner chose it and the runtime executes it.

    ``num_microbatches`` micro-batches per data-parallel replica and step; micro-batch 0 is split
    into ``startup_slices`` even slices and, with two or more micro-batches, the last one into
    ``drain_slices`` (1 = whole; plans written before drain slicing existed load with 1).
    ``schedule`` names the generator (``"1f1b"`` or ``"gpipe"``). The predicted figures
    (``iteration_ms`` …) come from the simulator. ``recompute[s]`` marks a stage that recomputes
    its activations in backward (empty: none; plans written before it existed load so).

    Several stages per rank: with ``chunks_per_rank = v > 1`` the ``stages`` are the ``S = p v``
    chunks of the model in model order and rank position ``r`` of a replica holds the chunks
    :func:`~.placement.rank_chunks` names for ``placement`` (``"looped"`` or ``"v"``); the
    chunks of one rank list the same devices. Plans written before chunks existed load with
    ``v = 1``, where chunk == stage == rank position.

    ``replica_batches``: samples of each data-parallel replica per step, in replica order,
    summing to ``global_batch_size`` (empty: even, ``global_batch_size / replicas`` each). A
    replica on slower devices gets fewer samples, so that every replica's pipeline ends its step
    at about the same time; the runtime moves samples between the replicas' loaded batches.
    """

    planner: str
    global_batch_size: int
    num_microbatches: int
    startup_slices: int
    stages: list[StagePlan]
    iteration_ms: float = 0.0
    bubble_fraction: float = 0.0
    balance: float = 1.0
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    search_ms: float = 0.0
    schedule: str = "1f1b"
    model: str | None = None
    fingerprint: str | None = None
    drain_slices: int = 1
    search_notes: list[str] = field(default_factory=list)
    recompute: list[bool] = field(default_factory=list)
    chunks_per_rank: int = 1
    placement: str = "looped"
    replica_batches: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stages = [s if isinstance(s, StagePlan) else StagePlan(**s) for s in self.stages]
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        self._check_replica_batches()
        self.recompute = [bool(r) for r in self.recompute]
        if self.recompute and len(self.recompute) != len(self.stages):
            raise PlanError(
                f"recompute has {len(self.recompute)} entries for {len(self.stages)} stages; "
                "give one flag per stage (or none: no stage recomputes)"
            )
        for a, b in zip(self.stages, self.stages[1:]):
            if a.blocks[1] != b.blocks[0]:
                raise PlanError(
                    f"stages must be contiguous: {list(a.blocks)} is followed by {list(b.blocks)}"
                )
        if self.stages[0].blocks[0] != 0:
            first = self.stages[0].blocks[0]
            raise PlanError(f"the first stage must start at block 0, not {first}")
        check_schedule(self.schedule, self.chunks_per_rank, self.placement)
        self._check_chunks()
        if any(self.recompute) and splits_backward(self.schedule):
            raise PlanError(
                f"schedule {self.schedule!r} splits the backward, so a recomputing stage would "
                "hold its recomputed activations until each weight backward; recompute under "
                "'1f1b' or 'gpipe'"
            )
        if min(self.num_microbatches, self.startup_slices, self.drain_slices) < 1:
            raise PlanError(
                f"num_microbatches ({self.num_microbatches}), startup_slices "
                f"({self.startup_slices}) and drain_slices ({self.drain_slices}) must be >= 1"
            )

    def _check_replica_batches(self) -> None:
        """Uneven replica batches: one positive count per replica, summing to the global batch."""
        try:
            given = [operator.index(n) for n in self.replica_batches]
        except TypeError:
            raise PlanError(f"replica_batches must be whole sample counts, one per replica, "
                            f"got {self.replica_batches!r}") from None
        if not given:
            self.replica_batches = []
            return
        if any(isinstance(n, bool) for n in self.replica_batches):
            raise PlanError(f"replica_batches must be whole sample counts, got {given}")
        self.replica_batches = given
        widths = {s.replicas for s in self.stages}
        width = widths.pop() if len(widths) == 1 else None
        if width is None or width < 2 or len(given) != width or min(given) < 1 \
                or sum(given) != self.global_batch_size:
            raise PlanError(
                f"replica_batches {given} must give each of the stages' {width or 'uneven'} "
                f"replicas (two or more) at least one sample and sum to global_batch_size="
                f"{self.global_batch_size}; leave it empty for even batches"
            )

    def replica_batch(self, replica: int) -> int:
        """Samples replica ``replica`` trains per step (its share of the global batch)."""
        if self.replica_batches:
            return self.replica_batches[replica]
        return self.global_batch_size // self.replicas

    def replica_weight(self, replica: int) -> float:
        """Replica ``replica``'s samples against an even share (``n_i R / B``; 1 when even)."""
        if not self.replica_batches:
            return 1.0
        return self.replica_batches[replica] * len(self.replica_batches) / self.global_batch_size

    def _check_chunks(self) -> None:
        """Chunks per rank divide the stages; one rank's chunks share their devices; no device
        serves two ranks."""
        v = self.chunks_per_rank
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"chunks_per_rank must be a positive integer, got {v!r}")
        if len(self.stages) % v:
            raise PlanError(
                f"{len(self.stages)} stage chunks cannot be dealt to ranks of {v} chunks each; "
                f"give a multiple of {v} stages or change chunks_per_rank"
            )
        owner = chunk_ranks(len(self.stages) // v, v, self.placement)
        for c, r in enumerate(owner):
            first = self.stages[owner.index(r)]
            if self.stages[c].devices != first.devices:
                raise PlanError(
                    f"chunks {owner.index(r)} and {c} are both on rank {r} "
                    f"({self.placement} placement) but list devices {first.devices} and "
                    f"{self.stages[c].devices}; give a rank's chunks the same devices"
                )
        used = [d for r in range(self.num_ranks) for d in self.stages[owner.index(r)].devices]
        if len(used) != len(set(used)):
            dup = sorted({d for d in used if used.count(d) > 1})
            raise PlanError(f"devices {dup} are assigned to more than one stage")

    @property
    def num_stages(self) -> int:
        """Stage chunks of the model (``p v``; with one chunk per rank, the ranks)."""
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Rank positions of one replica (``p``)."""
        return len(self.stages) // self.chunks_per_rank

    @property
    def chunk_ranks(self) -> tuple[int, ...]:
        """The rank position of every chunk (:func:`~.placement.chunk_ranks`)."""
        return chunk_ranks(self.num_ranks, self.chunks_per_rank, self.placement)

    def rank_stages(self, rank: int) -> list[int]:
        """The chunks rank position ``rank`` holds, in model order."""
        return [c for c, r in enumerate(self.chunk_ranks) if r == rank]

    def rank_devices(self, rank: int) -> list[str]:
        """The devices (data-parallel replicas) of rank position ``rank``."""
        return list(self.stages[self.rank_stages(rank)[0]].devices)

    def step_shape(self, optimizer_factor: float = 2.0) -> StepShape:
        """How this plan cuts its step, what the fast model prices."""
        return StepShape(self.global_batch_size, self.num_microbatches, self.startup_slices,
                         drain_slices=self.drain_slices, schedule=self.schedule,
                         optimizer_factor=optimizer_factor)

    def recomputes(self, stage: int) -> bool:
        """Whether ``stage`` recomputes its activations in backward."""
        return bool(self.recompute) and self.recompute[stage]

    @property
    def num_blocks(self) -> int:
        return self.stages[-1].blocks[1]

    @property
    def cuts(self) -> list[int]:
        """Block indices where stages start, plus the end: ``[0, c1, ..., num_blocks]``."""
        return [s.blocks[0] for s in self.stages] + [self.num_blocks]

    def with_cuts(self, cuts: list[int]) -> Plan:
        """This plan with its stages' block ranges moved to ``cuts`` (same devices, shape and
        schedule), to price a neighbouring partition."""
        stages = [StagePlan((cuts[i], cuts[i + 1]), s.devices) for i, s in enumerate(self.stages)]
        return replace(self, stages=stages)

    @property
    def devices(self) -> list[str]:
        """Every device once, by rank position."""
        return [d for r in range(self.num_ranks) for d in self.rank_devices(r)]

    @property
    def replicas(self) -> int:
        """Data-parallel width, when every stage has the same number of replicas."""
        widths = {s.replicas for s in self.stages}
        if len(widths) != 1:
            raise PlanError(
                f"stages have different replica counts {[s.replicas for s in self.stages]}; "
                "the runtime needs the same data-parallel width on every stage"
            )
        return widths.pop()

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch on one replica."""
        per = self.replicas * self.num_microbatches
        if self.global_batch_size % per:
            raise PlanError(
                f"global batch {self.global_batch_size} is not divisible into {self.replicas} "
                f"replicas x {self.num_microbatches} micro-batches; pick a batch size that is a "
                f"multiple of {per} or change num_microbatches"
            )
        return self.global_batch_size // per

    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "global_batch_size": self.global_batch_size,
            "num_microbatches": self.num_microbatches,
            "startup_slices": self.startup_slices,
            "drain_slices": self.drain_slices,
            "schedule": self.schedule,
            "stages": [
                {"blocks": list(s.blocks), "devices": list(s.devices), "stage_ms": s.stage_ms}
                for s in self.stages
            ],
            "iteration_ms": self.iteration_ms,
            "bubble_fraction": self.bubble_fraction,
            "balance": self.balance,
            "peak_memory_bytes": dict(self.peak_memory_bytes),
            "search_ms": self.search_ms,
            **({"search_notes": list(self.search_notes)} if self.search_notes else {}),
            **({"recompute": list(self.recompute)} if any(self.recompute) else {}),
            **({"chunks_per_rank": self.chunks_per_rank, "placement": self.placement}
               if self.chunks_per_rank > 1 else {}),
            **({"replica_batches": list(self.replica_batches)} if self.replica_batches else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())
