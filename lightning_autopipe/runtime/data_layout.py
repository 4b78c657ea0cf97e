"""Which data-parallel replica each rank is under a plan: what a live switch must keep.

The Trainer's data loaders were built for each rank's replica when training started, so a plan
a run switches to must give every rank the replica it had. Replica numbers are only labels: a
plan that puts the same ranks together under other numbers (the planner lists the faster
devices first, and measured speeds reorder them) is the same data layout once renumbered
(:func:`keep_replicas`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.groups import layout_for_rank

__all__ = ["keep_replicas", "same_data_layout"]


def same_data_layout(a: Plan, b: Plan, names: Sequence[str]) -> bool:
    """Every rank has the same data-parallel replica (of as many) under both plans: the data
    loaders' samplers, fixed when training started, stay right."""
    if a.replicas != b.replicas:
        return False
    return all(layout_for_rank(a, names, r).replica == layout_for_rank(b, names, r).replica
               for r in range(len(names)))


def keep_replicas(candidate: Plan, running: Plan, names: Sequence[str]) -> Plan:
    """``candidate`` with its replicas renumbered so that every rank keeps its ``running``
    replica, where one renumbering does that for every rank (each replica's devices, and its
    batch under uneven replica batches, move together); else ``candidate`` as it is."""
    width = candidate.replicas
    if width != running.replicas or width < 2:
        return candidate
    to_old: dict[int, int] = {}
    for r in range(len(names)):
        new = layout_for_rank(candidate, names, r).replica
        if to_old.setdefault(new, layout_for_rank(running, names, r).replica) != to_old[new] \
                or list(to_old.values()).count(to_old[new]) > 1:
            return candidate
    if sorted(to_old) == sorted(to_old.values()) and all(k == v for k, v in to_old.items()):
        return candidate  # already numbered so
    stages = []
    for s in candidate.stages:
        devices = list(s.devices)
        for new, old in to_old.items():
            devices[old] = s.devices[new]
        stages.append(StagePlan(s.blocks, devices, s.stage_ms))
    batches = list(candidate.replica_batches)
    for new, old in to_old.items():
        if candidate.replica_batches:
            batches[old] = candidate.replica_batches[new]
    return replace(candidate, stages=stages, replica_batches=batches,
                   peak_memory_bytes=dict(candidate.peak_memory_bytes))
