"""Link contention for the simulator: transfers as fluid flows with max-min fair rates.

Each transfer occupies a few shared resources (a NIC direction, an intra-server uplink; see
:meth:`Cluster.link_resources`). While several transfers share a resource, its bandwidth is
split max-min fairly (progressive filling: the most constrained resource fixes the rate of its
flows, their share is taken out of every other resource they use, repeat). Rates are
re-evaluated whenever a flow starts or ends, but only for the flows connected to it through
shared resources, and only once per time stamp however many flows start at that moment.

Every flow knows when it would end at its current rate (``due``, computed when the rate is
set), but only the flows of a connected group that end first have a completion event in the
heap: the others' rates change before they could end (at that first end, or at a start), so
their events would be stale. With ``m`` flows on one link (GPipe's sends of every micro-batch
at once) that is one event per change instead of ``m``, and the event times are the same.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["Flow", "FluidLinks"]


class Flow:
    """One transfer in progress: bytes left, current rate (bytes/ms) and a payload."""

    __slots__ = ("rem", "rate", "t", "res", "ver", "payload", "due", "queued")

    def __init__(self, nbytes: float, res: tuple, payload: object, now: float) -> None:
        self.rem = nbytes
        self.rate = 0.0
        self.t = now  # when ``rem`` was last brought up to date
        self.res = res
        self.ver = 0  # bumped on every rate change; -1 once finished
        self.payload = payload
        self.due = 0.0  # when it ends at its current rate
        self.queued = -1  # the version whose completion event is in the heap


class FluidLinks:
    """The flows in progress on a set of capacity-limited resources.

    Completion events go into the caller's heap as ``(time, seq, event(flow, version))``;
    one whose version no longer matches ``flow.ver`` is stale and must be ignored (see
    :meth:`finish`).
    """

    def __init__(
        self,
        capacity: Callable[[tuple], float],
        heap: list,
        tick: Callable[[], int],
        event: Callable[[Flow, int], object],
    ) -> None:
        self._capacity = capacity  # bytes per ms of a resource id
        self._heap = heap
        self._tick = tick
        self._event = event
        self._flows: dict[tuple, set[Flow]] = {}
        self._cap: dict[tuple, float] = {}
        self._dirty: list[Flow] = []

    def start(self, now: float, nbytes: float, res: tuple, payload: object) -> None:
        """Begin a transfer of ``nbytes`` (> 0) over resources ``res`` (non-empty)."""
        f = Flow(nbytes, res, payload, now)
        alone = True
        flows, cap = self._flows, self._cap
        for r in res:
            fl = flows.get(r)
            if fl is None:
                fl = flows[r] = set()
                cap[r] = self._capacity(r)
            elif fl:
                alone = False
            fl.add(f)
        if alone:  # nothing to share with (yet): full speed without rebalancing
            f.rate = min(cap[r] for r in res)
            f.ver = f.queued = 1
            f.due = now + nbytes / f.rate
            heapq.heappush(self._heap, (f.due, self._tick(), self._event(f, 1)))
        else:
            self._dirty.append(f)

    def finish(self, flow: Flow, version: int) -> bool:
        """Handle a completion event; False if it is stale (the flow's rate changed since)."""
        if version != flow.ver:
            return False
        for r in flow.res:
            self._flows[r].discard(flow)
        flow.ver = -1
        for r in flow.res:
            self._dirty.extend(self._flows[r])
        return True

    def settle(self, now: float) -> None:
        """Re-rate the flows touched since the last call; call once all events at ``now`` ran."""
        live = [f for f in self._dirty if f.ver >= 0]
        self._dirty.clear()
        if live:
            self._rebalance(now, live)

    @property
    def pending(self) -> bool:
        return bool(self._dirty)

    def _rebalance(self, now: float, seeds: list[Flow]) -> None:
        flows = self._flows
        comp: set[Flow] = set()
        groups: list[list[Flow]] = []  # the connected groups of flows, each on its resources
        rs: set[tuple] = set()
        for seed in seeds:  # every flow connected to the seeds through shared resources
            if seed in comp:
                continue
            comp.add(seed)
            group, stack = [seed], [seed]
            while stack:
                for r in stack.pop().res:
                    if r not in rs:
                        rs.add(r)
                        for g in flows[r]:
                            if g not in comp:
                                comp.add(g)
                                group.append(g)
                                stack.append(g)
            groups.append(group)
        old = {}
        for f in comp:
            f.rem -= f.rate * (now - f.t)
            f.t = now
            old[f] = f.rate
        if len(comp) == 1:
            (f,) = comp
            f.rate = min(self._cap[r] for r in f.res)
        else:  # progressive filling
            cap = {r: self._cap[r] for r in rs}
            cnt = {r: len(flows[r]) for r in rs}
            todo = set(comp)
            while todo:
                share, r0 = min((cap[r] / n, r) for r, n in cnt.items() if n > 0)
                for f in flows[r0]:
                    if f in todo:
                        todo.discard(f)
                        f.rate = share
                        for r in f.res:
                            cap[r] -= share
                            cnt[r] -= 1
        for f in comp:
            if f.rate != old[f]:  # an unchanged rate keeps its due time (and pending event)
                f.ver += 1
                f.due = now + max(f.rem, 0.0) / f.rate
        # each connected group only needs the events of its first ends (module docstring); a
        # group that an ended flow split is reached here through each of its parts' seeds
        heap, tick, event = self._heap, self._tick, self._event
        for group in groups:
            first = min(f.due for f in group)
            for f in group:
                if f.due == first and f.queued != f.ver:
                    f.queued = f.ver
                    heapq.heappush(heap, (f.due, tick(), event(f, f.ver)))
