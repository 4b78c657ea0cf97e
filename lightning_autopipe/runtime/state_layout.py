"""Which rank holds which training state under a plan, and what a switch of plans moves.

Pure data and functions (no communication), so every rank derives the same transfers from the
same two plans and a re-plan decision can price a switch before making it. A name a rank holds
in both layouts stays where it is; any other name a new holder needs comes from *one* old
holder, the one of the same data-parallel replica when there is one (BatchNorm statistics
differ between replicas; parameters and optimizer state do not), else the first replica's; a
rank that moves to another replica takes that replica's copy of the names that differ.
:mod:`~lightning_autopipe.runtime.migrate` carries the transfers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_autopipe.errors import PlanError

__all__ = ["StateLayout", "plan_transfers", "transfer_bytes"]


@dataclass(frozen=True)
class StateLayout:
    """Which state names each global rank holds under one plan (the same on every rank).

    Attributes:
        ranks: per global rank, the whole model's names (parameters by their first name, tied
            copies under one name; persistent buffers) its stage holds, in the stage's order.
        replicas: per global rank, its data-parallel replica.
        per_replica: the names whose values may differ between replicas (buffers such as
            BatchNorm statistics; parameters and optimizer state are the same in every
            replica): a rank that holds one from another replica than its new one takes the
            new one's copy (:func:`plan_transfers`).
    """

    ranks: tuple[tuple[str, ...], ...]
    replicas: tuple[int, ...]
    per_replica: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if len(self.ranks) != len(self.replicas):
            raise PlanError(
                f"a StateLayout needs one replica index per rank: {len(self.ranks)} name lists "
                f"but {len(self.replicas)} replicas"
            )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_replicas(self) -> int:
        return max(self.replicas, default=0) + 1

    def holders(self) -> dict[str, list[int]]:
        """``name -> ranks holding it``, first replica first (then by rank)."""
        out: dict[str, list[int]] = {}
        for rank in sorted(range(self.world_size), key=lambda r: (self.replicas[r], r)):
            for name in self.ranks[rank]:
                out.setdefault(name, []).append(rank)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"ranks": [list(r) for r in self.ranks], "replicas": list(self.replicas),
                "per_replica": sorted(self.per_replica)}

    @classmethod
    def from_plan(cls, plan: Any, blocks: Any, device_names: Sequence[str]) -> StateLayout:
        """The layout of ``plan`` over the split model ``blocks`` (a ``BlockGraph``).

        ``device_names[i]`` is the device global rank ``i`` drives (as for ``layout_for_rank``).
        A tied parameter is named by its tie group's first alias on every stage that holds it.
        """
        from lightning_autopipe.runtime.groups import layout_for_rank
        from lightning_autopipe.runtime.rebind import stage_names, tie_aliases

        aliases = tie_aliases(blocks, plan.cuts)
        per_stage, buffers = [], set()
        for s in plan.stages:
            stage = blocks.stage(*s.blocks)
            names = stage_names(stage, aliases)
            per_stage.append(tuple(dict.fromkeys(names.values())))
            buffers |= {names[k] for k, _ in stage.named_buffers() if k in names}
        ranks, replicas = [], []
        for rank in range(len(device_names)):
            lay = layout_for_rank(plan, device_names, rank)  # its chunks' names together
            ranks.append(tuple(dict.fromkeys(n for c in lay.chunks for n in per_stage[c])))
            replicas.append(lay.replica)
        return cls(tuple(ranks), tuple(replicas), frozenset(buffers))


def plan_transfers(old: StateLayout, new: StateLayout) -> dict[tuple[int, int], list[str]]:
    """``(source, destination) -> sorted names`` that move; every rank computes the same.

    Raises:
        PlanError: the layouts have other world sizes, or the new one needs a name no rank
            holds now.
    """
    if old.world_size != new.world_size:
        raise PlanError(
            f"the old layout spans {old.world_size} ranks and the new one {new.world_size}; a "
            "migration keeps the ranks (changing their number needs a restart)"
        )
    holders = old.holders()
    moves: dict[tuple[int, int], list[str]] = {}
    missing = []
    for dst, names in enumerate(new.ranks):
        want_replica = new.replicas[dst] % old.num_replicas
        have = set(old.ranks[dst])
        if old.replicas[dst] != want_replica:  # its copies of these are another replica's
            have -= old.per_replica
        for name in names:
            if name in have:
                continue
            if name not in holders:
                missing.append(name)
                continue
            same = [r for r in holders[name] if old.replicas[r] == want_replica]
            moves.setdefault(((same or holders[name])[0], dst), []).append(name)
    if missing:
        raise PlanError(
            f"the new layout needs {len(missing)} names no rank holds in the old one "
            f"({sorted(missing)[:6]}); build both layouts from the same model"
        )
    return {pair: sorted(names) for pair, names in sorted(moves.items())}


def transfer_bytes(
    moves: Mapping[tuple[int, int], Sequence[str]], nbytes: Mapping[str, int]
) -> dict[tuple[int, int], int]:
    """Bytes each pair of :func:`plan_transfers` carries, from each name's bytes ``nbytes``.

    With ``nbytes`` counting a parameter's optimizer state too (Adam: three times the
    parameter's bytes plus its ``step``), this is what :func:`migrate` sends: a re-plan
    decision can price a switch before making it (divided by the link's bandwidth).
    """
    return {pair: sum(nbytes[n] for n in names) for pair, names in moves.items()}
