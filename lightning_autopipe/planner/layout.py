"""What the fast model prices from: block cost prefix sums and a layout's per-stage numbers.

:class:`BlockCosts` turns a profile (and the cluster's per-type profiles) into prefix sums, so
any stage's cost is two lookups; :class:`Layout` reduces the devices of each stage to the
speed, memory, overhead and link figures the replay needs, independent of the cuts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.planner.pricing import (
    contended_gbps,
    reduce_ms_per_byte,
    replica_pairs,
    ring_costs,
    ring_resources,
    stage_memory,
    type_profiles,
)
from lightning_autopipe.profile import Profile

__all__ = ["BlockCosts", "Layout", "shared_param_bytes", "weights_shared_within"]


def shared_param_bytes(ties: Sequence[tuple[int, int, int]],
                       ranges: Sequence[tuple[int, int]]) -> int:
    """Of the parameter bytes of the blocks in ``ranges`` (a stage's ``(i, j)``, or a rank's
    chunks) summed block by block, what is counted twice: each tie ``(block, earlier block,
    bytes)`` (``BlockProfile.tied_to``) whose block is there and whose earlier block, or one
    before it along the ties (a module used in several places names its previous use), is
    there too: the device holds those parameters once."""
    def held(k: int) -> bool:
        return any(i <= k < j for i, j in ranges)

    if not ties:
        return 0
    earlier = {b: (to, n) for b, to, n in ties}
    low = min(i for i, _ in ranges)
    total = 0
    for b, to, n in ties:
        if not held(b):
            continue
        while to >= low and not held(to):  # along the ties, while a range may still come
            to, more = earlier.get(to, (-1, 0))
            n = min(n, more)
        if to >= low:
            total += n
    return total


def weights_shared_within(ties: Sequence[tuple[int, int, int]], i: int, j: int) -> bool:
    """Whether two of blocks ``[i, j)`` share parameters (``ties``: ``BlockProfile.tied_to``;
    a module applied twice in one stage, as ALBERT applies its layer). The runtime runs such
    a stage's split backward whole in ``B`` (torch's split cannot resume its ``W``:
    ``runtime/backward.py``, ``weights_reached_twice``), so its ``B`` costs the whole backward,
    its ``W`` nothing, and ``B`` frees all it saved (:meth:`BlockCosts.split`,
    :meth:`BlockCosts.loss_share`, ``simdata.stage_costs``)."""
    return any(i <= to and b < j for b, to, _ in ties)  # a tie names an earlier block


@dataclass(frozen=True)
class BlockCosts:
    """Prefix sums of a Profile's per-block costs: any stage's cost is two lookups.

    ``types`` holds the same sums for every device type of the cluster that has its own
    profile (:func:`~.pricing.type_profiles`): a stage on such a device is priced from them at
    speed 1 (:meth:`typed`), any other from these over the device's speed. Bytes (parameters,
    activations, memory) are the reference profile's: the model is the same on every device.
    """

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    params: tuple[int, ...]
    mem: tuple[int, ...]
    act: tuple[int, ...]  # activation_bytes of each block (what crosses a cut after it)
    micro_batch_size: int
    shared: tuple[int, ...] = ()  # prefix sums of shared_input_bytes (see stage_memory)
    ffix: tuple[float, ...] = ()  # prefix sums of forward_fixed_ms (empty: all zero)
    bfix: tuple[float, ...] = ()  # prefix sums of backward_fixed_ms
    # a split backward (zero-bubble): prefix sums of its input and weight parts and their fixed
    # parts (BlockProfile.split_backward)
    bin: tuple[float, ...] = ()
    bwt: tuple[float, ...] = ()
    bfix_in: tuple[float, ...] = ()
    bfix_wt: tuple[float, ...] = ()
    loss: tuple[int, ...] = ()  # prefix sums of loss_bytes (empty: none)
    # (block, the earlier block it shares parameters with, their bytes): BlockProfile.tied_to
    ties: tuple[tuple[int, int, int], ...] = ()
    types: Mapping[str, BlockCosts] = field(default_factory=dict, compare=False)

    @classmethod
    def from_profile(cls, profile: Profile, cluster: Cluster | None = None) -> BlockCosts:
        """The reference ``profile``'s sums, with those of ``cluster``'s profiled device types.

        Raises:
            ClusterError: a device type's profile does not describe the same blocks.
        """
        types = type_profiles(profile, cluster) if cluster is not None else {}
        own = {name: cls._sums(p) for name, p in types.items()}
        return replace(cls._sums(profile), types=own)

    @classmethod
    def _sums(cls, profile: Profile) -> BlockCosts:
        b = profile.blocks
        return cls(
            fwd=tuple(accumulate((x.forward_ms for x in b), initial=0.0)),
            bwd=tuple(accumulate((x.backward_ms for x in b), initial=0.0)),
            params=tuple(accumulate((x.param_bytes for x in b), initial=0)),
            mem=tuple(accumulate((x.memory_bytes for x in b), initial=0)),
            act=tuple(x.activation_bytes for x in b),
            micro_batch_size=profile.micro_batch_size,
            shared=tuple(accumulate((x.shared_input_bytes for x in b), initial=0)),
            ffix=tuple(accumulate((x.forward_fixed_ms for x in b), initial=0.0)),
            bfix=tuple(accumulate((x.backward_fixed_ms for x in b), initial=0.0)),
            loss=(tuple(accumulate((x.loss_bytes for x in b), initial=0))
                  if any(x.loss_bytes for x in b) else ()),
            ties=tuple((i, x.tied_to, x.tied_bytes) for i, x in enumerate(b) if x.tied_bytes),
            **{name: tuple(accumulate((x.split_backward()[i] for x in b), initial=0.0))
               for i, name in enumerate(("bin", "bwt", "bfix_in", "bfix_wt"))},
        )

    def fixed(self, i: int, j: int) -> tuple[float, float]:
        """Forward and backward ms of blocks ``[i, j)`` that do not scale with samples."""
        if not self.ffix:
            return 0.0, 0.0
        return self.ffix[j] - self.ffix[i], self.bfix[j] - self.bfix[i]

    def memory(self, i: int, j: int, num_microbatches: int) -> tuple[int, int]:
        """Blocks ``[i, j)``'s activation memory per micro-batch in flight and held once, at
        the profile's micro-batch (:func:`~.pricing.stage_memory`)."""
        return stage_memory(self.mem, self.shared, i, j, num_microbatches)

    def param_bytes(self, *ranges: tuple[int, int]) -> int:
        """The parameter bytes of the blocks of ``ranges`` (a stage's ``(i, j)``, or a rank's
        chunks), a parameter that two of them use (a tied head and embedding) counted once,
        as the device holds it."""
        if len(ranges) == 1 and not self.ties:  # the partitioner's common case, kept short
            i, j = ranges[0]
            return self.params[j] - self.params[i]
        return (sum(self.params[j] - self.params[i] for i, j in ranges)
                - shared_param_bytes(self.ties, ranges))

    def loss_share(self, i: int, j: int) -> int:
        """Of blocks ``[i, j)``'s memory per micro-batch, what a split backward's ``B`` frees:
        what only the loss saves, or all of it where the blocks share weights."""
        if self.ties and weights_shared_within(self.ties, i, j):
            return self.memory(i, j, 1)[0]
        return self.loss[j] - self.loss[i] if self.loss else 0

    def split(self, i: int, j: int) -> tuple[float, float, float, float]:
        """Blocks ``[i, j)``'s split backward: (input ms, weight ms, their fixed parts); where
        the blocks share weights, the whole backward as the input part."""
        if self.ties and weights_shared_within(self.ties, i, j):
            return self.bwd[j] - self.bwd[i], 0.0, self.fixed(i, j)[1], 0.0
        return (self.bin[j] - self.bin[i], self.bwt[j] - self.bwt[i],
                self.bfix_in[j] - self.bfix_in[i], self.bfix_wt[j] - self.bfix_wt[i])

    @property
    def num_blocks(self) -> int:
        return len(self.act)

    @functools.cached_property
    def compute(self) -> list[float]:
        """Prefix sums of forward + backward time."""
        return [f + b for f, b in zip(self.fwd, self.bwd)]

    def typed(self, key: str | None) -> BlockCosts:
        """The sums that price a stage whose layout key is ``key`` (None: the reference)."""
        return self if key is None else self.types[key]

    def stage_work(self, layout: Layout) -> list[list[float]] | None:
        """Per-stage compute prefix sums for the partitioner, or None when every stage is
        priced from the reference profile (the partitioner then divides by the speeds).

        A device type's own profile may be measured at another micro-batch size than the
        reference: its sums are restated at the reference's (fixed parts kept, the rest
        scaled by samples), so that the stages' work is compared for the same samples.
        """
        if all(k is None for k in layout.keys):
            return None
        return [self._work_at(self.typed(k), self.micro_batch_size) for k in layout.keys]

    @staticmethod
    def _work_at(costs: BlockCosts, micro_batch_size: int) -> list[float]:
        if costs.micro_batch_size == micro_batch_size:
            return costs.compute
        ratio = micro_batch_size / costs.micro_batch_size
        fixed = ([f + b for f, b in zip(costs.ffix, costs.bfix)] if costs.ffix
                 else [0.0] * len(costs.compute))
        return [x + (c - x) * ratio for x, c in zip(fixed, costs.compute)]


