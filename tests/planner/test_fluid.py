"""The simulator's fluid links against a naive max-min fair replay, and their event count.

The reference recomputes every flow's rate from scratch at every start and end (progressive
filling over all flows in progress) and steps time to the next of them: slow, obviously
right. ``FluidLinks`` re-rates only the connected flows and keeps only each connected group's
first end in the heap; both must end every flow at the same time.
"""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from lightning_autopipe.planner.fluid import FluidLinks


def _reference(flows: list[tuple[float, float, tuple]], caps: dict) -> list[float]:
    """End time of each (start, bytes, resources) flow under max-min fair sharing."""
    left = {i: b for i, (_, b, _) in enumerate(flows)}
    starts = sorted(range(len(flows)), key=lambda i: flows[i][0])
    active: set[int] = set()
    ends = [0.0] * len(flows)
    t = 0.0
    while starts or active:
        rates: dict[int, float] = {}
        cap = dict(caps)
        todo = set(active)
        while todo:
            share, r0 = min((cap[r] / sum(1 for i in todo if r in flows[i][2]), r)
                            for r in cap if any(r in flows[i][2] for i in todo))
            for i in [i for i in todo if r0 in flows[i][2]]:
                rates[i] = share
                todo.discard(i)
                for r in flows[i][2]:
                    cap[r] -= share
        nxt = flows[starts[0]][0] if starts else float("inf")
        end = min((t + left[i] / rates[i] for i in active), default=float("inf"))
        step = min(nxt, end)
        for i in active:
            left[i] -= rates[i] * (step - t)
        t = step
        for i in [i for i in active if left[i] <= 1e-9 * flows[i][1]]:
            active.discard(i)
            ends[i] = t
        while starts and flows[starts[0]][0] <= t:
            active.add(starts.pop(0))
    return ends


def _fluid(flows: list[tuple[float, float, tuple]], caps: dict) -> tuple[list[float], int]:
    """End time of each flow through ``FluidLinks`` (driven as the simulator drives it) and
    how many completion events it put in the heap."""
    heap: list = []
    tick = itertools.count().__next__
    links = FluidLinks(caps.__getitem__, heap, tick, lambda flow, ver: ("done", flow, ver))
    for i, (start, _, _) in enumerate(flows):
        heapq.heappush(heap, (start, tick(), ("start", i, None)))
    ends = [0.0] * len(flows)
    events = 0
    while heap:
        t, _, (kind, what, ver) = heapq.heappop(heap)
        if kind == "start":
            _, nbytes, res = flows[what]
            links.start(t, nbytes, res, what)
        else:
            events += 1
            if links.finish(what, ver):
                ends[what.payload] = t
        if links.pending and (not heap or heap[0][0] > t):
            links.settle(t)
    return ends, events


@pytest.mark.parametrize("seed", range(40))
def test_every_flow_ends_when_a_naive_max_min_replay_ends_it(seed):
    rng = random.Random(seed)
    caps = {r: rng.choice([1.0, 2.0, 5.0, 10.0]) for r in "ABCDE"}
    flows = []
    for _ in range(rng.randint(2, 25)):
        res = tuple(rng.sample(sorted(caps), rng.randint(1, 3)))
        start = rng.choice([0.0, 0.0, rng.uniform(0, 20)])  # ties at 0 and staggered starts
        flows.append((start, rng.choice([5.0, 10.0, rng.uniform(1, 50)]), res))
    got, _ = _fluid(flows, caps)
    assert got == pytest.approx(_reference(flows, caps), rel=1e-9)


def test_many_flows_on_one_link_put_a_linear_number_of_events_in_the_heap():
    """GPipe sends every micro-batch's activations at once: m flows on one link, each start
    and end changing every rate. One event per change, not one per flow per change."""
    m = 300
    flows = [(0.01 * i, 10.0, ("A",)) for i in range(m)]
    got, events = _fluid(flows, {"A": 1.0})
    assert got == pytest.approx(_reference(flows, {"A": 1.0}), rel=1e-9)
    assert events <= 3 * m
