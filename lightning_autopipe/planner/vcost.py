"""The fast model for several stage chunks per rank: the same replay over chunk-level lists.

A chunked schedule (:mod:`~.generators`, ``v > 1``) is compiled into the fast model's flat
dependency order (:class:`~.compiled.Compiled`) with one entry per chunk: an action's
predecessor is the one before it *on its rank*, and its cross dependency (the neighbouring
chunk's F or B of its unit) counts only when that chunk is on another rank -- a local
hand-off costs nothing and its producer ran earlier on the same rank. The replay is the fast
model's own (:func:`~.scalar.replay`) on a chunk-level :class:`~.layout.Layout` (chunk
``c`` priced on the devices of its rank; the cut after it is the link between the two
ranks), so every price is the one formula of :mod:`~.pricing`. Per rank:

* it finishes with its last action (the latest of its chunks');
* it all-reduces the gradients of all its chunks in one ring (:func:`~.allreduce
  .allreduce_finish` on the rank-level layout), as the simulator does;
* its peak memory is the parameter state of its chunks plus the most activation memory its
  chunks hold at once in list order (each chunk's bytes per micro-batch times its units in
  flight, summed), :func:`~.pricing.peak_memory_bytes`.

Not modelled, as in the one-chunk fast model: link contention (transfers of different chunk
pairs over one link queue per cut, not shared) and long-step extrapolation (chunked steps are
replayed whole).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ScheduleError
from lightning_autopipe.planner.allreduce import allreduce_finish
from lightning_autopipe.planner.compiled import B, Compiled, F, W
from lightning_autopipe.planner.costmodel import Estimate, inputs_of
from lightning_autopipe.planner.generators import GENERATORS, generate
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.placement import chunk_ranks
from lightning_autopipe.planner.pricing import peak_memory_bytes
from lightning_autopipe.planner.scalar import replay
from lightning_autopipe.planner.schedule import Kind, unit_sizes, units
from lightning_autopipe.planner.step import StepShape

__all__ = ["ChunkLayout", "chunk_compiled", "evaluate_chunked"]

_CODE = {Kind.FORWARD: F, Kind.BACKWARD: B, Kind.WEIGHT: W}


@dataclass(frozen=True)
class ChunkLayout:
    """Where the chunks run: the rank-level layout (memory, all-reduce rings) and the
    chunk-level one (speeds, overheads and the links between consecutive chunks)."""

    ranks: Layout
    chunks: Layout
    chunks_per_rank: int
    placement: str

    @classmethod
    def from_cluster(cls, cluster: Cluster, groups: Sequence[Sequence[str]],
                     chunks_per_rank: int, placement: str, *,
                     optimistic: bool = False) -> ChunkLayout:
        """``groups``: the devices of each rank position, in rank order."""
        owner = chunk_ranks(len(groups), chunks_per_rank, placement)
        return cls(Layout.from_cluster(cluster, [list(g) for g in groups],
                                       optimistic=optimistic),
                   Layout.from_cluster(cluster, [list(groups[r]) for r in owner],
                                       optimistic=optimistic),
                   chunks_per_rank, placement)

    @property
    def owner(self) -> tuple[int, ...]:
        return chunk_ranks(self.ranks.num_stages, self.chunks_per_rank, self.placement)


@functools.lru_cache(maxsize=512)
def _lists(schedule: str, p: int, v: int, m: int, k: int, j: int) -> tuple:
    """The generator's schedule as per-rank (kind code, unit index, chunk) lists."""
    acts = generate(schedule, p, m, k, j, v)
    index = {u: i for i, u in enumerate(units(m, k, j))}
    return tuple(tuple((_CODE[a.kind], index[a.unit], a.stage) for a in acts[r])
                 for r in range(p))


@functools.lru_cache(maxsize=512)
def chunk_compiled(schedule: str, p: int, v: int, m: int, k: int, mb: int,
                   j: int = 1) -> Compiled:
    """The chunked schedule in dependency order (module docstring), cached per shape."""
    lists = _lists(schedule, p, v, m, k, j)
    owner = chunk_ranks(p, v, GENERATORS[schedule].placement)
    nc, fracs = p * v, [sz / mb for sz in unit_sizes(mb, m, k, j)]
    nu = len(fracs)
    done = {F: [[-1] * nu for _ in range(nc)], B: [[-1] * nu for _ in range(nc)]}
    pos, prev = [0] * p, [-1] * p
    last = [-1] * nc
    order: list[tuple[int, int, int, int, int]] = []
    moved = True
    while moved:
        moved = False
        for r in range(p):
            acts = lists[r]
            while pos[r] < len(acts):
                code, u, c = acts[pos[r]]
                dep = c - 1 if code == F else c + 1
                cross = -1
                if code != W and 0 <= dep < nc:
                    at = done[code][dep][u]
                    if at < 0:
                        break  # a local producer always ran before: only remote ones wait
                    cross = at if owner[dep] != r else -1
                n = len(order)
                order.append((c, code, u, prev[r], cross))
                prev[r] = last[c] = n
                if code != W:
                    done[code][c][u] = n
                pos[r] += 1
                moved = True
    if any(pos[r] < len(lists[r]) for r in range(p)):
        raise ScheduleError(f"schedule {schedule!r} deadlocks for p={p}, v={v}, m={m}")
    split = any(code == W for acts in lists for code, _, _ in acts)
    return Compiled(tuple(order), tuple(last), (), tuple(fracs), split)


