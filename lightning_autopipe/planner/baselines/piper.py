"""Piper's planner (Tarnawski et al., NeurIPS'21), data + pipeline parallelism only.

Piper minimises the time per sample of the bottleneck stage. For a chain of layers its dynamic
program is over suffixes: ``dp[s][i][k]`` is the best bottleneck load for covering layers
``[i, L)`` with ``s`` stages on ``k`` devices, where the first of those stages holds ``s``
micro-batches in flight (1F1B) — that is what the ``s`` dimension is for. A stage ``[i, j)`` with
data-parallel degree ``d`` has load (per training step of ``B`` samples)::

    compute(i, j) * B / d  +  allreduce(params(i, j), d)  +  transfers(i, j) * B / d

and must fit memory: ``params * (weights + grads + optimizer) + activations * micro-batch * s``.
Piper's model knows one device type and one bandwidth (no topology): we give it the median
device speed (with measured per-type profiles, the blockwise median of the devices' block
times) and the median bandwidth from device 0 to the others. Bubbles are not modelled
(Piper optimises steady-state throughput). Devices are assigned in rank order afterwards.

Chains longer than 64 blocks are merged into 64 time-balanced super-blocks first (Piper plans at
layer granularity); the DP is vectorised over (start, end, devices) with numpy.
"""

from __future__ import annotations

import statistics

import numpy as np

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.balance import balanced_cuts
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.pricing import (
    peak_memory_bytes,
    ring_latency_ms,
    ring_volume,
    stage_memory,
)

__all__ = ["piper_proposals", "coarse_boundaries"]

_MAX_UNITS = 64


def coarse_boundaries(costs: BlockCosts, max_units: int) -> list[int]:
    """Block boundaries of at most ``max_units`` time-balanced super-blocks (all if fewer)."""
    n = costs.num_blocks
    if n <= max_units:
        return list(range(n + 1))
    cuts = balanced_cuts(costs.compute, [1.0] * max_units)
    assert cuts is not None
    return cuts


