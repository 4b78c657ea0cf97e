"""Every cost formula of the planner, written once: compute units, all-reduce rings, memory.

The simulator, the fast model, the partitioner, the shape search and the yardsticks all price
through these functions, so a change to how something costs is a change in one place:

* **A compute action** (forward or backward of one unit on one device): the profiled blocks'
  time at ``ratio`` = samples / ``Profile.micro_batch_size``, its fixed part paid once per
  call (:func:`~lightning_autopipe.profile.affine_ms`), over the device's relative speed, plus
  the device's ``overhead_ms`` per action (:func:`unit_parts`, :func:`unit_ms`). The profile is
  the device type's own when the cluster gives it one (speed 1), else the reference profile
  (:func:`device_profile`).
* **A ring all-reduce** of ``nbytes`` over ``n`` devices: ``2 (n-1)/n * nbytes`` cross every
  ring edge (:func:`ring_volume`), each of the ``2 (n-1)`` steps pays one hop's latency
  (:func:`ring_latency_ms`), and the reduction itself adds :func:`reduce_ms_per_byte` per
  gradient byte, sharing no link (:func:`allreduce_ms` puts them together on a cluster).
  Under contention (rings and transfers that share a NIC or a PCIe level), the fast model's
  :func:`~.allreduce.allreduce_finish` and the simulator's fluid flows split bandwidth; the
  volume, the latency and the reduction term still come from here.
* **Peak memory of a stage**: parameter bytes x (weights + gradients + ``optimizer_factor``)
  plus the activation memory of the micro-batches it holds in flight
  (:func:`peak_memory_bytes`), a stage's activation memory being :func:`stage_memory` of its
  blocks (a storage two blocks save counted once), for the simulator and every fast model.
* **A stage's unit prices** (forward, backward, or input and weight backward when split; the
  first stage's W is its whole backward; a recomputing stage's backward pays the forward again):
  :func:`unit_prices`, the one place the fast model and the simulator take them from.
* **Activation recomputation** of a stage (chosen only when nothing fits otherwise): each unit
  in flight holds only the stage's inputs and one micro-batch's activations live again while
  its backward runs, the inputs among them counted once (:func:`recompute_memory`); its time
  is in :func:`unit_prices`.

Pure functions over numbers and a :class:`~lightning_autopipe.cluster.Cluster`; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster, DeviceSpec
from lightning_autopipe.errors import ClusterError
from lightning_autopipe.profile import Profile

__all__ = [
    "allreduce_ms",
    "contended_gbps",
    "device_profile",
    "param_state_factor",
    "peak_memory_bytes",
    "recompute_memory",
    "reduce_ms_per_byte",
    "stage_memory",
    "replica_pairs",
    "ring_costs",
    "ring_latency_ms",
    "ring_resources",
    "ring_volume",
    "type_profiles",
    "unit_ms",
    "unit_parts",
    "unit_prices",
]


# ---------------------------------------------------------------------------- compute
def unit_parts(
    ms: float, fixed_ms: float, ratio: float, speed: float, overhead_ms: float = 0.0
) -> tuple[float, float]:
    """A compute action as (the part that scales with its samples, the part paid per call).

    ``ms`` / ``fixed_ms`` are the blocks' profiled time and its fixed part at the profile's
    micro-batch size, ``ratio`` the action's samples over that size. The action costs the sum
    (:func:`unit_ms`); a unit that is a fraction ``f`` of a ``ratio``-sized micro-batch costs
    ``f`` times the first part plus the second, which is how the fast model prices slices.
    """
    return (ms - fixed_ms) * ratio / speed, fixed_ms / speed + overhead_ms


def unit_ms(
    ms: float, fixed_ms: float, ratio: float, speed: float, overhead_ms: float = 0.0
) -> float:
    """Time of one compute action (see :func:`unit_parts`)."""
    scaled, per_call = unit_parts(ms, fixed_ms, ratio, speed, overhead_ms)
    return scaled + per_call


def device_profile(spec: DeviceSpec, profile: Profile) -> tuple[Profile, float]:
    """The profile that prices blocks on a device of ``spec`` and the speed to divide by."""
    if spec.profile is not None:
        return spec.profile, 1.0
    return profile, spec.speed


def type_profiles(profile: Profile, cluster: Cluster) -> dict[str, Profile]:
    """The device types of ``cluster`` with their own profile, checked against ``profile``.

    Raises:
        ClusterError: a type's profile describes other blocks (another model or granularity).
    """
    out: dict[str, Profile] = {}
    for d in cluster.devices:
        own = d.spec.profile
        if own is None or d.spec.name in out:
            continue
        if own.names != profile.names:
            first = next((i for i, (a, b) in enumerate(zip(own.names, profile.names)) if a != b),
                         min(len(own.names), len(profile.names)))
            differ = (f"block {first} is {own.names[first]!r} there and "
                      f"{profile.names[first]!r} here"
                      if first < min(len(own.names), len(profile.names)) else
                      f"{len(own.names)} blocks there, {len(profile.names)} here")
            raise ClusterError(
                f"device type {d.spec.name!r} of cluster {cluster.name!r} has a profile of "
                f"other blocks than the model being planned ({own.model!r} vs "
                f"{profile.model!r}: {differ}); profile the device type again for this model "
                "and granularity, or drop its profile to price it by its speed"
            )
        if own.fingerprint and profile.fingerprint and own.fingerprint != profile.fingerprint:
            raise ClusterError(
                f"device type {d.spec.name!r} was profiled on a model with fingerprint "
                f"{own.fingerprint}, not {profile.fingerprint}; profile it again for this model"
            )
        out[d.spec.name] = own
    return out


# ---------------------------------------------------------------------------- all-reduce
def ring_volume(n: int, nbytes: float) -> float:
    """Bytes a ring all-reduce of ``nbytes`` over ``n`` members moves across each edge."""
    return 2 * (n - 1) / n * nbytes


def ring_latency_ms(n: int, hop_latency_ms: float) -> float:
    """Latency of a ring all-reduce over ``n`` members: ``2 (n - 1)`` steps of one hop each."""
    return 2 * (n - 1) * hop_latency_ms


def reduce_ms_per_byte(cluster: Cluster, devices: list[str]) -> float:
    """The reduction's own time per gradient byte of a ring all-reduce over ``devices``.

    Each member reduces ``(n-1)/n`` of the bytes (its share of the reduce-scatter), all at
    once, so the slowest member's ``reduce_gbps`` sets the pace; it does not share links, so it
    adds to the transfers rather than contending with them. 0 for one device or when every
    device reduces for free.
    """
    n = len(devices)
    if n <= 1:
        return 0.0
    rate = min(cluster.device(d).spec.reduce_gbps for d in devices)
    return (n - 1) / n / (rate * BYTES_PER_MS_PER_GBPS)


def _ring_edges(cluster: Cluster, devices: list[str]) -> list[tuple[str, str]]:
    ring = cluster.ring_order(list(devices))
    n = len(ring)
    return [(ring[i], ring[(i + 1) % n]) for i in range(n)] if n > 1 else []


def allreduce_ms(cluster: Cluster, devices: list[str], nbytes: float) -> float:
    """Uncontended ring all-reduce of ``nbytes`` over ``devices`` (ring in rank order).

    The slowest edge sets the pace of the volume and its latency is paid at every step.
    """
    edges = _ring_edges(cluster, devices)
    n = len(edges)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = min(cluster.bandwidth_gbps(a, b) for a, b in edges)
    lat = max(cluster.latency_us(a, b) for a, b in edges)
    return (
        ring_volume(n, nbytes) / (bw * BYTES_PER_MS_PER_GBPS)
        + ring_latency_ms(n, lat / 1e3)
        + nbytes * reduce_ms_per_byte(cluster, [a for a, _ in edges])
    )


# ---------------------------------------------------------------------------- memory
def param_state_factor(optimizer_factor: float) -> float:
    """Bytes held per parameter byte: the weights, their gradients and the optimizer state."""
    return 2.0 + optimizer_factor


def peak_memory_bytes(
    param_bytes: Any, activation_bytes: Any, inflight: Any, optimizer_factor: float,
    once_bytes: Any = 0.0,
) -> Any:
    """A stage's peak: parameter state plus ``inflight`` micro-batches of activation memory.

    ``activation_bytes`` is the memory one micro-batch holds for its backward on the stage;
    ``inflight`` the most micro-batches (fractions for slices) held at once under the
    schedule (or, with ``inflight`` 1, :func:`activation_peak`); ``once_bytes`` what is held
    once on top (a recomputing stage's backward, see :func:`recompute_memory`). Works on
    numbers and on numpy arrays alike.
    """
    return (param_bytes * param_state_factor(optimizer_factor) + activation_bytes * inflight
            + once_bytes)


def activation_peak(activation_bytes: float, loss_bytes: float,
                    pairs: Sequence[tuple[float, float]]) -> float:
    """The most activation bytes a stage holds at once: each unit holds ``activation_bytes``
    (per micro-batch) from its forward, of which ``loss_bytes`` (what the loss saves,
    ``BlockProfile.loss_bytes``) until its backward's B and the rest until its release (W
    under a split backward); ``pairs`` are the stage's in-flight counts of the two
    (:func:`~.compiled.pairs_of`), the peak lies at one of them."""
    if not loss_bytes:  # the first pair holds the most units until the release
        return activation_bytes * pairs[0][0]
    rest = activation_bytes - loss_bytes
    return max(rest * a + loss_bytes * b for a, b in pairs)


def stage_memory(mem: Any, shared: Any, i: Any, j: Any, num_microbatches: int) -> tuple[Any, Any]:
    """Activation memory of the stage of blocks ``[i, j)`` at the profile's micro-batch:
    (what one micro-batch in flight holds, what the stage holds once).

    ``mem`` and ``shared`` are prefix sums of the blocks' ``memory_bytes`` and
    ``shared_input_bytes`` (``shared`` may be empty: nothing shared). A storage that two
    consecutive blocks both save is one storage: a block after the stage's first counts
    without its shared inputs. The first stage's saved inputs are slices of the replica's
    batch (the data loader's tensor): they are held once, ``num_microbatches`` micro-batches'
    worth, not per unit in flight. What the profiler measures per block and the memory meter
    checks (``docs/telemetry.md``). Works on block indices and on numpy arrays of them alike.
    """
    if len(shared) == 0:
        return mem[j] - mem[i], 0 * (mem[j] - mem[i])
    held = mem[j] - mem[i] - (shared[j] - shared[i + 1])
    first = (i == 0) * shared[1]  # block 0's own shared inputs: the batch, held once
    return held - first, first * num_microbatches


def recompute_memory(
    memory_bytes: Any, input_bytes: Any, kept_bytes: Any = 0
) -> tuple[Any, Any]:
    """A stage that recomputes its activations: (bytes one unit holds in flight, bytes held
    once).

    A unit in flight keeps only the stage's ``input_bytes`` (the boundary tensors it
    received); while one backward runs, one micro-batch's ``memory_bytes`` live again, less
    ``kept_bytes``: the part of them that is the stage's inputs as its first block saves
    them (that block's ``shared_input_bytes``), storages the unit holds already and the
    recomputation saves again, one storage counted once as the memory meter counts it. Its
    time is :func:`unit_prices` with ``recompute``. For schedules whose backward is not
    split: a split one would hold the recomputed activations until each weight backward.
    """
    return input_bytes, memory_bytes - kept_bytes


# ---------------------------------------------------------------------------- unit prices
def unit_prices(
    forward: tuple[float, float],
    backward: tuple[float, float],
    split_parts: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
    *,
    first: bool = False,
    split: bool = False,
    recompute: bool = False,
) -> list[tuple[float, float]]:
    """A stage's compute per action kind, each ``(ms, fixed ms)`` at the profile's
    micro-batch: ``[F, B]``, or ``[F, B, W]`` when the schedule splits the backward.

    The fast model and the simulator both price a stage's units from this (then
    :func:`unit_parts` / :func:`unit_ms` scale them to a unit's samples and the device):

    * ``forward`` and ``backward`` are the stage's summed (ms, fixed ms); ``split_parts`` its
      split backward (input ms, weight ms, input fixed, weight fixed:
      :meth:`~lightning_autopipe.profile.BlockProfile.split_backward` summed);
    * split, B is the input gradient and W the weight gradient, except on the ``first``
      stage, which has no input gradient to send: its B is empty and its W is the whole
      backward, as the executor runs it;
    * a stage that recomputes its activations (``recompute``; never with a split backward)
      runs the forward again before its backward: the backward costs both (its fixed part
      too, since the recomputed forward is a whole forward of the unit).
    """
    if recompute:
        backward = (backward[0] + forward[0], backward[1] + forward[1])
    if not split:
        return [forward, backward]
    if first:
        return [forward, (0.0, 0.0), backward]
    b_in, b_wt, fix_in, fix_wt = split_parts
    return [forward, (b_in, fix_in), (b_wt, fix_wt)]


# ---------------------------------------------------------------------------- links (fast model)
def replica_pairs(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    """Which replica of stage ``s`` talks to which of ``s + 1``: by index, wrapping around."""
    n = max(len(a), len(b))
    return [(a[i * len(a) // n], b[i * len(b) // n]) for i in range(n)]


def contended_gbps(cluster: Cluster, pairs: list[tuple[str, str]]) -> float:
    """Bandwidth of the slowest of ``pairs`` when all transfer at once over shared links."""
    cache = _memo(cluster, "contended")
    key = tuple(pairs)
    got = cache.get(key)
    if got is not None:
        return got
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
    cache[key] = worst
    return worst


def _memo(cluster: Cluster, what: str) -> dict:
    """A cache of link figures kept on ``cluster`` (the mapper builds dozens of layouts over
    the same device groups; a cluster's links never change once it is built)."""
    return cluster.__dict__.setdefault("_planner_memo", {}).setdefault(what, {})


def _ring(
    cluster: Cluster, group: list[str]
) -> tuple[list[tuple[str, str]], list[tuple], list[float], list[float]]:
    """The ring of ``group``: its edges and each edge's resources, Gb/s and latency (us)."""
    cache = _memo(cluster, "rings")
    key = tuple(group)
    got = cache.get(key)
    if got is None:
        edges = _ring_edges(cluster, list(group))
        links = [cluster._link(a, b) for a, b in edges]
        got = cache[key] = (edges, [x[2] for x in links], [x[0] for x in links],
                            [x[1] for x in links])
    return got


def ring_costs(
    cluster: Cluster, groups: list[list[str]], contended: bool = True
) -> tuple[list[float], list[float]]:
    """Per group: ring all-reduce (latency ms, ms per parameter byte on the links).

    The stages' all-reduces run at the end of the step, close together; rings whose edges
    share a NIC or a PCIe level split its bandwidth, which decides between keeping a stage's
    replicas in one server and spreading them.
    """
    rings = [_ring(cluster, g) for g in groups]
    use: dict[tuple, int] = {}
    for _, res, _, _ in rings if contended else ():
        for rs in res:
            for r in rs:
                use[r] = use.get(r, 0) + 1
    lat, per_byte = [], []
    for edges, res, gbps, lats in rings:
        n = len(edges)
        if n < 2:
            lat.append(0.0)
            per_byte.append(0.0)
            continue
        bw = float("inf")
        for rs, e in zip(res, gbps):
            for r in rs if contended else ():
                e = min(e, cluster.resource_gbps(r) / use[r])
            bw = min(bw, e)
        lat.append(ring_latency_ms(n, max(lats) / 1e3))
        per_byte.append(ring_volume(n, 1.0) / (bw * BYTES_PER_MS_PER_GBPS))
    return lat, per_byte


def ring_resources(
    cluster: Cluster, groups: list[list[str]]
) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], tuple[float, ...]]:
    """Per group, the shared-link resources (as indices) each edge of its all-reduce ring uses."""
    index: dict[tuple, int] = {}
    caps: list[float] = []
    rings = []
    for g in groups:
        edges = []
        ring_edges, ring_res, _, _ = _ring(cluster, g)
        for (a, b), res in zip(ring_edges, ring_res):
            ids = []
            for r in res:
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
