"""Discover the cluster from the launched ranks: hosts, devices, their own profiles, links.

Without a cluster file the strategy does not assume the launched ranks are alike. Every rank
reports (:class:`RankReport`) its host (``$AUTOPIPE_HOST`` or the hostname, so that two launcher
nodes on one machine can act as two servers), its device (the CUDA name and memory; on the CPU
the processor model, the cores it may run on and its share of the available memory) and the
block profile it measured while every rank profiled at once. :func:`assemble` turns the reports
and the measured links into a :class:`~lightning_autopipe.cluster.Cluster`:

* ranks on one host form a server (launchers number ranks host by host);
* ranks of one device name whose profiles agree form one device type; a rank measurably slower
  than the fastest of its name (``total time > SLOWER x`` theirs: a throttled or shared device,
  another job on its cores) is a type of its own (:func:`slower_ranks`; with ``confirm``
  every rank then profiles once more and reports its faster profile, so that a transient does
  not make a type for the whole run). Each type gets the median profile of its
  ranks and its speed relative to the fastest type, whose profile is the reference the plan is
  made from. With more than one device name each name keeps its own profile, so blocks are
  priced on the device that runs them (an older device is not slower on every block by one
  factor); a slower class of one device name is priced by its measured speed (its slowdown is
  the same for every block, and per-block timings on a shared core are too noisy to say
  otherwise);
* links: inside each server the pairs ``(first, first + d)`` for each level size ``2d`` that
  divides the server (on a GPU server these separate NVLink pairs from PCIe-switch and socket
  pairs; levels that measure alike are merged), and between servers each consecutive pair of
  server leaders: ``log2(n)`` pairs per server plus one per server boundary, not an all-pairs
  sweep, so discovery stays cheap on big jobs. The gradient all-reduce's own reduction is
  measured on the first server (a CPU's gloo sums on the cores that compute).

:func:`discover` runs the collective part; :func:`write_cluster` writes the result as a cluster
YAML with one profile JSON per device type, which a later run can take as ``cluster=<file>``.
Over ~400 lines because the pure assembly (types, link levels, names) and the collective that
feeds it are kept together: the reports' shape is private to both.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_autopipe.cluster import Cluster, DeviceSpec, Level, ServerSpec
from lightning_autopipe.errors import ClusterError
from lightning_autopipe.profile import Profile, median_profile
from lightning_autopipe.runtime import log

__all__ = [
    "HOST_ENV",
    "SLOWER",
    "LinkFigures",
    "RankReport",
    "assemble",
    "compare_with_declared",
    "device_names",
    "discover",
    "gather_reports",
    "host_name",
    "link_pairs",
    "local_report",
    "slower_ranks",
    "write_cluster",
]

#: Environment variable naming this process's host (default: the hostname).
HOST_ENV = "AUTOPIPE_HOST"
#: A rank slower than the fastest of its device name by more than this factor is its own type.
SLOWER = 1.2
#: Measured levels within this factor of each other are one level.
_SAME_LINK = 1.25


@dataclass(frozen=True)
class RankReport:
    """What one rank says about itself (``profile`` is its own measured block profile).

    ``memory_bytes`` is the device's memory, or for a CPU rank the memory available on its host,
    which the host's ranks share (``shared_memory``).
    """

    rank: int
    host: str
    device: str
    memory_bytes: int
    cores: int
    profile: Profile | None = None
    shared_memory: bool = False


@dataclass(frozen=True)
class LinkFigures:
    """A measured link: one message costs ``latency_us`` plus its bytes at ``gbps``."""

    latency_us: float
    gbps: float


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_name() -> str:
    """This process's host: :data:`HOST_ENV` when set, else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def local_report(rank: int, device: torch.device, profile: Profile | None) -> RankReport:
    """This rank's :class:`RankReport`."""
    host = host_name()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return RankReport(rank, host, props.name, int(props.total_memory), 0, profile)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    import psutil

    free = int(psutil.virtual_memory().available)
    return RankReport(rank, host, f"cpu {_cpu_model()}", free, cores, profile, True)


