"""What a cluster file says about servers and devices: the spec dataclasses and their parser.

:class:`~lightning_autopipe.cluster.Cluster` puts these together and answers link and device
lookups; this module holds the pieces and validates a file's ``servers`` entries, with errors
that name the entry, the key and its value (the file format is described in
:mod:`lightning_autopipe.cluster`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_autopipe.errors import ClusterError
from lightning_autopipe.profile import Profile

__all__ = [
    "Device",
    "DeviceSpec",
    "Level",
    "ServerSpec",
    "check_device_types",
    "non_negative",
    "no_unknown",
    "parse_device",
    "parse_server",
    "positive",
    "require",
]

DEFAULT_LEVEL_LATENCY_US = 2.0
_SERVER_KEYS = {"name", "count", "gpus", "device", "devices", "levels", "nic_gbps"}
_DEVICE_KEYS = {"name", "speed", "memory_gb", "overhead_ms", "reduce_gbps", "profile"}
_LEVEL_KEYS = {"size", "gbps", "latency_us"}


@dataclass(frozen=True)
class DeviceSpec:
    """A kind of accelerator (a device type): relative speed, memory, a fixed cost per compute
    action, the rate at which its collective backend reduces gradient bytes (``inf``: free)
    and, optionally, its own measured block profile.

    With a ``profile`` the planner prices every block on this type from it (an older GPU is
    slower on attention than on a GEMM by another factor than its ``speed`` says); ``speed``
    (its whole-model throughput relative to the reference profile) then only orders devices.
    Without one, blocks cost the reference profile's time over ``speed``. The ``name``
    identifies the type: two devices of one name share one profile.
    """

    name: str
    speed: float
    memory_gb: float
    overhead_ms: float = 0.0
    reduce_gbps: float = math.inf
    profile: Profile | None = field(default=None, compare=False, repr=False)
    profile_path: str | None = None  # where ``profile`` was read from (kept for to_dict)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 2**30)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "speed": self.speed,
                               "memory_gb": self.memory_gb}
        if self.overhead_ms:
            out["overhead_ms"] = self.overhead_ms
        if math.isfinite(self.reduce_gbps):
            out["reduce_gbps"] = self.reduce_gbps
        if self.profile_path is not None:
            out["profile"] = self.profile_path
        return out


@dataclass(frozen=True)
class Level:
    """Inside a server, GPUs ``i`` and ``j`` with ``i // size == j // size`` talk at ``gbps``."""

    size: int
    gbps: float
    latency_us: float = DEFAULT_LEVEL_LATENCY_US


@dataclass(frozen=True)
class ServerSpec:
    """``count`` identical servers of ``gpus`` devices each.

    Every device is ``device`` except those listed in ``devices`` (index -> spec): a server
    whose GPUs are not all alike, or one of whose devices runs measurably slower (throttled,
    shared with another job).
    """

    name: str
    count: int
    gpus: int
    device: DeviceSpec
    levels: tuple[Level, ...]
    nic_gbps: float | None = None
    devices: tuple[tuple[int, DeviceSpec], ...] = ()

    def device_at(self, index: int) -> DeviceSpec:
        """The spec of device ``index`` of one instance."""
        for i, spec in self.devices:
            if i == index:
                return spec
        return self.device

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "count": self.count, "gpus": self.gpus,
                               "device": self.device.to_dict()}
        if self.devices:
            out["devices"] = {i: spec.to_dict() for i, spec in self.devices}
        out["levels"] = [{"size": lv.size, "gbps": lv.gbps, "latency_us": lv.latency_us}
                         for lv in self.levels]
        if self.nic_gbps is not None:
            out["nic_gbps"] = self.nic_gbps
        return out

    def instance_names(self) -> list[str]:
        if self.count == 1:
            return [self.name]
        return [f"{self.name}{i}" for i in range(self.count)]


@dataclass(frozen=True)
class Device:
    """One accelerator: ``name`` is ``"<instance>:<gpu index>"``, ``rank`` its global order."""

    name: str
    server: str
    index: int
    spec: DeviceSpec
    rank: int


# ---------------------------------------------------------------------- validation helpers
def no_unknown(data: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}")


def require(data: dict, key: str, where: str) -> Any:
    if key not in data:
        raise ClusterError(f"{where} lacks key {key!r}")
    return data[key]


