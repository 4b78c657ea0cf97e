"""DAPPLE's planner (Fan et al., PPoPP'21): stage splits x replication x device policies.

DAPPLE plans for one device type on a hierarchical cluster (machines of GPUs). Its dynamic
program grows the pipeline one stage at a time: from a plan of the first ``j`` layers on ``g``
devices, a new stage ``[j, j')`` is replicated on ``r`` devices chosen by one of three
device-assignment policies, and each (``j'``, devices used) keeps the plan with the lowest
estimated latency:

* **fresh-first** — take GPUs from machines nothing is placed on yet (a stage's replicas share a
  machine: cheap all-reduce);
* **append-first** — take GPUs from machines already in use, the latest first (consecutive stages
  share a machine: cheap activation transfers);
* **scatter-first** — take GPUs evenly from all machines.

The latency estimate (our reading of DAPPLE's model) is built around a *pivot* stage ``Q``, the
one whose steady phase dominates the step::

    T(Q) = sum_{s<Q} (F_s + C_s)                   warm-up: first micro-batch reaches Q
         + M (F_Q + B_Q) + sum_{s>Q} (F_s + B_s + 2 C_{s-1})   steady phase at Q
         + max_{s<=Q} (sum_{s<=s'<Q} (B_s' + C_s') + AR_s)     cool-down + all-reduce

and ``L = max_Q T(Q)`` (the pivot is the maximising stage; without communication this is the
1F1B closed form ``sum (F + B) + (M - 1) max (F + B)``),
with ``F, B`` the profiled times at the stage's per-replica micro-batch (DAPPLE's profile is of
the one device type: speed differences are invisible to it), ``C`` the activation transfer over
the link between the two stages' devices and ``AR`` the ring all-reduce of the stage's
gradients over its devices. Chains longer than 32 blocks are planned over 32 time-balanced
super-blocks (DAPPLE plans at layer granularity); replica counts are those that divide the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.baselines.piper import coarse_boundaries
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.pricing import allreduce_ms, peak_memory_bytes

__all__ = ["dapple_placement", "dapple_proposals", "allocate", "POLICIES"]

POLICIES = ("fresh", "append", "scatter")
_MAX_UNITS = 32


def _servers(cluster: Cluster, devices: Sequence[str]) -> dict[str, list[str]]:
    """Free devices per machine, machines and devices in rank order."""
    out: dict[str, list[str]] = {}
    for n in sorted(devices, key=lambda n: cluster.device(n).rank):
        out.setdefault(cluster.device(n).server, []).append(n)
    return out


def allocate(
    free: dict[str, list[str]],
    size: dict[str, int],
    recent: list[str],
    r: int,
    policy: str,
) -> tuple[list[str], dict[str, list[str]]] | None:
    """Take ``r`` devices by ``policy``; returns (taken, remaining free) or None if too few.

    Args:
        free: free devices per machine (in rank order); not modified.
        size: devices per machine in the whole allocation pool.
        recent: machines used so far, most recent last (append-first prefers the latest).
    """
    if sum(len(v) for v in free.values()) < r:
        return None
    left = {k: list(v) for k, v in free.items()}
    taken: list[str] = []
    if policy == "scatter":
        while len(taken) < r:
            for k in left:
                if left[k] and len(taken) < r:
                    taken.append(left[k].pop(0))
        return taken, left
    fresh = [k for k in left if left[k] and len(left[k]) == size[k]]
    used = [k for k in left if left[k] and len(left[k]) < size[k]]
    if policy == "fresh":
        order = fresh + sorted(used, key=lambda k: -len(left[k]))
    elif policy == "append":
        latest = [k for k in reversed(recent) if k in used]
        latest = list(dict.fromkeys(latest))
        order = latest + [k for k in used if k not in latest] + fresh
    else:
        raise PlanError(f"unknown DAPPLE policy {policy!r}; use one of {POLICIES}")
    for k in order:
        while left[k] and len(taken) < r:
            taken.append(left[k].pop(0))
        if len(taken) == r:
            break
    return taken, left


def dapple_placement(
    cluster: Cluster, devices: Sequence[str], replicas: Sequence[int], policy: str
) -> list[list[str]]:
    """Devices for stages with ``replicas[s]`` replicas each, every stage by ``policy``.

    Raises:
        PlanError: fewer devices than ``sum(replicas)``.
    """
    free = _servers(cluster, devices)
    size = {k: len(v) for k, v in free.items()}
    recent: list[str] = []
    groups = []
    for r in replicas:
        got = allocate(free, size, recent, r, policy)
        if got is None:
            raise PlanError(
                f"stages with replicas {list(replicas)} need {sum(replicas)} devices, "
                f"only {len(devices)} given"
            )
        taken, free = got
        recent += [cluster.device(n).server for n in taken]
        groups.append(taken)
    return groups


def _latency(st: list[tuple[float, float, float, float]], m: int) -> float:
    """DAPPLE's estimate for stages ``(F, B, AR, C_to_next)``: the pivot's latency, maximised.

    For a pivot ``q`` the step is at least ``T(q)`` (module docstring): every stage runs all
    ``m`` micro-batches, and the pivot's ``m`` forward/backward pairs lie between the first
    micro-batch's arrival and the last one's departure. The pivot is the stage maximising it
    (without communication: ``sum (F + B) + (m - 1) max (F + B)``, the 1F1B closed form).
    """
    n = len(st)
    suffix = [0.0] * (n + 1)  # sum_{s >= x} (F_s + B_s + 2 C_{s-1})
    for x in range(n - 1, -1, -1):
        suffix[x] = suffix[x + 1] + st[x][0] + st[x][1] + (2 * st[x - 1][3] if x > 0 else 0.0)
    best = warm = drain = 0.0
    lead = float("-inf")  # max_{s < q} (AR_s - D[s]), D[x] = sum_{s < x} (B_s + C_s)
    for q in range(n):
        f, b, ar, _ = st[q]
        steady = m * (f + b) + suffix[q + 1]
        tail = max(ar, lead + drain)
        best = max(best, warm + steady + tail)
        lead = max(lead, ar - drain)
        warm += f + st[q][3]
        drain += b + st[q][3]
    return best


def dapple_proposals(
    costs: BlockCosts,
    cluster: Cluster,
    devs: list[str],
    batch: int,
    m: int | list[int],
    num_stages: int | None,
    replicas: int | None,
    uniform: bool,
    use_all: bool,
    optimizer_factor: float = 2.0,
):
    """DAPPLE's plan (pins restrict stage count / replica count).

    ``m`` is the micro-batch count, or candidates DAPPLE picks from with its own latency
    estimate (the plan that fits memory with the lowest estimate wins).
    """
    best = None
    for mm in [m] if isinstance(m, int) else m:
        if replicas:
            r_opts = [replicas]
        else:
            r_opts = [r for r in range(1, len(devs) + 1) if batch % (mm * r) == 0]
        runs = [[r] for r in r_opts] if uniform and not replicas else [r_opts]
        for check_memory in (True, False):
            found = None
            for opts in runs:
                got = _dp(costs, cluster, devs, batch, mm, num_stages, opts, use_all,
                          optimizer_factor, check_memory)
                if got is not None and (found is None or got[0] < found[0]):
                    found = got
            if found is not None:
                key = (not check_memory, found[0])
                if best is None or key < best[0]:
                    best = (key, found[1], mm)
                break
    if best is None:
        raise PlanError(
            f"DAPPLE found no plan for {costs.num_blocks} blocks on {len(devs)} devices with "
            f"stages={num_stages}, replicas={replicas}, use_all_devices={use_all}; relax the pins"
        )
    _, stages, mm = best
    cuts = [i for i, _, _ in stages] + [costs.num_blocks]
    return [Proposal([list(g) for _, _, g in stages], cuts, mm, 1)]


def _dp(costs, cluster, devs, batch, m, num_stages, r_opts, use_all, opt, check_memory):
    bnd = coarse_boundaries(costs, _MAX_UNITS)
    L, nd, mbs = len(bnd) - 1, len(devs), costs.micro_batch_size
    if num_stages and num_stages > L:
        return None
    free0 = _servers(cluster, devs)
    size = {k: len(v) for k, v in free0.items()}
    cap = {d: cluster.device(d).spec.memory_bytes for d in devs}
    s_max = num_stages or min(L, nd)
    link = _LinkCache(cluster)
    # state key -> (latency, stages [(start block, end block, group)], st tuples, free, recent)
    states: dict[tuple, tuple] = {(0, 0, 0): (0.0, [], [], free0, [])}
    done = []
    for j in range(L):
        for key in sorted(k for k in states if k[0] == j):
            _, stages, st, free, recent = states[key]
            used, ns = key[1], len(stages)
            if ns >= s_max:
                continue
            for r in r_opts:
                if used + r > nd:
                    continue
                seen = set()
                for pol in POLICIES:
                    got = allocate(free, size, recent, r, pol)
                    if got is None:
                        continue
                    taken, left = got
                    if tuple(taken) in seen:
                        continue
                    seen.add(tuple(taken))
                    own = _own_costs(costs, cluster, taken)
                    scale = batch / (m * r * own.micro_batch_size)
                    a = bnd[j]
                    ar_lat, ar_pb = link.allreduce(taken)
                    head = list(st)
                    if stages:
                        c_lat, c_pb = link.transfer(stages[-1][2], taken)
                        nbytes = costs.act[a - 1] * batch / (m * mbs) / max(len(taken),
                                                                            len(stages[-1][2]))
                        head[-1] = (*head[-1][:3], c_lat + nbytes * c_pb)
                    tk = tuple(taken)
                    servers = recent + [cluster.device(x).server for x in taken]
                    for j2 in range(j + 1, L + 1):
                        b = bnd[j2]
                        fw = (own.fwd[b] - own.fwd[a]) * scale
                        bw = (own.bwd[b] - own.bwd[a]) * scale
                        pb = costs.param_bytes((a, b))
                        ar = ar_lat + pb * ar_pb if r > 1 else 0.0
                        new_st = [*head, (fw, bw, ar, 0.0)]
                        lat = _latency(new_st, m)
                        nk = (j2, used + r, ns + 1 if num_stages else 0)
                        new = (lat, [*stages, (a, b, tk)], new_st, left, servers)
                        if j2 == L:
                            done.append(new)
                        elif nk not in states or lat < states[nk][0]:
                            states[nk] = new
    ok = []
    for lat, stages, _st, _, _ in done:
        n = len(stages)
        if num_stages and n != num_stages:
            continue
        if use_all and sum(len(g) for _, _, g in stages) != nd:
            continue
        if check_memory and not _fits(costs, stages, batch, m, mbs, opt, cap):
            continue
        ok.append((lat, stages))
    return min(ok, key=lambda x: x[0]) if ok else None


def _own_costs(costs: BlockCosts, cluster: Cluster, devices: Sequence[str]) -> BlockCosts:
    """The profile DAPPLE prices a stage on ``devices`` with: the slowest profiled device type
    among them (DAPPLE profiles the hardware it plans for), else the reference profile (speed
    figures without a profile are invisible to it, as in the paper's one-device-type model)."""
    specs = [cluster.device(d).spec for d in devices]
    own = [x for x in specs if x.profile is not None]
    return costs.typed(min(own, key=lambda x: x.speed).name) if own else costs


class _LinkCache:
    """Memoised DAPPLE view of the topology: transfer and ring all-reduce costs per device set."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._t: dict = {}
        self._a: dict = {}

    def transfer(self, src: Sequence[str], dst: Sequence[str]) -> tuple[float, float]:
        """(latency ms, ms per byte) between two stages' device sets (slowest replica pair)."""
        key = (tuple(src), tuple(dst))
        hit = self._t.get(key)
        if hit is None:
            n = max(len(src), len(dst))
            pairs = [(src[i * len(src) // n], dst[i * len(dst) // n]) for i in range(n)]
            bw = min(self.cluster.bandwidth_gbps(a, b) for a, b in pairs)
            lat = max(self.cluster.latency_us(a, b) for a, b in pairs) / 1e3
            hit = self._t[key] = (lat, 1.0 / (bw * BYTES_PER_MS_PER_GBPS))
        return hit

    def allreduce(self, group: Sequence[str]) -> tuple[float, float]:
        """(latency ms, ms per byte) of a ring all-reduce over ``group``."""
        key = tuple(group)
        hit = self._a.get(key)
        if hit is None:
            one = allreduce_ms(self.cluster, list(group), 1)
            big = allreduce_ms(self.cluster, list(group), 1 << 30)
            slope = (big - one) / ((1 << 30) - 1)
            hit = self._a[key] = (max(one - slope, 0.0), slope)
        return hit


def _fits(costs, stages, batch, m, mbs, opt, cap) -> bool:
    n = len(stages)
    for s, (a, b, g) in enumerate(stages):
        scale = batch / (m * len(g) * mbs)
        held, once = costs.memory(a, b, m)
        need = peak_memory_bytes(costs.param_bytes((a, b)), held * scale,
                                 min(n - s, m), opt, once * scale)
        if need > min(cap[d] for d in g):
            return False
    return True
