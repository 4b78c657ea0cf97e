"""Level 1 of the AutoPipe search: every (stages, replicas, micro-batches) scored in closed form.

Each shape ``S x R`` on the fastest ``S R`` devices (in :func:`~.mapping.speed_order`) is
scored without a replay: ``m + S - 1`` stage times, a stage time being the larger of
perfectly balanced compute (plus half a block of rounding) and the slowest cut's transfer,
plus the fill latency and the first stage's all-reduce; startup and drain slices are counted
in (:func:`slice_term`), and a rough memory check marks shapes that cannot fit.

A thousand blocks on a thousand devices make thousands of ``S x R`` pairs and tens of
thousands of (pair, micro-batch count, slice count) terms, so the figures every pair shares
are computed once (prefix minima and maxima of the ordered devices, the cut links of each
stride ``R``, the ring of each ``R``) and the terms are evaluated as numpy arrays; every value
is the same float operation as the scalar formula, in the same order (a test holds the two
equal).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.planner.mapping import speed_order
from lightning_autopipe.planner.pricing import allreduce_ms, param_state_factor

__all__ = ["Shape", "microbatch_choices", "model_figures", "score_shapes", "slice_term",
           "stage_replica_pairs"]


@dataclass
class Shape:
    """One (stages, replicas, micro-batches) with its closed-form step estimate."""

    stages: int
    replicas: int
    microbatches: int
    score: float
    fits: bool
    overflow: float = 0.0  # the rough check's need over capacity (> 1: does not fit)


def microbatch_choices(batch: int, replicas: int) -> list[int]:
    """Micro-batch counts that divide the per-replica batch.

    All divisors: the largest ones (micro-batches of one or two samples) are often the only
    way a big model fits memory, and the replay of long steps is extrapolated, so many
    micro-batches cost the search little.
    """
    return list(_divisors(batch // replicas))


@functools.lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(m for m in range(1, n + 1) if n % m == 0)


def slice_term(
    fill: np.ndarray, size: np.ndarray, tau: np.ndarray, pin: int | None, limit: np.ndarray,
) -> np.ndarray:
    """Closed-form cost of a micro-batch of ``size`` samples cut into its best q slices.

    Each stage runs the q slices (``q * tau(size / q)``), and the pipeline waits ``fill`` slice
    times for them: ``stages - 1`` when the micro-batch is the only one (its slices both fill
    and drain the pipeline), half of that for one end of several micro-batches (with q = 1 the
    two ends of a plain 1F1B together give its ``(stages - 1) * tau`` bubble). A pinned count
    is taken as is. Arrays of terms: ``tau`` is (terms, q) of one stage's time for ``size / q``
    samples, q = 1, 2, ...; ``limit`` the largest q of each term.
    """
    q = np.arange(1, tau.shape[1] + 1)
    cost = (q[None, :] + fill[:, None]) * tau
    if pin:
        return cost[:, pin - 1]
    allowed = q[None, :] <= np.minimum(limit, size)[:, None]
    return np.where(allowed, cost, np.inf).min(axis=1)


def score_shapes(
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    pins: dict,
    use_all: bool,
    optimizer_factor: float,
    max_slices: int = 1,
) -> list[Shape]:
    """Every allowed (S, R, m) with its closed-form estimate (module docstring), in the order
    S, then R, then m ascending.

    The estimate already counts startup and drain slices: with per-call costs, the best
    micro-batch count with slices is often smaller than without them (fewer, larger
    micro-batches; the ends cut finer), and a shape ranked on plain 1F1B alone would never
    reach the partitioner.
    """
    order = speed_order(cluster, devs)
    specs = [cluster.device(d).spec for d in order]
    nd, n = len(order), costs.num_blocks
    work, big, params, mem, act, mbs = model_figures(costs)
    fixed_all = sum(costs.fixed(0, n))
    speed = np.array([x.speed for x in specs])
    low_cap = np.minimum.accumulate(np.array([x.memory_bytes for x in specs], dtype=float))
    high_ovh = np.maximum.accumulate(np.array([x.overhead_ms for x in specs]))
    low_speed = np.minimum.accumulate(speed)
    rings: dict[int, tuple[list[float], list[float]]] = {}
    pairs = []  # per (S, R): the figures every micro-batch count of the pair shares
    for s, r in stage_replica_pairs(pins, n, nd, batch, use_all):
        if r not in rings:
            hops, xfers = _cut_links(cluster, order, r, act, mbs)
            rings[r] = (np.maximum.accumulate([0.0, *hops]).tolist(),
                        np.maximum.accumulate([0.0, *xfers]).tolist())
        hops, xfers = rings[r]
        chunk = speed[: s * r].reshape(s, r).min(axis=1).tolist()
        sum_sp = sum(chunk)
        ar = allreduce_ms(cluster, order[:r], int(params / s)) if r > 1 else 0.0
        hop, xfer = hops[s - 1], xfers[s - 1]  # the slowest of the first s - 1 cuts
        # perfectly balanced stages, plus half a block of rounding on the slowest stage
        base = max(work / sum_sp + 0.5 * work / n / float(low_speed[s * r - 1]),
                   big / max(chunk))
        fixed = min(fixed_all / sum_sp, base)  # per-call part of base
        pairs.append((s, r, base, fixed, float(high_ovh[s * r - 1]), xfer, hop, ar,
                      float(low_cap[s * r - 1])))
    return _terms(pairs, batch, pins, mbs, max_slices, params, mem, optimizer_factor)


def model_figures(costs: BlockCosts) -> tuple[float, float, float, float, float, int]:
    """The whole model's figures a shape is scored from: its compute time, its largest block's,
    its parameter bytes, its activation memory (shared inputs once), the mean activation
    bytes a cut sends, and the profile's micro-batch size."""
    n = costs.num_blocks
    return (
        costs.compute[-1],
        max(costs.compute[i + 1] - costs.compute[i] for i in range(n)),
        costs.param_bytes((0, n)),
        costs.memory(0, n, 1)[0],
        sum(costs.act[:-1]) / max(1, n - 1),
        costs.micro_batch_size,
    )