@functools.lru_cache(maxsize=512)
def _held(schedule: str, p: int, v: int, m: int, k: int, mb: int, j: int) -> tuple:
    """Per rank, its (chunk, +/- micro-batch fraction of the activations, of the loss's part)
    steps of activations held, in order: a unit's forward takes both, its release (W under a
    split backward, else B) gives back the activations, its B the loss's part."""
    comp = chunk_compiled(schedule, p, v, m, k, mb, j)
    release = W if comp.split else B
    out = []
    for acts in _lists(schedule, p, v, m, k, j):
        steps = []
        for code, u, c in acts:
            f = comp.fracs[u]
            if code == F:
                steps.append((c, f, f))
            elif code in (release, B):
                steps.append((c, -f if code == release else 0.0, -f if code == B else 0.0))
        out.append(tuple(steps))
    return tuple(out)


def evaluate_chunked(
    costs: BlockCosts,
    layout: ChunkLayout,
    cuts: Sequence[int],
    step: StepShape,
    *,
    critical_path: bool = True,
) -> Estimate:
    """Replay ``step.schedule`` (a chunked one) for chunk boundaries ``cuts`` (``[0, c1, ...,
    N]``, ``p v + 1`` entries) on ``layout``. ``stage_ms`` and ``critical_share`` are per
    chunk, ``peak_bytes`` per rank (what the rank's device holds)."""
    lay, ranks = layout.chunks, layout.ranks
    p, v = ranks.num_stages, layout.chunks_per_rank
    if len(cuts) != p * v + 1:
        raise ScheduleError(f"{p} ranks x {v} chunks need {p * v + 1} cuts, got {len(cuts)}")
    schedule, m = step.schedule, step.num_microbatches
    k, j = step.startup_slices, step.drain_slices
    x = inputs_of(costs, lay, list(cuts), step)
    comp = chunk_compiled(schedule, p, v, m, k, x.mb, j)
    finish, _, via = replay(comp, x.var, x.per_call, x.cut_ms, lay.link_lat_ms,
                             [0.0] * (p * v), not lay.optimistic)
    owner = layout.owner
    rank_end = [max(finish[c] for c in range(p * v) if owner[c] == r) for r in range(p)]
    grads = [float(costs.param_bytes(*[(cuts[c], cuts[c + 1]) for c in range(p * v)
                                       if owner[c] == r])) for r in range(p)]
    done = allreduce_finish(ranks, rank_end, grads)
    peaks, fits = [], True
    # each chunk's activations as the simulator counts them (pricing.stage_memory)
    held = [costs.memory(cuts[c], cuts[c + 1], m) for c in range(p * v)]
    loss = [costs.loss_share(cuts[c], cuts[c + 1]) * x.scale[c] if comp.split else 0.0
            for c in range(p * v)]  # what the loss saves: freed at B (split backward only)
    mem = [per_mb * x.scale[c] - loss[c] for c, (per_mb, _) in enumerate(held)]
    for r, steps in enumerate(_held(schedule, p, v, m, k, x.mb, j)):
        cur = top = 0.0
        for c, d, d_loss in steps:
            cur += mem[c] * d + loss[c] * d_loss
            top = max(top, cur)
        once = sum(held[c][1] * x.scale[c] for c in range(p * v) if owner[c] == r)
        peak = peak_memory_bytes(grads[r], top, 1.0, step.optimizer_factor, once)
        peaks.append(peak)
        fits = fits and peak <= ranks.capacity[r]
    share = [0.0] * (p * v)
    if critical_path:
        n = comp.last[max(range(p * v), key=finish.__getitem__)]
        while n >= 0:
            c, code, u, prev, cross = comp.order[n]
            share[c] += x.var[code][c] * comp.fracs[u] + x.per_call[code][c]
            n = cross if via[n] else prev
    ovh = lay.overhead_ms
    stage_ms = [sum(sum(q) for q in row) + len(row) * ovh[c] for c, row in enumerate(x.parts)]
    crit = max(range(p * v), key=share.__getitem__)
    return Estimate(max(done), crit, stage_ms, peaks, fits, share)
