"""Uneven data-parallel batches: a replica on slower devices trains fewer samples per step.

With even batches every replica waits, each step, for the slowest one at the gradient
all-reduce: two replicas on devices of speeds 1 and 0.5 run at the pace of two slow ones. Giving
each replica samples in proportion to its pipeline's rate lets all of them finish together
(the runtime moves samples between the replicas' loaded batches, so the global batch, and the
training, stay those of even loading).

The rates come from the simulator, not from the devices' nominal speeds: a replica's time is its
busiest device's compute under the plan (its own profile, its speed, its per-call overheads),
so a replica whose slow device holds a light stage is not starved. Its shares are refined by a
few fixed-point rounds (per-call costs do not shrink with the samples), then by moving samples
between the slowest and the fastest replica in halving steps while the simulated step (links,
all-reduce and all) shrinks; the fastest of the candidates the simulator priced, even batches
included, is kept; a candidate whose larger batch no longer fits a device's memory where even
batches fit is skipped, and uneven batches are kept only when they are predicted at least
:data:`MIN_GAIN` faster than even ones.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.simdata import SimResult
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import Profile

__all__ = ["MIN_GAIN", "balance_replicas", "predicted", "share_counts"]

#: fixed-point rounds from the even shares' rates
_ROUNDS = 3
#: candidates priced at most (a simulation each)
_BUDGET = 40
#: the least predicted gain over even batches that uneven ones must bring: the exchange of
#: samples is not priced, and alike ranks timed on a busy machine differ by a few percent
#: (a noise-made split would also change what each replica's BatchNorm normalises over)
MIN_GAIN = 0.03


def predicted(plan: Plan, profile: Profile, cluster: Cluster, optimizer_factor: float = 2.0
              ) -> Plan:
    """``plan`` with the simulator's predictions recorded in it (iteration, bubble, stage
    times, balance, peak memory per device); the plan is updated in place and returned."""
    return _simulated(plan, profile, cluster, optimizer_factor)[0]


def _simulated(plan: Plan, profile: Profile, cluster: Cluster, optimizer_factor: float
               ) -> tuple[Plan, SimResult]:
    res = simulate(plan, profile, cluster, optimizer_bytes_per_param_byte=optimizer_factor)
    for st, ms in zip(plan.stages, res.stage_ms):
        st.stage_ms = ms
    plan.iteration_ms = res.iteration_ms
    plan.bubble_fraction = res.bubble_fraction
    plan.peak_memory_bytes = dict(res.peak_memory_bytes)
    mean = sum(res.stage_ms) / len(res.stage_ms)
    plan.balance = max(res.stage_ms) / mean if mean > 0 else 1.0
    return plan, res


def share_counts(rates: list[float], total: int, least: int) -> list[int]:
    """``total`` samples dealt in proportion to ``rates``, each at least ``least``, by largest
    remainder (ties to the earlier replica).

    Raises:
        ValueError: ``total`` cannot give every replica ``least``.
    """
    n = len(rates)
    if total < n * least:
        raise ValueError(f"{total} samples cannot give {n} replicas {least} each")
    weight = sum(rates)
    exact = [total * r / weight for r in rates]
    counts = [int(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    for i in range(n):  # the floor, taken from the replica with the most
        while counts[i] < least:
            counts[max(range(n), key=counts.__getitem__)] -= 1
            counts[i] += 1
    return counts


def balance_replicas(plan: Plan, profile: Profile, cluster: Cluster,
                     optimizer_factor: float = 2.0) -> Plan:
    """The fastest of ``plan`` (even batches) and the same layout with uneven replica batches
    (see the module docstring); ``plan`` itself when it has one replica or its replicas are
    alike. Each replica keeps at least enough samples to fill its micro-batches and slices, so
    every replica runs the plan's schedule."""
    width = plan.stages[0].replicas
    if width < 2 or any(s.replicas != width for s in plan.stages):
        return plan
    least = plan.num_microbatches * max(plan.startup_slices, plan.drain_slices)
    total = plan.global_batch_size
    if total < width * least:
        return plan
    search = _Search(plan, profile, cluster, optimizer_factor)
    counts = [total // width] * width  # even (the rates' scale)
    res = search.best_res
    for _ in range(_ROUNDS):  # rates from compute: most of the way in a few prices
        times = search.replica_ms(res)
        if min(times) <= 0:
            break
        counts = share_counts([n / t for n, t in zip(counts, times)], total, least)
        if tuple(counts) in search.seen:
            break
        res = search.price(counts)
    # then samples move one way or the other between the slowest and the fastest replica,
    # in halving steps, while the simulated step shrinks: links and per-call costs the rates
    # leave out
    step = max(1, total // (8 * width))
    while step >= 1 and search.priced < _BUDGET:
        base = search.best_counts()
        times = search.replica_ms(search.best_res)
        slow, fast = max(range(width), key=times.__getitem__), min(range(width),
                                                                     key=times.__getitem__)
        improved = False
        for give, take in ((slow, fast), (fast, slow)):
            moved = list(base)
            moved[give] -= step
            moved[take] += step
            if give == take or moved[give] < least or tuple(moved) in search.seen:
                continue
            before = search.best.iteration_ms
            search.price(moved)
            if search.best.iteration_ms < before:
                improved = True
                break
        if not improved:
            step //= 2
    if search.best.iteration_ms > search.even.iteration_ms * (1 - MIN_GAIN):
        return search.even
    return search.best


class _Search:
    """The candidates priced so far and the fastest that fits (even batches first)."""

    def __init__(self, plan: Plan, profile: Profile, cluster: Cluster, optimizer_factor: float
                 ) -> None:
        self.plan, self.profile, self.cluster = plan, profile, cluster
        self.optimizer_factor = optimizer_factor
        self.best, self.best_res = self._simulated([])
        self.even = self.best
        width = plan.stages[0].replicas
        self.seen = {tuple([plan.global_batch_size // width] * width)}
        self.priced = 1

    def _simulated(self, counts: list[int]) -> tuple[Plan, SimResult]:
        stages = [StagePlan(s.blocks, list(s.devices)) for s in self.plan.stages]
        return _simulated(replace(self.plan, stages=stages, replica_batches=list(counts)),
                          self.profile, self.cluster, self.optimizer_factor)

    def price(self, counts: list[int]) -> SimResult:
        """Simulate ``counts``; keep it when it is the fastest that fits."""
        self.seen.add(tuple(counts))
        self.priced += 1
        cand, res = self._simulated(counts)
        if cand.iteration_ms < self.best.iteration_ms and _fits(cand, self.cluster, self.even):
            self.best, self.best_res = cand, res
        return res

    def best_counts(self) -> list[int]:
        width = self.plan.stages[0].replicas
        return list(self.best.replica_batches) or [self.plan.global_batch_size // width] * width

    def replica_ms(self, res: SimResult) -> list[float]:
        """Each replica's busiest device's compute per step."""
        return [max(res.busy_ms[s.devices[i]] for s in self.plan.stages)
                for i in range(self.plan.stages[0].replicas)]


def _fits(candidate: Plan, cluster: Cluster, reference: Plan) -> bool:
    """A candidate fits where the reference did: no device over its memory that was not."""
    for d, b in candidate.peak_memory_bytes.items():
        cap = cluster.device(d).spec.memory_bytes
        if b > cap and reference.peak_memory_bytes.get(d, 0) <= cap:
            return False
    return True