def stage_replica_pairs(
    pins: dict, num_blocks: int, num_devices: int, batch: int, use_all: bool
) -> list[tuple[int, int]]:
    """Every allowed (stages ``S``, replicas ``R``), S then R ascending: the pinned counts,
    else every ``S`` up to the blocks and the devices with each ``R`` that divides the batch
    (with ``use_all`` only the one that uses every device)."""
    nd = num_devices
    out = []
    for s in [pins["num_stages"]] if pins["num_stages"] else range(1, min(num_blocks, nd) + 1):
        if pins["replicas"]:
            r_list = [pins["replicas"]]
        elif use_all:
            r_list = [nd // s] if nd % s == 0 else []
        else:
            r_list = sorted({r for r in range(1, nd // s + 1) if batch % r == 0})
        out.extend((s, r) for r in r_list
                   if (s * r == nd if use_all else s * r <= nd) and not batch % r)
    return out


def _cut_links(
    cluster: Cluster, order: list[str], r: int, act: float, mbs: int
) -> tuple[list[float], list[float]]:
    """Per cut ``c`` of a shape with ``r`` replicas (devices ``c r`` and ``(c + 1) r``): the
    fill latency of one hop and the transfer time per sample (the replicas' transfers
    sharing a NIC between servers)."""
    hops, xfers = [], []
    for c in range(len(order) // r - 1):
        a, b = order[c * r], order[(c + 1) * r]
        ms = act / mbs / (cluster.bandwidth_gbps(a, b) * BYTES_PER_MS_PER_GBPS)
        if cluster.device(a).server != cluster.device(b).server:
            ms *= r  # the replicas' transfers share the NIC
        hops.append(cluster.latency_us(a, b) / 1e3 + ms * mbs)
        xfers.append(ms)
    return hops, xfers


def _terms(
    pairs: list[tuple], batch: int, pins: dict, mbs: int, max_slices: int, params: float,
    mem: float, optimizer_factor: float,
) -> list[Shape]:
    """The shapes of every (S, R) pair and allowed micro-batch count, scored as arrays."""
    k_pin, j_pin, m_pin = pins["startup_slices"], pins["drain_slices"], pins["num_microbatches"]
    rows, keys = [], []
    for p, (s, r, *_rest) in enumerate(pairs):
        for m in [m_pin] if m_pin else _divisors(batch // r):
            slices = max(k_pin or 1, (j_pin or 1) if m > 1 else 1)  # one micro-batch: no drain
            if (batch // r) % m or batch // (r * m) < slices:
                continue  # a pinned m, k or j this shape's replica batch cannot hold
            rows.append(p)
            keys.append((s, r, m))
    if not rows:
        return []
    fig = np.array(pairs, dtype=float)[rows]
    s, r, base, fixed, ovh, xfer, hop, ar, cap = fig.T
    m = np.array([k[2] for k in keys], dtype=float)
    size = np.array([batch // (k[1] * k[2]) for k in keys], dtype=float)
    scale = size / mbs
    limit = np.where(s > 1, max_slices, 1)  # one stage has no fill or drain to shorten
    top = max(max_slices, k_pin or 1, j_pin or 1)
    q = np.arange(1, top + 1, dtype=float)
    samples = size[:, None] / q[None, :]
    # one stage's forward + backward of ``samples``: compute- or link-bound (unit_ms at speed 1)
    tau = np.maximum(
        (base - fixed)[:, None] * (samples / mbs) / 1.0 + (fixed / 1.0 + 2 * ovh)[:, None],
        xfer[:, None] * samples,
    )
    one = m == 1
    est = np.where(
        one,
        slice_term(s - 1, size, tau, k_pin, limit),  # one micro-batch: startup slices only
        (m - 2) * tau[:, 0] + (
            slice_term((s - 1) / 2, size, tau, k_pin, limit)
            + slice_term((s - 1) / 2, size, tau, j_pin, limit)
        ),
    )
    est = est + (2 * (s - 1) * hop * scale + ar)
    need = (params / s) * param_state_factor(optimizer_factor) + (mem / s * scale) * np.minimum(
        s, m)
    fits = need <= cap
    return [Shape(k[0], k[1], k[2], e, f, o)
            for k, e, f, o in zip(keys, est.tolist(), fits.tolist(), (need / cap).tolist())]