def piper_proposals(
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    m: int,
    num_stages: int | None,
    replicas: int | None,
    uniform: bool,
    use_all: bool,
    optimizer_factor: float = 2.0,
):
    """Piper's plan for ``m`` micro-batches (pinned stages / replicas restrict the DP)."""
    nd = len(devs)
    bnd = coarse_boundaries(costs, _MAX_UNITS)
    L = len(bnd) - 1
    mbs = costs.micro_batch_size
    specs = [cluster.device(d).spec for d in devs]
    speed = statistics.median(x.speed for x in specs)
    cap = min(x.memory_bytes for x in specs)
    bws = [cluster.bandwidth_gbps(devs[0], d) for d in devs[1:]] or [float("inf")]
    per_byte = 1.0 / (statistics.median(bws) * BYTES_PER_MS_PER_GBPS)
    lat = statistics.median([cluster.latency_us(devs[0], d) for d in devs[1:]] or [0.0]) / 1e3

    W = np.array([costs.compute[b] for b in bnd])
    if costs.types:  # measured device types: Piper's one device is the blockwise median one
        per_dev = []
        for x in specs:
            own = costs.types.get(x.name) if x.profile is not None else None
            ref, sp = (own, 1.0) if own is not None else (costs, x.speed)
            per_dev.append([ref.compute[b] / ref.micro_batch_size / sp for b in bnd])
        W = np.median(np.array(per_dev), axis=0) * mbs
        speed = 1.0
    P = np.array([float(costs.params[b]) for b in bnd])
    cut_act = np.array([float(costs.act[b - 1]) if 0 < b < costs.num_blocks else 0.0
                        for b in bnd])
    i_idx, j_idx = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    valid = j_idx > i_idx
    dW = W[None, :] - W[:, None]
    dP = P[None, :] - P[:, None]
    # activation memory of super-blocks [i, j) as the simulator counts it (shared inputs)
    blk = np.array(bnd)
    held, once = stage_memory(np.array(costs.mem, dtype=float),
                              np.array(costs.shared, dtype=float), blk[np.minimum(i_idx, L - 1)],
                              blk[j_idx], m)
    io = cut_act[:, None] + cut_act[None, :]

    if replicas:
        d_opts = [replicas]
    else:
        d_opts = [d for d in range(1, nd + 1) if batch % (m * d) == 0]
    if not d_opts:
        raise PlanError(f"no data-parallel degree divides global batch {batch} into {m} "
                        "micro-batches per replica; change the batch or micro-batch count")
    s_max = num_stages or min(L, nd)
    inf = np.inf
    if num_stages and num_stages > L:
        raise PlanError(f"Piper plans at most {L} stages here (super-blocks); got {num_stages}")
    loads, mems = {}, {}
    for d in d_opts:
        ar = ring_volume(d, dP) * per_byte + ring_latency_ms(d, lat) if d > 1 else 0.0 * dP
        loads[d] = np.where(valid, dW * batch / (mbs * d * speed) + ar
                            + io * 2 * batch / (mbs * d) * per_byte, inf)
        mems[d] = (dP, held * batch / (m * d * mbs), once * batch / (m * d * mbs))
    s_range = [num_stages] if num_stages else range(1, s_max + 1)
    k_range = [nd] if use_all else range(1, nd + 1)
    runs = [[d] for d in d_opts] if uniform and not replicas else [d_opts]
    best = None
    for check_memory in (True, False):  # nothing fits: plan on time alone, make_plan reports
        for opts in runs:
            got = _dp(loads, mems, opts, L, nd + 1, s_max, m, cap, check_memory,
                      optimizer_factor)
            for s in s_range:
                if got[0][s] is None:
                    continue
                for k in k_range:
                    v = got[0][s][0, k]
                    if np.isfinite(v) and (best is None or v < best[0]):
                        best = (v, s, k, got[1])
        if best is not None:
            break
    if best is None:
        raise PlanError(
            f"Piper found no split of {costs.num_blocks} blocks over {nd} devices with the pinned"
            f" stages ({num_stages}) / replicas ({replicas}); relax the pins"
        )
    _, s, k, choice = best
    stages, i = [], 0
    while s > 0:
        d, j = (int(x) for x in choice[s][i, k])
        stages.append((bnd[i], bnd[j], d))
        i, k, s = j, k - d, s - 1
    ranked = sorted(devs, key=lambda n: cluster.device(n).rank)
    groups, pos = [], 0
    for _, _, d in stages:
        groups.append(ranked[pos : pos + d])
        pos += d
    cuts = [a for a, _, _ in stages] + [costs.num_blocks]
    return [Proposal(groups, cuts, m, 1)]


def _dp(loads, mems, d_opts, L, K, s_max, m, cap, check_memory, opt):
    """``dp[s][i, k]`` (best bottleneck) and ``choice[s][i, k] = (d, j)`` for s = 1..s_max."""
    inf = np.inf
    dp: list = [None] * (s_max + 1)
    choice: list = [None] * (s_max + 1)
    prev = np.full((L + 1, K), inf)
    prev[L, 0] = 0.0  # an empty suffix on no devices costs nothing
    for s in range(1, s_max + 1):
        best = np.full((L + 1, K), inf)
        arg = np.zeros((L + 1, K, 2), dtype=np.int64)
        for d in d_opts:
            if d >= K:
                continue
            load = loads[d]
            if check_memory:
                params, act, once = mems[d]
                need = peak_memory_bytes(params, act, min(s, m), opt, once)
                load = np.where(need <= cap, load, inf)  # (i, j)
            shifted = np.full((L + 1, K), inf)
            shifted[:, d:] = prev[:, : K - d]  # shifted[j, k] = prev[j, k - d]
            cand = np.maximum(load[:, :, None], shifted[None, :, :])  # (i, j, k)
            jbest = cand.argmin(axis=1)
            vbest = np.take_along_axis(cand, jbest[:, None, :], axis=1)[:, 0, :]
            better = vbest < best
            best = np.where(better, vbest, best)
            arg[..., 0] = np.where(better, d, arg[..., 0])
            arg[..., 1] = np.where(better, jbest, arg[..., 1])
        dp[s], choice[s], prev = best, arg, best
    return dp, choice