# ---------------------------------------------------------------------------- links
def _level_sizes(n: int) -> list[int]:
    """Nested group sizes for a server of ``n`` devices: powers of two dividing it, then ``n``."""
    sizes, s = [], 2
    while s < n and n % s == 0:
        sizes.append(s)
        s *= 2
    return [*sizes, n] if n > 1 else [1]


def _servers(hosts: Sequence[str]) -> list[tuple[str, list[int]]]:
    """``(host, ranks)`` per server in rank order.

    Raises:
        ClusterError: a host's ranks are not consecutive (devices take ranks server by server).
    """
    out: list[tuple[str, list[int]]] = []
    for rank, host in enumerate(hosts):
        if out and out[-1][0] == host:
            out[-1][1].append(rank)
            continue
        if any(h == host for h, _ in out):
            raise ClusterError(
                f"host {host!r} holds ranks that are not consecutive ({[h for h in hosts]}); "
                "launchers number ranks node by node, so a host's ranks follow each other: "
                f"launch one node per host, or set ${HOST_ENV} per node"
            )
        out.append((host, [rank]))
    return out


def link_pairs(hosts: Sequence[str]) -> list[tuple[int, int]]:
    """The rank pairs :func:`discover` measures (module docstring), in a fixed order."""
    pairs = []
    servers = _servers(hosts)
    for _, ranks in servers:
        prev = 1
        for size in _level_sizes(len(ranks)):
            if size > 1:
                pairs.append((ranks[0], ranks[prev]))
            prev = size
    pairs += [(a[1][0], b[1][0]) for a, b in zip(servers, servers[1:])]
    return pairs


# ---------------------------------------------------------------------------- assembly
def _types(reports: Sequence[RankReport]) -> dict[int, tuple[str, Profile | None, str]]:
    """Rank -> (device type name, the type's median profile, the device name it is a class of);
    the fastest class of a device name keeps the plain name."""
    by_name: dict[tuple[str, int], list[RankReport]] = {}
    for r in reports:
        by_name.setdefault(_type_key(r), []).append(r)
    sizes: dict[str, int] = {}
    for name, _ in by_name:
        sizes[name] = sizes.get(name, 0) + 1
    out: dict[int, tuple[str, Profile | None, str]] = {}
    for (device, gib), group in by_name.items():
        # One device in several memory sizes: each size its own name, or their types would
        # share one label (and one speed).
        name = device if sizes[device] == 1 else f"{device} {gib} GiB"
        if any(r.profile is None for r in group):
            for r in group:
                out[r.rank] = (name, None, name)
            continue
        group = sorted(group, key=lambda r: r.profile.total_ms)  # type: ignore[arg-type]
        clusters: list[list[RankReport]] = []
        for r in group:  # a new type whenever a rank is clearly slower than the type's fastest
            if clusters and r.profile.total_ms <= SLOWER * clusters[-1][0].profile.total_ms:
                clusters[-1].append(r)
            else:
                clusters.append([r])
        # The name's profile is the block-wise median over all its ranks, each scaled to the
        # fastest class's total: slower classes of one device differ by a factor (module
        # docstring), so every rank's timings inform the blocks' shares and the noise of single
        # block timings averages out.
        base_total = statistics.median(m.profile.total_ms for m in clusters[0])  # type: ignore
        base = median_profile([_scaled(r.profile, base_total / r.profile.total_ms)  # type: ignore
                               for r in group])
        for i, members in enumerate(clusters):
            total = statistics.median(m.profile.total_ms for m in members)  # type: ignore
            prof = _scaled(base, total / base_total)
            label = name if i == 0 else f"{name} (slower {i})"
            for m in members:
                out[m.rank] = (label, prof, name)
    return out


def slower_ranks(reports: Sequence[RankReport]) -> list[int]:
    """The ranks that :func:`assemble` makes a slower type of their device name (measurably
    slower than its fastest ranks), typed as it types them."""
    types = _types(_per_device_memory(reports))
    return sorted(rank for rank, (label, _, name) in types.items() if label != name)


