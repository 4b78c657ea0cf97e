"""Heterogeneity-aware placement of pipeline stages and their replicas on a cluster.

Where a stage runs decides its speed (the slowest replica sets the pace of a data-parallel group),
its memory, what its activations cross on the way to the next stage and what its gradients cross
in the all-reduce. The mapper builds a few structurally different layouts and keeps the one the
cost model predicts fastest, after partitioning the blocks *for that layout* (so a fast group gets
more blocks instead of idling):

* when not all devices are used, the layouts below are built on the fastest devices (whole
  servers together), and also on the servers of the fastest internal links and on the first
  ranks: the fastest devices can sit behind slow links the shape's traffic would cross;
* ``grouped``: each stage's replicas are consecutive devices of one speed class in topology order,
  so a data-parallel group shares the innermost level it can (no needless cross-server
  all-reduce) and consecutive stages sit next to each other (their activations stay on the fast
  levels of one server until a server boundary);
* ``grouped-reversed``: the same groups with the pipeline running from the slow end, which
  helps when the first stages hold the most in-flight activations and memory is the limit;
* ``pipelined``: each replica's whole pipeline packed into consecutive devices (activations never
  leave a server; the all-reduce crosses servers instead) — best for activation-heavy models on
  homogeneous servers;
* speed-class orders: the groups of each device speed kept together but the classes in every
  order (slow first, slow last, slow at both ends ...), or every group order for up to four
  stages — where slow stages sit changes the critical path of a short pipeline;
* ``rank-order``: DAPPLE/Megatron-style consecutive ranks, when that differs;
* layouts that cost the same (interchangeable devices) are scored once;
* link contention is part of the score: the ``R`` parallel transfers of one cut that share a NIC
  or a PCIe level divide its bandwidth (see :class:`~.costmodel.Layout`).

Faster devices take heavier stages because the partition that follows divides each stage's work
by its speed; memory limits are part of that partition and of the score.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ClusterError, PlanError
from lightning_autopipe.hardware import Device
from lightning_autopipe.planner.costmodel import Estimate, evaluate_batch
from lightning_autopipe.planner.layout import BlockCosts, Layout
from lightning_autopipe.planner.partition import balanced_cuts, stage_limits
from lightning_autopipe.planner.step import StepShape

__all__ = ["speed_order", "candidate_groupings", "rank_layouts", "MappingResult"]


def speed_order(
    cluster: Cluster, devices: Sequence[str] | None = None,
    first: Callable[[Device], float] | None = None,
) -> list[str]:
    """``devices`` fastest server first, keeping each server's devices together in rank order
    (``first``: a key ranked before the speed, smallest first)."""
    names = [d.name for d in cluster.devices] if devices is None else list(devices)
    devs = [cluster.device(n) for n in names]
    first_rank: dict[str, int] = {}
    for d in devs:
        first_rank.setdefault(d.server, d.rank)
    devs.sort(key=lambda d: (first(d) if first is not None else 0.0, -d.spec.speed,
                             -d.spec.memory_bytes, first_rank[d.server], d.rank))
    return [d.name for d in devs]


def candidate_groupings(
    cluster: Cluster, devices: Sequence[str], num_stages: int, replicas: int
) -> dict[str, list[list[str]]]:
    """Named layouts of ``num_stages`` groups of ``replicas`` devices (see module docstring).

    Raises:
        PlanError: fewer devices than ``num_stages * replicas``.
    """
    need = num_stages * replicas
    if need > len(devices):
        raise PlanError(
            f"{num_stages} stages x {replicas} replicas need {need} devices but only "
            f"{len(devices)} are available; use fewer stages or replicas, or add devices"
        )
    out: dict[str, list[list[str]]] = {}
    for tag, chosen in _device_subsets(cluster, devices, need).items():
        for name, groups in _groupings(cluster, chosen, num_stages, replicas).items():
            out[f"{tag}:{name}" if tag else name] = groups
    seen, unique = set(), {}
    for name, groups in out.items():
        key = tuple(tuple(g) for g in groups)
        if key not in seen:
            seen.add(key)
            unique[name] = groups
    return unique


def _device_subsets(cluster: Cluster, devices: Sequence[str], need: int) -> dict[str, list[str]]:
    """The devices a shape of ``need`` runs on, when not all are needed: the fastest (whole
    servers together, :func:`speed_order`), and also the servers of the fastest internal links
    first (``links``) and the first ranks (``ranks``), each in :func:`speed_order`. The
    fastest devices can sit behind slow links that the traffic of the shape (activations,
    the all-reduce) would cross; the layouts of every subset are priced alike."""
    fastest = speed_order(cluster, devices)
    out = {"": fastest[:need]}
    if need >= len(fastest):
        return out
    specs = dict(cluster.instances)

    def slowest_link(d: Device) -> float:  # the server's slowest internal level, fastest first
        return -min((lv.gbps for lv in specs[d.server].levels), default=float("inf"))

    by_links = speed_order(cluster, devices, first=slowest_link)
    by_rank = sorted(fastest, key=lambda n: cluster.device(n).rank)
    for tag, order in (("links", by_links), ("ranks", by_rank)):
        chosen = speed_order(cluster, order[:need])
        if all(set(chosen) != set(c) for c in out.values()):
            out[tag] = chosen
    return out


def _groupings(
    cluster: Cluster, chosen: list[str], num_stages: int, replicas: int
) -> dict[str, list[list[str]]]:
    """The named layouts of :func:`candidate_groupings` on the devices ``chosen`` (fastest
    first)."""
    topo = sorted(chosen, key=lambda n: cluster.device(n).rank)
    out: dict[str, list[list[str]]] = {}
    grouped = [chosen[s * replicas : (s + 1) * replicas] for s in range(num_stages)]
    out["grouped"] = grouped
    if num_stages > 1:
        out["grouped-reversed"] = grouped[::-1]
    if replicas > 1 and num_stages > 1:
        pipes = [chosen[r * num_stages : (r + 1) * num_stages] for r in range(replicas)]
        out["pipelined"] = [[p[s] for p in pipes] for s in range(num_stages)]
    if topo != chosen:
        out["rank-order"] = [topo[s * replicas : (s + 1) * replicas] for s in range(num_stages)]
    out.update(_speed_orders(cluster, grouped))
    return out


def _speed_orders(cluster: Cluster, grouped: list[list[str]]) -> dict[str, list[list[str]]]:
    """Pipeline orders of the speed classes: where slow stages sit changes the critical path.

    The first stage waits longest for gradients and holds the most activations, the last one
    closes every micro-batch's round trip; putting slow groups at the ends, in the middle or
    first can each win. Groups of one speed stay contiguous (topology locality); with at most
    4 stages every order is tried.
    """
    speed = [min(cluster.device(d).spec.speed for d in g) for g in grouped]
    out: dict[str, list[list[str]]] = {}
    if len(grouped) <= 4:
        for perm in itertools.permutations(range(len(grouped))):
            out[f"order{''.join(map(str, perm))}"] = [grouped[i] for i in perm]
        return out
    blocks: list[list[list[str]]] = []
    for g, sp in zip(grouped, speed):
        if blocks and min(cluster.device(d).spec.speed for d in blocks[-1][0]) == sp:
            blocks[-1].append(g)
        else:
            blocks.append([g])
    if len(blocks) < 2 or len(blocks) > 4:
        return out
    for perm in itertools.permutations(range(len(blocks))):
        out[f"classes{''.join(map(str, perm))}"] = [g for i in perm for g in blocks[i]]
    slow = blocks[-1]
    if len(slow) >= 2:
        half = len(slow) // 2
        middle = [g for b in blocks[:-1] for g in b]
        out["slow-ends"] = slow[:half] + middle + slow[half:]
    return out


@dataclass
class MappingResult:
    """The chosen layout, the cuts it was scored with and the fast model's estimate."""

    name: str
    layout: Layout
    cuts: list[int]
    estimate: Estimate
    scores: dict[str, float]


