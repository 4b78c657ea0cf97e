"""The plan table's labels a user reads: memory in a unit that fits, device types in words."""

from __future__ import annotations

from pathlib import Path

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.report import _bytes, format_plan
from lightning_autopipe.profile import BlockProfile, Profile

ROOT = Path(__file__).resolve().parents[2]


def _profile() -> Profile:
    return Profile("toy", 2, "test", [BlockProfile(f"layer{i}", 1.0 + i % 3, 2.0, 4096, 1024,
                                                   2048) for i in range(6)])


def _discovered() -> Cluster:
    """What discovery writes for one host whose rank 1 is measurably slower."""
    return Cluster.from_dict({
        "name": "discovered",
        "servers": [{"name": "host", "count": 1, "gpus": 2,
                     "device": {"name": "cpu AMD EPYC", "speed": 1.0, "memory_gb": 16},
                     "devices": {1: {"name": "cpu AMD EPYC (slower 1)", "speed": 0.71,
                                     "memory_gb": 16}},
                     "levels": [{"size": 2, "gbps": 2.0}]}],
    })


def test_memory_is_shown_in_a_unit_that_fits():
    assert _bytes(14 * 2**20) == "14.0 MiB"
    assert _bytes(3 * 2**30) == "3.0 GiB"
    assert _bytes(2048) == "2.0 KiB"
    table = format_plan(make_plan(_profile(), _discovered(), 16, num_stages=2), _profile(),
                        _discovered())
    assert "0.0 GiB" not in table


def test_a_discovered_device_type_names_its_ranks_and_measured_speed():
    cluster = _discovered()
    plan = make_plan(_profile(), cluster, 16, num_stages=2)
    table = format_plan(plan, _profile(), cluster)
    assert "device type (speed)" in table
    assert "measured 0.71x the fastest" in table
    assert "measured 1.00x the fastest" in table
    assert "(slower 1)" not in table  # the internal class name says nothing to a user
    slow = next(s for s, st in enumerate(plan.stages) if "host:1" in st.devices)
    row = next(ln for ln in table.splitlines() if ln.strip().startswith(f"{slow} "))
    assert "rank 1, measured 0.71x the fastest" in row, table


def test_a_declared_device_type_keeps_its_name_and_declared_speed():
    cluster = Cluster.load(ROOT / "conf/cluster/mixed_rack.yaml")
    plan = make_plan(_profile(), cluster, 64, num_stages=2)
    table = format_plan(plan, _profile(), cluster)
    assert "x the reference" in table
    assert any(name in table for name in ("A100-40GB", "V100-32GB"))
