"""Link arithmetic for the fast cost model: replica pairing, contention, all-reduce rings."""

from __future__ import annotations

from typing import Any

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster


def _pairs(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    """Which replica of stage ``s`` talks to which of ``s + 1``: by index, wrapping around."""
    n = max(len(a), len(b))
    return [(a[i * len(a) // n], b[i * len(b) // n]) for i in range(n)]


def _contended_gbps(cluster: Cluster, pairs: list[tuple[str, str]]) -> float:
    """Bandwidth of the slowest of ``pairs`` when all transfer at once over shared links."""
    use: dict[tuple, int] = {}
    res = [cluster.link_resources(x, y) for x, y in pairs]
    for rs in res:
        for r in rs:
            use[r] = use.get(r, 0) + 1
    worst = float("inf")
    for (x, y), rs in zip(pairs, res):
        bw = cluster.bandwidth_gbps(x, y)
        for r in rs:
            bw = min(bw, cluster.resource_gbps(r) / use[r])
        worst = min(worst, bw)
    return worst


def _allreduce_costs(
    cluster: Cluster, groups: list[list[str]], contended: bool = True
) -> tuple[list[float], list[float]]:
    """Per group: ring all-reduce (latency ms, ms per parameter byte on the links).

    The stages' all-reduces run at the end of the step, close together; rings whose edges
    share a NIC or a PCIe level split its bandwidth, which decides between keeping a stage's
    replicas in one server and spreading them.
    """
    rings = []
    use: dict[tuple, int] = {}
    for g in groups:
        ring = cluster.ring_order(list(g))
        edges = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
        edges = edges if len(ring) > 1 else []
        res = [cluster.link_resources(a, b) for a, b in edges]
        for rs in res:
            for r in rs:
                use[r] = use.get(r, 0) + 1
        rings.append((edges, res))
    lat, per_byte = [], []
    for edges, res in rings:
        n = len(edges)
        if n < 2:
            lat.append(0.0)
            per_byte.append(0.0)
            continue
        bw = float("inf")
        for (a, b), rs in zip(edges, res):
            e = cluster.bandwidth_gbps(a, b)
            for r in rs if contended else ():
                e = min(e, cluster.resource_gbps(r) / use[r])
            bw = min(bw, e)
        lat.append(2 * (n - 1) * max(cluster.latency_us(a, b) for a, b in edges) / 1e3)
        per_byte.append(2 * (n - 1) / n / (bw * BYTES_PER_MS_PER_GBPS))
    return lat, per_byte


def _reduce_costs(cluster: Cluster, groups: list[list[str]]) -> list[float]:
    """Per group: the ring all-reduce's own reduction time per gradient byte (no link shared)."""
    return [cluster.reduce_ms_per_byte(list(g)) for g in groups]


def _ring_resources(
    cluster: Cluster, groups: list[list[str]]
) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], tuple[float, ...]]:
    """Per group, the shared-link resources (as indices) each edge of its all-reduce ring uses."""
    index: dict[tuple, int] = {}
    caps: list[float] = []
    rings = []
    for g in groups:
        ring = cluster.ring_order(g)
        edges = []
        if len(ring) > 1:
            for i in range(len(ring)):
                a, b = ring[i], ring[(i + 1) % len(ring)]
                ids = []
                for r in cluster.link_resources(a, b):
                    if r not in index:
                        index[r] = len(caps)
                        caps.append(cluster.resource_gbps(r) * BYTES_PER_MS_PER_GBPS)
                    ids.append(index[r])
                if not ids:  # a link without shared resources: its own bandwidth
                    index[("edge", a, b)] = len(caps)
                    caps.append(cluster.bandwidth_gbps(a, b) * BYTES_PER_MS_PER_GBPS)
                    ids.append(len(caps) - 1)
                edges.append(tuple(ids))
        rings.append(tuple(edges))
    return tuple(rings), tuple(caps)


def _reduce_of(layout: Any, s: int) -> float:
    """Stage ``s``'s reduction time per gradient byte (0 for layouts built without it)."""
    return layout.ar_reduce_ms_per_byte[s] if layout.ar_reduce_ms_per_byte else 0.0


def _allreduce_finish(layout: Any, stage_end: list[float], nbytes: list[float]) -> list[float]:
    """When each stage's gradient all-reduce ends, rings sharing links splitting their bandwidth.

    A small fluid model: each ring starts when its stage's last action ends and moves
    ``2 (n - 1) / n`` of the gradient bytes over every edge; an edge gets an equal share of each
    resource it crosses, a ring advances at its slowest edge's rate, and rates are recomputed
    whenever a ring starts or ends; the reduction's own work (no link) adds to each ring's end.
    The optimistic layout uses uncontended rings instead.
    """
    num = len(stage_end)
    out = list(stage_end)
    jobs = {}
    for s in range(num):
        edges = layout.ar_rings[s] if layout.ar_rings else ()
        if len(edges) > 1 and nbytes[s] > 0:
            if layout.optimistic:
                per_byte = layout.ar_ms_per_byte[s] + _reduce_of(layout, s)
                out[s] = stage_end[s] + layout.ar_lat_ms[s] + nbytes[s] * per_byte
            else:
                n = len(edges)
                reduce = nbytes[s] * _reduce_of(layout, s)
                jobs[s] = [stage_end[s], 2 * (n - 1) / n * nbytes[s], reduce]
    if not jobs:
        return out
    caps = layout.ar_caps
    pending = sorted(jobs, key=lambda s: jobs[s][0])
    active: dict[int, float] = {}
    t = jobs[pending[0]][0]
    # Every pass admits the next ring or ends the ring(s) that finish first, chosen by the
    # time they finish and not by what is left of their bytes: with near-free links a ring's
    # remaining time can fall below the resolution of ``t`` (a step of 0), so a test on the
    # leftover bytes would never succeed and the loop would spin. At most 2 x rings passes.
    while pending or active:
        while pending and jobs[pending[0]][0] <= t:
            s = pending.pop(0)
            active[s] = jobs[s][1]
        if not active:
            t = jobs[pending[0]][0]
            continue
        load: dict[int, int] = {}
        for s in active:
            for e in layout.ar_rings[s]:
                for r in e:
                    load[r] = load.get(r, 0) + 1
        rate = {s: min(caps[r] / load[r] for e in layout.ar_rings[s] for r in e) for s in active}
        left = {s: active[s] / rate[s] for s in active}
        first = min(left.values())
        nxt = jobs[pending[0]][0] if pending else float("inf")
        if nxt < t + first:  # a ring starts before any ends: advance to it
            for s in active:
                active[s] -= rate[s] * (nxt - t)
            t = nxt
            continue
        ended = [s for s in active if left[s] <= first * (1 + 1e-9)]
        t += first
        for s in list(active):
            if s in ended:
                del active[s]
                out[s] = t + layout.ar_lat_ms[s] + jobs[s][2]
            else:
                active[s] = max(active[s] - rate[s] * first, 0.0)
    return out