def rank_layouts(
    costs: BlockCosts,
    cluster: Cluster,
    devices: Sequence[str],
    num_stages: int,
    replicas: int,
    step: StepShape,
) -> list[MappingResult]:
    """Every candidate layout with its balanced partition, fastest (fitting memory) first,
    each priced under ``step``.

    Raises:
        PlanError: more stages than blocks, or too few devices.
    """
    if num_stages > costs.num_blocks:
        raise PlanError(
            f"cannot split {costs.num_blocks} blocks into {num_stages} stages; use at most "
            f"{costs.num_blocks} stages"
        )
    if not devices:
        raise ClusterError("no devices to place stages on; pass at least one device name")
    scores: dict[str, float] = {}
    work = costs.compute
    seen = set()
    found: list[tuple[str, Layout, list[int]]] = []
    for name, groups in candidate_groupings(cluster, devices, num_stages, replicas).items():
        layout = Layout.from_cluster(cluster, groups)
        sig = layout.signature()
        if sig in seen:  # e.g. permutations of identical devices: nothing to tell them apart
            continue
        seen.add(sig)
        limits = stage_limits(costs, layout, step)
        typed = costs.stage_work(layout)
        cuts = balanced_cuts(work, layout.speeds, limits=limits, stage_work=typed) or (
            balanced_cuts(work, layout.speeds, stage_work=typed))
        assert cuts is not None
        found.append((name, layout, cuts))
    ests = evaluate_batch(costs, [lay for _, lay, _ in found], [c for _, _, c in found], step,
                          critical_path=False)
    out: list[MappingResult] = []
    for (name, layout, cuts), est in zip(found, ests):
        scores[name] = est.iteration_ms
        out.append(MappingResult(name, layout, cuts, est, scores))
    out.sort(key=lambda r: (not r.estimate.fits, r.estimate.iteration_ms))
    return out
