"""The Plan (stages, their devices, micro-batching, slices; round-trips to JSON) and the
Proposal a planner makes before it is scored."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.generators import schedule_generator, splits_backward

__all__ = ["StagePlan", "Plan", "Proposal"]


@dataclass
class Proposal:
    """A planner's answer before scoring: device groups per stage, cuts, m, k and j."""

    groups: list[list[str]]
    cuts: list[int]
    num_microbatches: int
    startup_slices: int = 1
    drain_slices: int = 1
    schedule: str = "1f1b"


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

    def __post_init__(self) -> None:
        self.stages = [s if isinstance(s, StagePlan) else StagePlan(**s) for s in self.stages]
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
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
        used = [d for s in self.stages for d in s.devices]
        if len(used) != len(set(used)):
            dup = sorted({d for d in used if used.count(d) > 1})
            raise PlanError(f"devices {dup} are assigned to more than one stage")
        schedule_generator(self.schedule)  # ScheduleError naming the known ones
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

    @property
    def num_stages(self) -> int:
        return len(self.stages)

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
        return [d for s in self.stages for d in s.devices]

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