def _per_device_memory(reports: Sequence[RankReport]) -> list[RankReport]:
    """``reports`` in rank order, a host's shared memory divided among its ranks."""
    reports = sorted(reports, key=lambda r: r.rank)
    per_host: dict[str, int] = {}
    for r in reports:
        per_host[r.host] = per_host.get(r.host, 0) + 1
    return [replace(r, memory_bytes=r.memory_bytes // per_host[r.host]) if r.shared_memory
            else r for r in reports]


def _type_key(r: RankReport) -> tuple[str, int]:
    """The (device name, memory GiB) a rank's type is sought within. A CPU rank's memory is
    what its host has free (``shared_memory``), read by each rank at its own moment: it moves
    with other jobs' allocations and says nothing of the device, so it is left out (two ranks
    reading 5.98 and 6.02 GiB are one device, whose speeds are compared)."""
    return (r.device, -1 if r.shared_memory else r.memory_bytes // 2**30)


def _scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with every time multiplied by ``factor`` (bytes unchanged)."""
    if factor == 1.0:
        return profile
    times = ("forward_ms", "backward_ms", "forward_fixed_ms", "backward_fixed_ms")
    blocks = []
    for b in profile.blocks:
        change = {f: getattr(b, f) * factor for f in times}
        if b.backward_input_ms is not None and b.backward_weight_ms is not None:
            change |= {"backward_input_ms": b.backward_input_ms * factor,
                       "backward_weight_ms": b.backward_weight_ms * factor}
        blocks.append(replace(b, **change))
    return replace(profile, blocks=blocks)


def _levels(n: int, first: int, links: dict[tuple[int, int], LinkFigures],
            ranks: list[int]) -> tuple[Level, ...]:
    sizes = _level_sizes(n)
    if n == 1:
        return (Level(1, math.inf, 0.0),)
    out: list[Level] = []
    prev = 1
    for size in sizes:
        fig = links[(first, ranks[prev])]
        if out and _alike(out[-1], fig):  # no faster inner level: one level spans both
            out[-1] = Level(size, min(out[-1].gbps, fig.gbps),
                            max(out[-1].latency_us, fig.latency_us))
        else:
            out.append(Level(size, fig.gbps, fig.latency_us))
        prev = size
    return tuple(out)


def _alike(level: Level, fig: LinkFigures) -> bool:
    lo, hi = sorted((level.gbps, fig.gbps))
    return hi <= _SAME_LINK * lo


def assemble(
    reports: Sequence[RankReport],
    links: dict[tuple[int, int], LinkFigures],
    reduce_gbps: float = math.inf,
    name: str = "discovered",
) -> tuple[Cluster, Profile | None]:
    """The cluster the reports and measured links describe, and the reference profile.

    Args:
        reports: one per rank, in rank order.
        links: figures of every pair of :func:`link_pairs`.
        reduce_gbps: the all-reduce's own reduction rate (``inf``: free).

    Returns:
        The cluster (devices in rank order; with several device types each type carries its
        own profile) and the profile of the fastest type, against which speeds are given
        (None when the reports carry no profiles).

    Raises:
        ClusterError: a host's ranks are not consecutive.
    """
    reports = _per_device_memory(reports)
    types = _types(reports)
    profiled = {label: prof for label, prof, _ in types.values() if prof is not None}
    ref = min(profiled.values(), key=lambda p: p.total_ms) if profiled else None
    # Another device name (another model of device) keeps its own profile: its blocks need not
    # be slower by one factor. A slower class of the same device (shared, throttled) is priced
    # by its measured speed alone: such a slowdown is the same for every block, and a block
    # timed on a shared core is noisy where the whole step is not.
    names = {name for _, _, name in types.values()}
    base = {label for label, _, name in types.values() if label == name}
    specs: dict[str, DeviceSpec] = {}
    for r in reports:
        label, prof, _ = types[r.rank]
        if label in specs:
            continue
        speed = ref.total_ms / prof.total_ms if prof is not None and ref is not None else 1.0
        own = prof if len(names) > 1 and label in base and prof is not None else None
        specs[label] = DeviceSpec(
            name=label, speed=round(speed, 4), memory_gb=round(r.memory_bytes / 2**30, 2),
            reduce_gbps=reduce_gbps, profile=own,
            profile_path=_profile_file(label) if own is not None else None,
        )
    servers = []
    hosts = _servers([r.host for r in reports])
    for sname, (_, ranks) in zip(server_names([h for h, _ in hosts]), hosts):
        dev = [specs[types[k][0]] for k in ranks]
        common = statistics.mode(s.name for s in dev)
        main = next(s for s in dev if s.name == common)
        servers.append(ServerSpec(
            name=sname, count=1, gpus=len(ranks), device=main,
            levels=_levels(len(ranks), ranks[0], links, ranks),
            devices=tuple((i, s) for i, s in enumerate(dev) if s.name != common),
        ))
    net = [links[(a, b)] for a, b in link_pairs([r.host for r in reports])
           if _host(reports, a) != _host(reports, b)]
    cluster = Cluster(
        name=name,
        network_gbps=min((f.gbps for f in net), default=math.inf),
        network_latency_us=max((f.latency_us for f in net), default=0.0),
        servers=servers,
    )
    return cluster, ref


def server_names(hosts: Sequence[str]) -> list[str]:
    """A cluster server name per host (its name made safe for the file format, deduplicated)."""
    out, used = [], {}
    for host in hosts:
        base = "".join(c if c.isalnum() or c in "-_" else "-" for c in host) or "host"
        used[base] = used.get(base, 0) + 1
        out.append(base if used[base] == 1 else f"{base}-{used[base]}")
    return out


def device_names(hosts: Sequence[str]) -> list[str]:
    """The device name of each rank in the cluster :func:`assemble` builds for these hosts."""
    servers = _servers(hosts)
    return [f"{name}:{i}" for name, (_, ranks) in zip(server_names([h for h, _ in servers]),
                                                     servers) for i in range(len(ranks))]


def _host(reports: Sequence[RankReport], rank: int) -> str:
    return reports[rank].host


def _profile_file(label: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in label).strip("-")
    return f"profiles/{safe or 'device'}.json"


def write_cluster(
    cluster: Cluster, folder: str | Path, reference: Profile | None = None
) -> Path:
    """Write ``cluster.yaml`` and each device type's profile under ``folder``; the file loads
    back with :meth:`Cluster.load` (profile paths are relative to it). ``reference``, the
    profile the speeds are relative to and the plan was made from, goes to ``profile.json``
    (``python -m lightning_autopipe plan --profile profile.json --cluster cluster.yaml``
    plans the run again)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if reference is not None:
        reference.save(folder / "profile.json")
    for d in cluster.devices:
        spec = d.spec
        if spec.profile is not None and spec.profile_path is not None:
            path = folder / spec.profile_path
            path.parent.mkdir(parents=True, exist_ok=True)
            spec.profile.save(path)
    out = folder / "cluster.yaml"
    head = ("# Discovered from the launched ranks: servers by host, device types by measured\n"
            "# profile, links measured. Edit and pass back as cluster=<this file>.\n")
    out.write_text(head + cluster.to_yaml())
    return out


# ---------------------------------------------------------------------------- comparison
def compare_with_declared(
    declared: Cluster, reports: Sequence[RankReport]
) -> list[str]:
    """Where a user's cluster file contradicts what the ranks measured, one line each.

    Speeds are compared relative to the fastest rank (declared speed 1.0 where a rank measured
    half the speed of its peers); with several hosts, each host's ranks against its server's
    devices (host ``i`` is planned as the file's server instance ``i``).
    """
    out = []
    reports = sorted(reports, key=lambda r: r.rank)
    devices = declared.devices[: len(reports)]
    totals = [r.profile.total_ms if r.profile is not None else None for r in reports]
    known = [(d, t) for d, t in zip(devices, totals) if t is not None]
    if known:
        fastest = min(t for _, t in known)
        top = max(d.spec.speed for d, _ in known)
        for (d, t), r in zip(known, [r for r in reports if r.profile is not None]):
            measured, said = fastest / t, d.spec.speed / top
            if abs(measured - said) > (SLOWER - 1) * max(measured, said):
                out.append(
                    f"rank {r.rank} ({d.name}): declared relative speed {said:.2f}, measured "
                    f"{measured:.2f} of the fastest rank"
                )
    hosts = _servers([r.host for r in reports])
    instances = declared.instances
    for i, (host, ranks) in enumerate(hosts):
        if i >= len(instances):
            out.append(f"host {host!r} runs {len(ranks)} ranks but the file describes only "
                       f"{len(instances)} servers")
        elif len(hosts) > 1 and instances[i][1].gpus != len(ranks):
            out.append(f"host {host!r} runs {len(ranks)} ranks, its server "
                       f"{instances[i][0]!r} declares {instances[i][1].gpus} devices")
    return out


# ---------------------------------------------------------------------------- collective
def gather_reports(profile: Profile | None, device: torch.device) -> list[RankReport]:
    """Every rank's :class:`RankReport` on every rank, in rank order; collective."""
    reports: list[RankReport | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, local_report(dist.get_rank(), device, profile))
    return sorted((r for r in reports if r is not None), key=lambda r: r.rank)


def discover(
    profile: Profile | None,
    device: torch.device,
    *,
    measure_reduce_rate: bool = True,
    confirm: Callable[[], Profile] | None = None,
) -> tuple[Cluster, Profile | None, list[RankReport]]:
    """Gather every rank's report, measure the sampled links; collective on the default group.

    Every rank must call it at the same point, with the profile it just measured. Returns the
    same cluster and reference profile on every rank (built from the same gathered figures).
    ``confirm``, when given, is called on every rank (together: it may be collective) if a
    rank measured slower than its peers of one device name (:func:`slower_ranks`); it returns
    the profile this rank reports instead, and the ranks are typed by those (the links are
    not measured again).
    """
    from lightning_autopipe.runtime.calibrate import link_device, measure_link, measure_reduce

    me = dist.get_rank()
    dev = link_device(None, device)  # what the default group's backend moves
    got = gather_reports(profile, device)
    hosts = [r.host for r in got]
    links: dict[tuple[int, int], LinkFigures] = {}
    used: list[dist.ProcessGroup] = []
    for a, b in link_pairs(hosts):
        group = dist.new_group([a, b])  # collective: every rank creates every pair's group
        fig = measure_link(group, device=device) if me in (a, b) else None
        vals = torch.tensor(list(fig) if fig else [0.0, 0.0], dtype=torch.float64, device=dev)
        dist.broadcast(vals, a)
        links[(a, b)] = LinkFigures(float(vals[0]), float(vals[1]))
        used.append(group)
    reduce = math.inf
    first = _servers(hosts)[0][1]
    if measure_reduce_rate and len(first) > 1:
        group = dist.new_group(first)
        pair = links[(first[0], first[1])]
        rate = measure_reduce((pair.latency_us, pair.gbps), group, device=device) \
            if me in first else None
        vals = torch.tensor([rate if rate is not None else 0.0], dtype=torch.float64,
                            device=dev)
        dist.broadcast(vals, first[0])
        reduce = float(vals[0]) if float(vals[0]) > 0 else math.inf
        used.append(group)
    # Destroyed together between barriers: a rank destroying a gloo group while another is
    # still in a collective broke the default group (see held_pipeline).
    dist.barrier()
    for group in used:
        dist.destroy_process_group(group)
    dist.barrier()
    slower = slower_ranks(got)  # the same on every rank: built from the gathered reports
    if slower and confirm is not None:
        got = gather_reports(confirm(), device)
        log.rank_zero_info(f"discovery: ranks {slower} profiled slower than their peers of one "
                           f"device name and were profiled again; still slower: "
                           f"{slower_ranks(got) or 'none'}")
    cluster, ref = assemble(got, links, reduce_gbps=reduce)
    return cluster, ref, got
