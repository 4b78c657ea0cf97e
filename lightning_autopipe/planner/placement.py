"""Which rank holds which stage chunk when every rank holds ``v`` chunks of the model.

A pipeline of ``p`` ranks may cut the model into ``S = p v`` contiguous chunks (numbered
``0..S-1`` in model order) and give each rank ``v`` of them; a schedule then names the chunk
in ``Action.stage`` and stays keyed by rank. Two placements:

* ``"looped"`` (interleaved 1F1B): chunk ``c`` on rank ``c % p`` -- rank 0 holds chunks
  ``0, p, 2p, ...``; a micro-batch loops through the ranks ``v`` times.
* ``"v"`` (ZB-V): rank ``r`` holds chunks ``r`` and ``2p - 1 - r``: a micro-batch goes down
  the ranks and comes back up, so the first and the last chunk (embedding and head, often
  tied) share rank 0 and the turn at rank ``p - 1`` is a local hand-off. With more than two
  chunks per rank the V repeats as a zigzag (down, up, down, ...).

With ``v = 1`` both are the identity (chunk ``c`` on rank ``c``): one-chunk plans are unchanged.
"""

from __future__ import annotations

from lightning_autopipe.errors import ScheduleError

__all__ = ["PLACEMENTS", "check_placement", "chunk_rank", "rank_chunks", "chunk_ranks",
           "local_handoff"]

PLACEMENTS = ("looped", "v")


def check_placement(num_ranks: int, chunks_per_rank: int, placement: str) -> None:
    """A ScheduleError naming the bad value when ``(p, v, placement)`` is not a layout."""
    for name, val in (("num_ranks", num_ranks), ("chunks_per_rank", chunks_per_rank)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {val!r}")
    if placement not in PLACEMENTS:
        raise ScheduleError(
            f"unknown placement {placement!r}; use one of {list(PLACEMENTS)} ('looped': chunk "
            "c on rank c % p, 'v': rank r holds chunks r and 2p-1-r)"
        )


def chunk_rank(chunk: int, num_ranks: int, chunks_per_rank: int = 1,
               placement: str = "looped") -> int:
    """The rank position (0..p-1) that holds chunk ``chunk`` (0..p v - 1)."""
    p = num_ranks
    if not 0 <= chunk < p * chunks_per_rank:
        raise ScheduleError(
            f"chunk {chunk} is outside 0..{p * chunks_per_rank - 1} "
            f"({p} ranks x {chunks_per_rank} chunks)"
        )
    lap, pos = divmod(chunk, p)
    if placement == "v" and lap % 2:
        return p - 1 - pos
    return pos


def chunk_ranks(num_ranks: int, chunks_per_rank: int = 1,
                placement: str = "looped") -> tuple[int, ...]:
    """:func:`chunk_rank` of every chunk, in model order."""
    check_placement(num_ranks, chunks_per_rank, placement)
    return tuple(chunk_rank(c, num_ranks, chunks_per_rank, placement)
                 for c in range(num_ranks * chunks_per_rank))


def rank_chunks(rank: int, num_ranks: int, chunks_per_rank: int = 1,
                placement: str = "looped") -> list[int]:
    """The chunks rank ``rank`` holds, in model order."""
    if not 0 <= rank < num_ranks:
        raise ScheduleError(f"rank {rank} is outside 0..{num_ranks - 1}")
    owner = chunk_ranks(num_ranks, chunks_per_rank, placement)
    return [c for c, r in enumerate(owner) if r == rank]


def local_handoff(owner: tuple[int, ...] | list[int], a: int, b: int) -> bool:
    """Whether chunks ``a`` and ``b`` (neighbours) sit on one rank: their activations and
    gradients pass without a send (the runtime hands the tensor over directly)."""
    return owner[a] == owner[b]
