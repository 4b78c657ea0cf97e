"""Measure the launched processes' link and all-reduce for the local cluster.

Without a cluster file the strategy describes the launched world as ``Cluster.local``, and the
planner prices every pipeline transfer and every data-parallel gradient all-reduce with that
cluster's figures. Fixed defaults can be off several times over (gloo between two local
processes moves 12-18 Gb/s for MB-sized messages, not 2), which makes the planner shy away from
data parallelism where it is the fastest layout. So the link is measured once, on the process
group the run uses, before planning (:func:`measure_link`), and then a real all-reduce
(:func:`measure_reduce`): on a CPU, gloo's all-reduce takes about three times what its bytes
need on that link (it sums and copies them on the same cores), which the link alone misses.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.pricing import allreduce_ms
from lightning_autopipe.runtime.clock import now
from lightning_autopipe.runtime.comm import transport_device

__all__ = ["fit_link", "fit_reduce", "link_device", "measure_link", "measure_reduce"]

#: No process-group message is cheaper than this (a floor for a noisy or negative fit).
MIN_LATENCY_US = 1.0
#: An all-reduce within this fraction of what its link needs has a free reduction (noise).
REDUCE_NOISE = 0.05
_TAG = 0


def link_device(
    group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> torch.device:
    """The device whose tensors ``group``'s backend moves: CUDA for NCCL, the CPU for gloo.

    A CUDA ``device`` on a group with an NCCL backend (also ``"cpu:gloo,cuda:nccl"``) is kept,
    so the figures are those of the transport the gradients will take; gloo gets CPU tensors
    (its send/recv takes no CUDA tensors); any other backend gets ``device`` (or the CPU).
    It is the rule pipeline messages travel by (``comm.transport_device``), so the link is
    measured on the transport that training's activations and gradients take.
    """
    return transport_device(str(dist.get_backend(group)), device)


def fit_link(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    """``(latency_us, gbps)`` of ``t(n) = latency + n / bandwidth`` through two one-way times.

    Args:
        small: ``(bytes, seconds)`` of the small message.
        large: ``(bytes, seconds)`` of the large message (more bytes than ``small``).

    Noise can make the fit's slope zero or negative, or its intercept negative: the bandwidth
    is then at least what the large message alone shows (``n / t(n)``: all of its time spent
    moving bytes), and the latency at least :data:`MIN_LATENCY_US` (at most the small time).
    """
    (ns, ts), (nl, tl) = small, large
    if nl <= ns:
        raise ValueError(f"the large message ({nl} bytes) must be larger than the small ({ns})")
    tl = max(tl, 1e-9)
    floor = nl / tl  # bytes per second, a lower bound on the bandwidth
    dt = tl - ts
    bps = max((nl - ns) / dt, floor) if dt > 0 else floor
    latency_us = max(min((ts - ns / bps) * 1e6, ts * 1e6), MIN_LATENCY_US)
    return float(latency_us), float(bps * 8 / 1e9)


def _round_trip(me: int, peer: int, buf: torch.Tensor, device: torch.device) -> float:
    """Seconds for ``buf`` to go from group rank 0 to rank 1 and back (``me`` is 0 or 1)."""
    start = now(device)
    if me == 0:
        dist.send(buf, peer, tag=_TAG)
        dist.recv(buf, peer, tag=_TAG)
    else:
        dist.recv(buf, peer, tag=_TAG)
        dist.send(buf, peer, tag=_TAG)
    return now(device) - start


def _member(group: dist.ProcessGroup | None) -> int | None:
    """This process's rank in ``group`` when there is something to measure there: None when
    ``torch.distributed`` is not initialized, the group has a single rank, or this process is
    not a member."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me = dist.get_rank(group)
    if me < 0 or dist.get_world_size(group) < 2:
        return None
    return me