@dataclass(frozen=True)
class Layout:
    """Where each stage runs, reduced to the numbers the cost model needs (cut-independent)."""

    groups: tuple[tuple[str, ...], ...]
    speeds: tuple[float, ...]
    capacity: tuple[int, ...]
    overhead_ms: tuple[float, ...]
    link_lat_ms: tuple[float, ...]  # cut s: stage s <-> s + 1
    link_ms_per_byte: tuple[float, ...]
    ar_lat_ms: tuple[float, ...]
    ar_ms_per_byte: tuple[float, ...]  # uncontended ring, links only
    optimistic: bool = False  # a lower bound of simulate(): no link queues, fastest replicas
    ar_rings: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per stage: resources of each edge
    ar_caps: tuple[float, ...] = ()  # bytes per ms of each resource
    ar_reduce_ms_per_byte: tuple[float, ...] = ()  # per stage: the reduction's own work
    keys: tuple[str | None, ...] = ()  # per stage: the device type whose profile prices it

    def __post_init__(self) -> None:
        if not self.keys:
            object.__setattr__(self, "keys", (None,) * len(self.groups))

    @property
    def num_stages(self) -> int:
        return len(self.groups)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.groups)

    def signature(self) -> tuple:
        """Everything but the device names: layouts with equal signatures cost the same."""
        return (self.replicas, self.speeds, self.keys, self.capacity, self.overhead_ms,
                self.link_lat_ms, self.link_ms_per_byte, self.ar_lat_ms, self.ar_ms_per_byte,
                self.ar_reduce_ms_per_byte)

    @classmethod
    def from_cluster(
        cls, cluster: Cluster, groups: list[list[str]], *, optimistic: bool = False
    ) -> Layout:
        """Reduce ``groups`` (devices of each stage, in pipeline order) to cost-model numbers.

        A stage is priced on its slowest replica (by ``speed``): from that device type's own
        profile when it has one (``keys``, speed 1), else from the reference over its speed.
        With ``optimistic=True`` every stage runs on its fastest replica over its fastest links
        without contention: the result is a lower bound of :func:`simulate` (all event times of
        a replay are monotone in the durations), which the exact search prunes with.
        """
        devs = [[cluster.device(n) for n in g] for g in groups]
        lat, per_byte = [], []
        for a, b in zip(groups, groups[1:]):
            pairs = replica_pairs(list(a), list(b))
            if optimistic:
                lat.append(min(cluster.latency_us(x, y) for x, y in pairs) / 1e3)
                bw = max(cluster.bandwidth_gbps(x, y) for x, y in pairs)
            else:
                lat.append(max(cluster.latency_us(x, y) for x, y in pairs) / 1e3)
                bw = contended_gbps(cluster, pairs)
            per_byte.append(1.0 / (bw * BYTES_PER_MS_PER_GBPS))
        lists = [list(g) for g in groups]
        ar_lat, ar_pb = ring_costs(cluster, lists, contended=False)
        rings, caps = ring_resources(cluster, lists)
        pick = max if optimistic else min
        reps = [pick((d.spec for d in g), key=lambda spec: spec.speed) for g in devs]
        return cls(
            groups=tuple(tuple(g) for g in groups),
            speeds=tuple(1.0 if r.profile is not None else r.speed for r in reps),
            keys=tuple(r.name if r.profile is not None else None for r in reps),
            capacity=tuple(min(d.spec.memory_bytes for d in g) for g in devs),
            overhead_ms=tuple(
                (min if optimistic else max)(d.spec.overhead_ms for d in g) for g in devs
            ),
            link_lat_ms=tuple(lat),
            link_ms_per_byte=tuple(per_byte),
            ar_lat_ms=tuple(ar_lat),
            ar_ms_per_byte=tuple(ar_pb),
            optimistic=optimistic,
            ar_rings=rings,
            ar_caps=caps,
            ar_reduce_ms_per_byte=tuple(reduce_ms_per_byte(cluster, g) for g in lists),
        )
