"""Cluster YAML: every shipped file loads, bad input names key and value, link lookups."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from lightning_autopipe.cluster import BYTES_PER_MS_PER_GBPS, Cluster
from lightning_autopipe.errors import ClusterError
from lightning_autopipe.planner.pricing import allreduce_ms, reduce_ms_per_byte

CONF = Path(__file__).resolve().parents[2] / "conf" / "cluster"
SHIPPED = sorted(p for p in CONF.glob("*.yaml") if p.stem != "local")

RACK = {
    "name": "mixed-rack",
    "network_gbps": 25,
    "network_latency_us": 20,
    "servers": [
        {
            "name": "nv",
            "count": 1,
            "gpus": 8,
            "device": {"name": "A100", "speed": 1.0, "memory_gb": 40},
            "levels": [{"size": 8, "gbps": 2400}],
        },
        {
            "name": "pcie",
            "count": 2,
            "gpus": 8,
            "device": {"name": "V100", "speed": 0.45, "memory_gb": 32},
            "levels": [
                {"size": 2, "gbps": 100},
                {"size": 4, "gbps": 64},
                {"size": 8, "gbps": 32, "latency_us": 3},
            ],
        },
    ],
}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_clusters_load_and_round_trip(path: Path) -> None:
    c = Cluster.load(path)
    assert c.num_devices == sum(s.count * s.gpus for s in c.servers)
    names = [d.name for d in c.devices]
    assert len(set(names)) == len(names)
    assert [d.rank for d in c.devices] == list(range(c.num_devices))
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_dict(yaml.safe_load(c.to_yaml())) == c


def test_shipped_set_covers_the_benchmark_clusters() -> None:
    sizes = {p.stem: Cluster.load(p).num_devices for p in SHIPPED}
    assert sizes["nvlink_2x8"] == 16
    assert sizes["pcie_2x8"] == 16
    assert sizes["mixed_64"] == 64
    speeds = {d.spec.speed for d in Cluster.load(CONF / "mixed_rack.yaml").devices}
    assert len(speeds) > 1  # heterogeneous


def test_local_yaml_is_rejected_and_local_cluster_is_built_in_code() -> None:
    with pytest.raises(ClusterError, match="servers' is empty"):
        Cluster.load(CONF / "local.yaml")
    c = Cluster.local(3)
    assert [d.name for d in c.devices] == ["local:0", "local:1", "local:2"]
    assert c.bandwidth_gbps("local:0", "local:2") == 2.0
    with pytest.raises(ClusterError, match="world_size >= 1"):
        Cluster.local(0)


def test_instance_and_device_names() -> None:
    c = Cluster.from_dict(RACK)
    assert [i for i, _ in c.instances] == ["nv", "pcie0", "pcie1"]
    d = c.device("pcie1:3")
    assert (d.server, d.index, d.rank, d.spec.speed) == ("pcie1", 3, 8 + 8 + 3, 0.45)
    assert c.device("nv:0").spec.memory_bytes == 40 * 2**30
    with pytest.raises(ClusterError, match="no device 'pcie2:0'"):
        c.device("pcie2:0")


def _mutated(path: list, value: object) -> dict:
    data = copy.deepcopy(RACK)
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        (["servers", 0, "gpus"], _DELETE, "lacks key 'gpus'"),
        (["name"], _DELETE, "lacks key 'name'"),
        (["servers"], _DELETE, "lacks key 'servers'"),
        (["network_gbps"], _DELETE, "lacks key 'network_gbps'"),
        (["servers", 1, "device", "speed"], -1, "speed must be > 0, got -1"),
        (["servers", 1, "device", "speed"], float("inf"), "speed must be a finite number"),
        (["servers", 1, "device", "memory_gb"], float("inf"), "memory_gb must be a finite"),
        (["servers", 1, "device", "memory_gb"], "lots", "memory_gb must be a number, got 'lots'"),
        (["servers", 1, "device", "memory_gb"], 1e308, "memory, at most 1e+09; got 1e+308"),
        (["servers", 0, "gpus"], 0, "gpus must be a positive integer, got 0"),
        (["servers", 1, "count"], 1.5, "count must be a positive integer, got 1.5"),
        (["network_gbps"], 0, "network_gbps must be > 0, got 0"),
        (["network_latency_us"], -5, "network_latency_us must be >= 0, got -5"),
        (["servers", 1, "levels", 1, "size"], 2, "size 2 must be larger than the previous"),
        (["servers", 1, "levels", 1, "size"], 3, "size 3 is not a multiple"),
        (["servers", 1, "levels", 2, "size"], 16, "size 16 does not divide gpus=8"),
        (["servers", 0, "levels"], [{"size": 4, "gbps": 100}], "last (outermost) level has size 4"),
        (["servers", 0, "levels"], [], "levels must be a non-empty list"),
        (["servers", 0, "levels", 0, "gbps"], None, "gbps must be a number, got None"),
        (["servers", 0, "levels", 0, "bandwith"], 5, "unknown key(s) ['bandwith']"),
        (["nics"], 2, "unknown key(s) ['nics']"),
        (["servers", 0, "device", "tflops"], 300, "unknown key(s) ['tflops']"),
        (["servers", 0, "name"], "pcie0", "'pcie0' is used twice"),
        (["servers", 0, "name"], "a:b", "without ':'"),
        (["servers"], [], "'servers' is empty"),
        (["servers"], "nv", "'servers' must be a list"),
        (["servers", 1, "count"], 10**8, "describes 800,000,008 devices"),
    ],
)
def test_malformed_cluster_names_key_and_value(path: list, value: object, expect: str) -> None:
    with pytest.raises(ClusterError) as info:
        Cluster.from_dict(_mutated(path, value))
    assert expect in str(info.value)


def test_load_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nservers:\n  - {name: s, gpus: 2, device: {name: d, speed: 1}}\n")
    with pytest.raises(ClusterError, match=r"bad\.yaml.*lacks key 'memory_gb'"):
        Cluster.load(bad)
    with pytest.raises(ClusterError, match="cannot read cluster file"):
        Cluster.load(tmp_path / "missing.yaml")


def test_bandwidth_and_latency_per_level_and_network() -> None:
    c = Cluster.from_dict(RACK)
    bw, lat = c.bandwidth_gbps, c.latency_us
    assert bw("nv:0", "nv:7") == 2400
    assert lat("nv:0", "nv:7") == 2.0
    assert bw("pcie0:0", "pcie0:1") == 100  # same PCIe switch
    assert bw("pcie0:1", "pcie0:2") == 64  # same socket
    assert bw("pcie0:3", "pcie0:4") == 32
    assert lat("pcie0:3", "pcie0:4") == 3.0
    assert bw("pcie0:6", "pcie0:7") == 100
    assert bw("pcie0:0", "pcie1:0") == 25
    assert lat("pcie0:0", "pcie1:0") == 20.0
    assert bw("nv:3", "pcie1:5") == 25
    assert lat("nv:3", "nv:3") == 0.0


def test_per_server_nic_bandwidth_takes_the_slower_side() -> None:
    c = Cluster.load(CONF / "mixed_64.yaml")
    assert c.bandwidth_gbps("nv0:0", "nv1:0") == 100
    assert c.bandwidth_gbps("nv0:0", "pcie2:0") == 50
    assert c.bandwidth_gbps("pcie0:0", "slow1:0") == 25


def test_link_resources_model_shared_uplinks_and_nics() -> None:
    c = Cluster.from_dict(RACK)
    res = c.link_resources

    def shared(a: tuple[str, str], b: tuple[str, str]) -> bool:
        return bool(set(res(*a)) & set(res(*b)))

    assert not shared(("pcie0:0", "pcie0:1"), ("pcie0:2", "pcie0:3"))  # separate switches
    assert shared(("pcie0:0", "pcie0:4"), ("pcie0:1", "pcie0:5"))  # one socket-to-socket link
    assert not shared(("pcie0:0", "pcie0:4"), ("pcie0:5", "pcie0:1"))  # opposite directions
    assert shared(("pcie0:0", "pcie1:0"), ("pcie0:7", "nv:2"))  # pcie0's NIC out
    assert shared(("pcie0:0", "pcie1:0"), ("nv:1", "pcie1:6"))  # pcie1's NIC in
    assert not shared(("pcie0:0", "pcie1:0"), ("pcie1:1", "pcie0:1"))
    assert not shared(("nv:0", "nv:1"), ("nv:2", "nv:3"))  # NVSwitch: per-GPU ports
    for a, b in [("pcie0:0", "pcie0:4"), ("pcie0:0", "pcie1:0"), ("nv:0", "nv:5")]:
        assert min(c.resource_gbps(r) for r in res(a, b)) == c.bandwidth_gbps(a, b)


def test_allreduce_is_the_ring_formula() -> None:
    c = Cluster.from_dict(RACK)
    nbytes = 100_000_000
    # ring pcie0:0 -> 1 -> 2 -> 3 -> 0: slowest edge is the 64 Gb/s socket level, latency 2 us
    want = 2 * 3 / 4 * nbytes / (64 * BYTES_PER_MS_PER_GBPS) + 2 * 3 * 2.0 / 1e3
    assert allreduce_ms(c, ["pcie0:3", "pcie0:0", "pcie0:2", "pcie0:1"], nbytes) == pytest.approx(
        want, rel=1e-12
    )
    # across two servers: the 25 Gb/s NIC and its 20 us latency set the pace
    devs = [f"pcie{i}:{j}" for i in range(2) for j in range(8)]
    want = 2 * 15 / 16 * nbytes / (25 * BYTES_PER_MS_PER_GBPS) + 2 * 15 * 20.0 / 1e3
    assert allreduce_ms(c, devs, nbytes) == pytest.approx(want, rel=1e-12)
    assert allreduce_ms(c, ["nv:0"], nbytes) == 0.0


def test_the_reduction_adds_its_own_time_to_the_ring() -> None:
    data = copy.deepcopy(RACK)
    data["servers"][1]["device"]["reduce_gbps"] = 8  # the V100 servers' backend sums slowly
    c = Cluster.from_dict(data)
    nbytes = 100_000_000
    devs = ["pcie0:0", "pcie0:1", "pcie0:2", "pcie0:3"]
    ring = 2 * 3 / 4 * nbytes / (64 * BYTES_PER_MS_PER_GBPS) + 2 * 3 * 2.0 / 1e3
    reduce = 3 / 4 * nbytes / (8 * BYTES_PER_MS_PER_GBPS)  # each rank reduces (n-1)/n of it
    assert allreduce_ms(c, devs, nbytes) == pytest.approx(ring + reduce, rel=1e-12)
    # one slow reducer in the ring sets the pace; the A100s alone reduce for free
    mixed = ["nv:0", "pcie0:0"]
    assert reduce_ms_per_byte(c, mixed) == pytest.approx(1 / 2 / (8 * BYTES_PER_MS_PER_GBPS))
    assert reduce_ms_per_byte(c, ["nv:0", "nv:1"]) == 0.0
    assert reduce_ms_per_byte(c, ["pcie0:0"]) == 0.0
    assert Cluster.from_dict(yaml.safe_load(c.to_yaml())) == c
    assert "reduce_gbps" not in yaml.safe_load(c.to_yaml())["servers"][0]["device"]
    local = Cluster.local(2, gbps=30, latency_us=100, reduce_gbps=10)
    assert local.devices[0].spec.reduce_gbps == 10
    assert Cluster.from_dict(local.to_dict()) == local
    data["servers"][1]["device"]["reduce_gbps"] = 0
    with pytest.raises(ClusterError, match="reduce_gbps must be > 0"):
        Cluster.from_dict(data)


def test_launcher_nodes_must_be_the_files_servers() -> None:
    c = Cluster.from_dict(RACK)  # nv (8 devices), pcie0 (8), pcie1 (8)
    c.validate_nodes(3, 8)
    c.validate_nodes(1, 5)  # one node: ranks are simply the first devices
    # 4 processes per node: node 1's ranks 4..7 would be planned as nv:4..nv:7
    with pytest.raises(ClusterError, match=r"'nv' \(launcher node 0\) has 8 devices but 4 "
                       r"processes.*as many processes per node as each server has GPUs"):
        c.validate_nodes(2, 4)
    with pytest.raises(ClusterError, match="3 server instances but the run has 4 nodes"):
        c.validate_nodes(4, 6)
    one = copy.deepcopy(RACK)
    one["servers"] = [{**RACK["servers"][0], "gpus": 16, "levels": [{"size": 16, "gbps": 100}]}]
    with pytest.raises(ClusterError, match="1 server instances but the run has 2 nodes"):
        Cluster.from_dict(one).validate_nodes(2, 8)  # node 1 is another machine
    data = copy.deepcopy(RACK)
    data["servers"][1]["gpus"] = 16  # pcie0/pcie1: 16 devices; only the last node may be bigger
    data["servers"][1]["levels"][-1]["size"] = 16
    bigger = Cluster.from_dict(data)
    bigger.validate_nodes(2, 8)  # node 1 = pcie0, half of it used
    with pytest.raises(ClusterError, match=r"'pcie0' \(launcher node 1\) has 16 devices"):
        bigger.validate_nodes(3, 8)


def test_validate_world_size() -> None:
    c = Cluster.from_dict(RACK)
    c.validate_world_size(24)
    c.validate_world_size(8)
    with pytest.raises(ClusterError, match=r"24 devices but 25 processes.*at most 24"):
        c.validate_world_size(25)
    with pytest.raises(ClusterError, match=r"24 devices but 8 processes.*exactly 24"):
        c.validate_world_size(8, exact=True)