def _from_first_rank(
    values: list[float], group: dist.ProcessGroup | None, dev: torch.device
) -> list[float]:
    """The group's rank 0 ``values`` on every rank (so all plan from the same figures)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    out = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.broadcast(out, ranks[0], group=group)
    return [float(v) for v in out.tolist()]


def measure_link(
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    sizes: Sequence[int] = (4 * 2**10, 4 * 2**20),
    warmup: int = 2,
    repeats: int = 9,
) -> tuple[float, float] | None:
    """``(latency_us, gbps)`` of one message between the group's ranks 0 and 1; collective.

    Every rank of ``group`` (default: the default group) must call it. Ranks 0 and 1 ping-pong a
    small and a large message (``sizes``, bytes) on :func:`link_device` in alternation,
    ``warmup`` rounds and then ``repeats`` timed ones. The one-way time ``t(n) = latency +
    n / bandwidth`` is solved (:func:`fit_link`) from the small message's fastest round trip
    (noise only ever adds time to a message; with the median, one benchmark start measured
    770 us where other starts measured about 100 us) and the median extra time of the large
    one over the small one of the same round (halved): a scheduler hiccup that delays both
    messages of a round then leaves the bandwidth alone. Rank 0's
    figures are then broadcast, so every rank returns the same numbers and plans from the same
    inputs. Only ``send``/``recv``/``broadcast`` on ``group`` are used, each bounded by the
    group's timeout, so a missing peer fails instead of hanging.

    Returns:
        None when ``torch.distributed`` is not initialized, the group has a single rank, or
        this process is not a member: there is no link to measure.
    """
    me = _member(group)
    if me is None:
        return None
    small, large = sorted(int(s) for s in sizes)
    if small < 4 or large // 4 <= small // 4:  # float32 buffers: whole 4-byte elements
        raise ValueError(f"sizes must be two byte counts >= 4, 4+ apart, got {tuple(sizes)}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    dev = link_device(group, device)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    fit = (0.0, 0.0)  # what ranks other than 0 offer: rank 0's figures replace them
    if me in (0, 1):
        peer = ranks[1 - me]
        bufs = [torch.zeros(n // 4, dtype=torch.float32, device=dev) for n in (small, large)]
        rounds = []
        for r in range(warmup + repeats):  # small and large alternate: shared noise cancels
            pair = [_round_trip(me, peer, buf, dev) for buf in bufs]
            if r >= warmup:
                rounds.append(pair)
        if me == 0:
            ts = min(p[0] for p in rounds) / 2
            extra = statistics.median(p[1] - p[0] for p in rounds) / 2
            nbytes = [buf.numel() * 4 for buf in bufs]
            fit = fit_link((nbytes[0], ts), (nbytes[1], ts + extra))
    latency_us, gbps = _from_first_rank(list(fit), group, dev)
    return latency_us, gbps


def fit_reduce(
    world: int, nbytes: int, seconds: float, latency_us: float, gbps: float
) -> float:
    """``reduce_gbps`` that makes :func:`~lightning_autopipe.planner.pricing.allreduce_ms`
    match a measured all-reduce.

    What the measured ``seconds`` exceed the ring's link part by (the all-reduce priced on
    ``world`` ranks joined by a link of ``gbps`` and ``latency_us``, reducing for free) is the
    reduction each rank does on its ``(w-1)/w`` share of the bytes: its rate is returned in
    Gb/s of reduced bytes. ``inf`` (free) when the link explains the time to within
    :data:`REDUCE_NOISE`, or for a single rank.
    """
    if world < 2 or nbytes <= 0:
        return math.inf
    link = Cluster.local(world, gbps=gbps, latency_us=latency_us)
    link_s = allreduce_ms(link, [d.name for d in link.devices], nbytes) / 1e3
    extra = seconds - link_s
    if extra <= REDUCE_NOISE * seconds:
        return math.inf
    return float((world - 1) / world * nbytes * 8 / extra / 1e9)


def measure_reduce(
    link: tuple[float, float],
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    nbytes: int = 16 * 2**20,
    warmup: int = 1,
    repeats: int = 5,
) -> float | None:
    """``reduce_gbps`` of ``group``'s all-reduce (see :func:`fit_reduce`); collective.

    Every rank of ``group`` all-reduces a float32 buffer of ``nbytes`` (gradient-sized: the
    reduction's rate on a CPU depends on the bytes leaving the caches) after a barrier,
    ``warmup`` times and then ``repeats`` timed times; rank 0's fastest run (noise only adds
    time) is fitted against ``link`` = ``(latency_us, gbps)`` from :func:`measure_link` and
    broadcast, so every rank plans from the same figure. Each collective is bounded by the
    group's timeout.

    Returns:
        None when ``torch.distributed`` is not initialized, the group has a single rank, or
        this process is not a member.
    """
    if _member(group) is None:
        return None
    if nbytes < 4 or warmup < 0 or repeats < 1:
        raise ValueError(
            f"need nbytes >= 4, warmup >= 0 and repeats >= 1, got {nbytes}, {warmup}, {repeats}"
        )
    dev = link_device(group, device)
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
    times = []
    for r in range(warmup + repeats):
        dist.barrier(group=group)
        start = now(dev)
        dist.all_reduce(buf, group=group)
        stop = now(dev)
        if r >= warmup:
            times.append(stop - start)
    world = dist.get_world_size(group)
    (rate,) = _from_first_rank([fit_reduce(world, buf.numel() * 4, min(times), *link)], group, dev)
    return rate