def _number(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def positive(value: Any, key: str, where: str) -> float:
    v = _number(value, key, where)
    if not v > 0:
        raise ClusterError(f"{where}: {key} must be > 0, got {value!r}")
    return v


def finite_positive(value: Any, key: str, where: str) -> float:
    """A device's speed or memory: > 0 and finite (a bandwidth may be ``.inf``: free)."""
    v = positive(value, key, where)
    if not math.isfinite(v):
        raise ClusterError(f"{where}: {key} must be a finite number, got {value!r}")
    return v


#: GiB of device memory above any real device's (an exabyte), inside what bytes can count
_MOST_MEMORY_GB = 1e9


def _memory_gb(value: Any, where: str) -> float:
    v = finite_positive(value, "memory_gb", where)
    if v > _MOST_MEMORY_GB:
        raise ClusterError(f"{where}: memory_gb is GiB of one device's memory, at most "
                           f"{_MOST_MEMORY_GB:.0e}; got {value!r}")
    return v


def non_negative(value: Any, key: str, where: str) -> float:
    v = _number(value, key, where)
    if not v >= 0:
        raise ClusterError(f"{where}: {key} must be >= 0, got {value!r}")
    return v


def _positive_int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def parse_server(raw: Any, i: int, base: Path | None = None) -> ServerSpec:
    """One ``servers`` entry, validated; profile paths are read relative to ``base``."""
    where = f"servers[{i}]"
    if not isinstance(raw, dict):
        raise ClusterError(f"{where} must be a mapping, got {raw!r}")
    no_unknown(raw, _SERVER_KEYS, where)
    name = require(raw, "name", where)
    if not isinstance(name, str) or not name or ":" in name:
        raise ClusterError(f"{where}: name must be a non-empty string without ':', got {name!r}")
    where = f"server {name!r}"
    count = _positive_int(raw.get("count", 1), "count", where)
    gpus = _positive_int(require(raw, "gpus", where), "gpus", where)
    device = parse_device(require(raw, "device", where), f"{where} device", base)
    overrides = raw.get("devices", {})
    if not isinstance(overrides, dict):
        raise ClusterError(
            f"{where}: devices must be a mapping of device index -> device, e.g. "
            f"{{1: {{name: slow, speed: 0.5, memory_gb: 16}}}}; got {overrides!r}"
        )
    devices = []
    for key, dev in overrides.items():
        idx = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < gpus:
            raise ClusterError(
                f"{where}: devices key {idx!r} is not a device index in 0..{gpus - 1}"
            )
        devices.append((idx, parse_device(dev, f"{where} devices[{idx}]", base)))
    levels_raw = require(raw, "levels", where)
    if not isinstance(levels_raw, list) or not levels_raw:
        raise ClusterError(
            f"{where}: levels must be a non-empty list, innermost first, the last of size "
            f"{gpus} (e.g. [{{size: {gpus}, gbps: 100}}]); got {levels_raw!r}"
        )
    levels = []
    prev = 1
    for j, lv in enumerate(levels_raw):
        lw = f"{where} levels[{j}]"
        if not isinstance(lv, dict):
            raise ClusterError(f"{lw} must be a mapping {{size, gbps}}, got {lv!r}")
        no_unknown(lv, _LEVEL_KEYS, lw)
        size = _positive_int(require(lv, "size", lw), "size", lw)
        if size <= prev and j > 0:
            raise ClusterError(
                f"{lw}: size {size} must be larger than the previous level's {prev} "
                "(levels go innermost first)"
            )
        if size % prev:
            raise ClusterError(
                f"{lw}: size {size} is not a multiple of the previous level's {prev}; "
                "groups must nest"
            )
        if gpus % size:
            raise ClusterError(f"{lw}: size {size} does not divide gpus={gpus}")
        levels.append(
            Level(
                size=size,
                gbps=positive(require(lv, "gbps", lw), "gbps", lw),
                latency_us=non_negative(
                    lv.get("latency_us", DEFAULT_LEVEL_LATENCY_US), "latency_us", lw
                ),
            )
        )
        prev = size
    if levels[-1].size != gpus:
        raise ClusterError(
            f"{where}: the last (outermost) level has size {levels[-1].size} but the server has "
            f"gpus={gpus}; add a level {{size: {gpus}, gbps: ...}} that spans the whole server"
        )
    nic = raw.get("nic_gbps")
    nic_gbps = None if nic is None else positive(nic, "nic_gbps", where)
    spec = ServerSpec(str(name), count, gpus, device, tuple(levels), nic_gbps,
                      tuple(sorted(devices, key=lambda d: d[0])))
    _check_types([spec.device_at(g) for g in range(gpus)], where)
    return spec


def parse_device(dev: Any, where: str, base: Path | None = None) -> DeviceSpec:
    """One ``device`` mapping, validated; a ``profile`` path is loaded relative to ``base``."""
    if not isinstance(dev, dict):
        raise ClusterError(f"{where} must be a mapping, got {dev!r}")
    no_unknown(dev, _DEVICE_KEYS, where)
    path = dev.get("profile")
    profile = None
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ClusterError(f"{where}: profile must be the path of a profile JSON, got {path!r}")
        full = Path(path) if base is None or Path(path).is_absolute() else base / path
        try:
            profile = Profile.load(full)
        except (OSError, ValueError) as exc:
            raise ClusterError(
                f"{where}: cannot read its profile {full}: {exc}; measure it again (a training "
                "run writes one per device type next to its discovered cluster.yaml) or drop "
                "the profile key to price the type by its speed"
            ) from exc
    return DeviceSpec(
        name=str(require(dev, "name", where)),
        speed=finite_positive(require(dev, "speed", where), "speed", where),
        memory_gb=_memory_gb(require(dev, "memory_gb", where), where),
        overhead_ms=non_negative(dev.get("overhead_ms", 0.0), "overhead_ms", where),
        reduce_gbps=positive(dev.get("reduce_gbps", math.inf), "reduce_gbps", where),
        profile=profile,
        profile_path=path,
    )


def check_device_types(specs: list[DeviceSpec], where: str = "cluster") -> None:
    """One name is one device type: its devices must share one profile file.

    Raises:
        ClusterError: two specs of one name with different profiles, naming both.
    """
    _check_types(specs, where)


def _check_types(specs: list[DeviceSpec], where: str) -> None:
    seen: dict[str, DeviceSpec] = {}
    for spec in specs:
        other = seen.setdefault(spec.name, spec)
        if other.profile_path != spec.profile_path:
            raise ClusterError(
                f"{where}: device type {spec.name!r} names two profiles "
                f"({other.profile_path!r} and {spec.profile_path!r}); a device type has one "
                "profile: rename one of the types"
            )
