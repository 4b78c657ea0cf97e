"""Servers, their devices and the links between them: the hardware a plan is made for.

A cluster is read from YAML (``conf/cluster/*.yaml``) and validated on load::

    name: mixed-rack
    network_gbps: 25            # per-server NIC bandwidth between servers (gigabits per second)
    network_latency_us: 20      # optional, default 20
    servers:
      - name: pcie              # instances: "pcie" if count is 1, else "pcie0", "pcie1", ...
        count: 2                # optional, default 1
        gpus: 8
        nic_gbps: 25            # optional: this server's NIC, default network_gbps
        device: {name: V100-32GB, speed: 0.45, memory_gb: 32}  # optional: overhead_ms, reduce_gbps
        devices:                # optional: device index -> a device that differs from `device`
          7: {name: V100-32GB-throttled, speed: 0.3, memory_gb: 32}
        levels:                 # innermost first: group size -> bandwidth between its members
          - {size: 2, gbps: 100}          # optional latency_us per level (default 2)
          - {size: 4, gbps: 64}
          - {size: 8, gbps: 32}

Level rules (so that every pair of GPUs in a server shares exactly one innermost level): sizes
strictly increase, each divides the next, and the last equals ``gpus``. GPU ``i`` belongs to group
``i // size`` of a level. ``speed`` is throughput relative to the device the profile was measured
on; ``memory_gb`` is GiB (2**30 bytes). A device may name its own measured block profile (``profile:
<path of a profile JSON>``, relative to the YAML file): blocks on that device type are then priced
from it rather than from the reference profile over ``speed`` (a training run that discovers its
cluster writes such a file, one profile per device type). ``overhead_ms`` is a fixed cost per
compute action (default 0; a training run that discovers its cluster measures the runtime's own
and writes it). ``reduce_gbps`` is how fast the device's collective backend does its own
part of a gradient all-reduce (summing and copying the bytes it reduces), in Gb/s of reduced bytes;
absent (the default), that work is free next to the links, as NCCL's is on a GPU. gloo on a CPU is
not: two local processes reduce at about 10 Gb/s while their link moves 30 Gb/s, so
:meth:`Cluster.local` takes the measured figure.

Contention resources (:meth:`Cluster.link_resources`) are directional: a transfer whose innermost
shared level is ``L`` occupies the uplink of the sender's level-``L-1`` group out of it and of the
receiver's group into it (for ``L = 0`` the groups are the devices themselves), each with the
level's bandwidth; a transfer between servers occupies the sender's NIC out and the receiver's NIC
in. Intra-server links crossed by network traffic are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_autopipe.errors import ClusterError
from lightning_autopipe.hardware import (
    Device,
    DeviceSpec,
    Level,
    ServerSpec,
    check_device_types,
    no_unknown,
    non_negative,
    parse_server,
    positive,
    require,
)

__all__ = ["DeviceSpec", "Level", "ServerSpec", "Device", "Cluster", "BYTES_PER_MS_PER_GBPS"]

#: gigabits per second -> bytes per millisecond.
BYTES_PER_MS_PER_GBPS = 1e9 / 8 / 1e3

_DEFAULT_NETWORK_LATENCY_US = 20.0
#: Devices a cluster may describe: the planner models each one, so a slip such as ``count:
#: 100000000`` would otherwise build (and plan over) that many before anything is reported.
#: Planning takes seconds at 80,000 devices and about a minute at 800,000; this is above the
#: largest GPU clusters built.
MAX_DEVICES = 2**17
_TOP_KEYS = {"name", "network_gbps", "network_latency_us", "servers", "description"}


@dataclass
class Cluster:
    """A validated cluster; lookups of bandwidth, latency and shared resources between devices."""

    name: str
    network_gbps: float
    network_latency_us: float
    servers: list[ServerSpec]
    _devices: list[Device] = field(init=False, repr=False, compare=False)
    _by_name: dict[str, Device] = field(init=False, repr=False, compare=False)
    _instances: list[tuple[str, ServerSpec]] = field(init=False, repr=False, compare=False)
    _inst: dict[str, ServerSpec] = field(init=False, repr=False, compare=False)
    _link_cache: dict[tuple[str, str], tuple] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ClusterError(
                f"cluster {self.name!r} has no servers; list at least one under 'servers' "
                "(the 'local' cluster is built with Cluster.local(world_size) instead)"
            )
        total = sum(spec.count * spec.gpus for spec in self.servers)
        if total > MAX_DEVICES:
            sizes = ", ".join(f"{spec.name!r}: {spec.count} x {spec.gpus}"
                              for spec in self.servers)
            raise ClusterError(
                f"cluster {self.name!r} describes {total:,} devices ({sizes}: count x gpus), "
                f"more than the {MAX_DEVICES:,} the planner models; check the servers' "
                "'count' and 'gpus'"
            )
        self._instances = []
        seen: dict[str, str] = {}
        for spec in self.servers:
            for inst in spec.instance_names():
                if inst in seen:
                    raise ClusterError(
                        f"server instance name {inst!r} is used twice (by servers "
                        f"{seen[inst]!r} and {spec.name!r}); rename one of them"
                    )
                seen[inst] = spec.name
                self._instances.append((inst, spec))
        self._inst = dict(self._instances)
        self._devices = []
        for inst, spec in self._instances:
            for i in range(spec.gpus):
                name = f"{inst}:{i}"
                self._devices.append(Device(name, inst, i, spec.device_at(i), len(self._devices)))
        self._by_name = {d.name: d for d in self._devices}
        check_device_types([d.spec for d in self._devices], f"cluster {self.name!r}")
        self._link_cache = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Any, base: Path | None = None) -> Cluster:
        """Build and validate a cluster from its YAML/JSON mapping (see the module docstring).

        Device ``profile`` paths are read relative to ``base`` (the file's folder).
        """
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ClusterError(f"a cluster description must be a mapping, got {kind}")
        no_unknown(data, _TOP_KEYS, "cluster")
        name = require(data, "name", "cluster")
        if "servers" not in data:
            raise ClusterError(f"cluster {name!r} lacks key 'servers' (a list of server entries)")
        servers_raw = data["servers"]
        if not isinstance(servers_raw, list):
            raise ClusterError(
                f"cluster {name!r}: 'servers' must be a list, got {type(servers_raw).__name__}"
            )
        if not servers_raw:
            raise ClusterError(
                f"cluster {name!r}: 'servers' is empty; list at least one server (a cluster "
                "named 'local' with no servers is resolved by the strategy via Cluster.local)"
            )
        servers = [parse_server(s, i, base) for i, s in enumerate(servers_raw)]
        instances = sum(s.count for s in servers)
        if "network_gbps" in data:
            net = positive(data["network_gbps"], "network_gbps", f"cluster {name!r}")
        elif instances > 1 and any(s.nic_gbps is None for s in servers):
            raise ClusterError(
                f"cluster {name!r} has {instances} server instances but lacks key "
                "'network_gbps' (bandwidth of each server's NIC in Gb/s, e.g. 25)"
            )
        else:
            net = math.inf
        lat = non_negative(
            data.get("network_latency_us", _DEFAULT_NETWORK_LATENCY_US),
            "network_latency_us",
            f"cluster {name!r}",
        )
        return cls(name=str(name), network_gbps=net, network_latency_us=lat, servers=servers)

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Read a cluster YAML file; errors name the file, the bad key and its value."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ClusterError(f"cannot read cluster file {path}: {exc}") from exc
        try:
            return cls.from_dict(data, base=path.parent)
        except ClusterError as exc:
            raise ClusterError(f"{path}: {exc}") from None

    @classmethod
    def local(
        cls,
        world_size: int,
        device_name: str = "cpu",
        speed: float = 1.0,
        memory_gb: float = 16.0,
        gbps: float = 2.0,
        latency_us: float = 50.0,
        reduce_gbps: float = math.inf,
        overhead_ms: float = 0.0,
    ) -> Cluster:
        """The launched processes as one homogeneous server named ``local``.

        The defaults describe CPU processes talking through gloo on one machine (about 2 Gb/s
        and 50 us per message, measured on the development machines) with the all-reduce's own
        work left out; the strategy measures all three instead
        (:mod:`lightning_autopipe.runtime.calibrate`). ``overhead_ms``: the runtime's own
        cost per compute action (:mod:`lightning_autopipe.runtime.action_overhead` measures it).
        """
        if world_size < 1:
            raise ClusterError(f"Cluster.local needs world_size >= 1, got {world_size}")
        if not reduce_gbps > 0:
            raise ClusterError(
                f"Cluster.local needs reduce_gbps > 0 (inf: free), got {reduce_gbps}"
            )
        for key, value in (("memory_gb", memory_gb), ("speed", speed)):
            if not (value > 0 and math.isfinite(value)):  # as a cluster file's (hardware)
                raise ClusterError(f"Cluster.local needs a finite {key} > 0, got {value}")
        spec = ServerSpec(
            name="local",
            count=1,
            gpus=int(world_size),
            device=DeviceSpec(
                device_name, float(speed), float(memory_gb), overhead_ms=float(overhead_ms),
                reduce_gbps=float(reduce_gbps),
            ),
            levels=(Level(int(world_size), float(gbps), float(latency_us)),),
        )
        return cls(name="local", network_gbps=math.inf, network_latency_us=0.0, servers=[spec])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "network_gbps": self.network_gbps}
        out["network_latency_us"] = self.network_latency_us
        out["servers"] = [s.to_dict() for s in self.servers]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ------------------------------------------------------------------ devices
    @property
    def devices(self) -> list[Device]:
        """All devices in global rank order (servers in file order, instances, gpus)."""
        return list(self._devices)

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def instances(self) -> list[tuple[str, ServerSpec]]:
        """``(instance name, ServerSpec)`` in order, e.g. ``[("pcie0", spec), ("pcie1", spec)]``."""
        return list(self._instances)

    def device(self, name: str) -> Device:
        try:
            return self._by_name[name]
        except KeyError:
            sample = ", ".join(d.name for d in self._devices[:4])
            raise ClusterError(
                f"cluster {self.name!r} has no device {name!r}; names look like {sample}, ..."
            ) from None

    def validate_world_size(self, world_size: int, exact: bool = False) -> None:
        """Check the launched world against the cluster's device count.

        Raises:
            ClusterError: fewer devices than ``world_size`` (or a different count with
                ``exact=True``), naming both numbers and the fix.
        """
        n = self.num_devices
        if world_size > n:
            raise ClusterError(
                f"cluster {self.name!r} describes {n} devices but {world_size} processes were "
                f"launched; launch at most {n} processes or describe the missing devices in the "
                "cluster YAML"
            )
        if exact and world_size != n:
            raise ClusterError(
                f"cluster {self.name!r} describes {n} devices but {world_size} processes were "
                f"launched; launch exactly {n} processes or edit the cluster YAML to match"
            )

    def validate_nodes(self, num_nodes: int, per_node: int) -> None:
        """Check that launcher node ``i`` is server instance ``i`` of the file.

        A launcher numbers ranks ``node * per_node + local rank``, and devices take ranks in
        the file's order, so the mapping holds only if the file has at least ``num_nodes``
        server instances, each of the first ``num_nodes - 1`` with exactly ``per_node`` devices
        and the last with at least that many; otherwise ranks of one node would be planned as
        devices of another server, with its speed and links.

        Raises:
            ClusterError: naming the first instance that differs and both fixes.
        """
        if num_nodes <= 1:
            return
        if len(self._instances) < num_nodes:
            raise ClusterError(
                f"cluster {self.name!r} describes {len(self._instances)} server instances but the "
                f"run has {num_nodes} nodes; launcher node i is planned as server instance i, so "
                "describe one server per node (count: N for identical ones)"
            )
        nodes = self._instances[:num_nodes]  # the last node may leave devices unused
        for i, (inst, spec) in enumerate(nodes):
            last = i == num_nodes - 1
            if spec.gpus == per_node or (last and spec.gpus > per_node):
                continue
            raise ClusterError(
                f"cluster {self.name!r}: server instance {inst!r} (launcher node {i}) has "
                f"{spec.gpus} devices but {per_node} processes run on each of {num_nodes} nodes; "
                "ranks are numbered node by node and devices server by server, so node i is "
                f"server instance i only if every server but the last has exactly {per_node} "
                f"devices (the last at least {per_node}); launch as many processes per node as "
                "each server has GPUs (trainer.devices), or describe the servers as launched"
            )

    # ------------------------------------------------------------------ links
    def _link(self, a: str, b: str) -> tuple[float, float, tuple]:
        """(gbps, latency_us, resources) of a transfer a -> b, cached."""
        key = (a, b)
        hit = self._link_cache.get(key)
        if hit is not None:
            return hit
        da, db = self.device(a), self.device(b)
        if da.name == db.name:
            out: tuple = (math.inf, 0.0, ())
        elif da.server == db.server:
            spec = self._inst[da.server]
            prev = 1
            out = (math.inf, 0.0, ())
            for li, lv in enumerate(spec.levels):
                if da.index // lv.size == db.index // lv.size:
                    res = (
                        ("level", da.server, li, da.index // prev, "out"),
                        ("level", da.server, li, db.index // prev, "in"),
                    )
                    out = (lv.gbps, lv.latency_us, res)
                    break
                prev = lv.size
        else:
            sa, sb = self._inst[da.server], self._inst[db.server]
            gbps = min(self._nic(sa), self._nic(sb))
            res = (("nic", da.server, "out"), ("nic", db.server, "in"))
            out = (gbps, self.network_latency_us, res)
        self._link_cache[key] = out
        return out

    def _nic(self, spec: ServerSpec) -> float:
        return spec.nic_gbps if spec.nic_gbps is not None else self.network_gbps

    def bandwidth_gbps(self, a: str, b: str) -> float:
        """Bandwidth of a transfer a -> b: innermost shared level, else the NICs across servers."""
        return self._link(a, b)[0]

    def latency_us(self, a: str, b: str) -> float:
        """Latency of one message a -> b (0 for a device to itself)."""
        return self._link(a, b)[1]

    def link_resources(self, a: str, b: str) -> list[tuple]:
        """Hashable ids of the shared links a transfer a -> b occupies (see module docstring)."""
        return list(self._link(a, b)[2])

    def resource_gbps(self, resource: tuple) -> float:
        """Capacity of a resource id returned by :meth:`link_resources`."""
        if resource[0] == "nic":
            return self._nic(self._inst[resource[1]])
        if resource[0] == "level":
            return self._inst[resource[1]].levels[resource[2]].gbps
        raise ClusterError(f"unknown link resource {resource!r}")

    def ring_order(self, devices: list[str]) -> list[str]:
        """Ring order of an all-reduce: global rank order, which keeps each server together."""
        return sorted(devices, key=lambda n: self.device(n).rank)
