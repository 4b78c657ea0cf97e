"""Discovery's assembly (no processes): reports and measured links -> a cluster that plans."""

from __future__ import annotations

import math

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ClusterError
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.profile import BlockProfile, Profile
from lightning_autopipe.runtime.discover import (
    LinkFigures,
    RankReport,
    assemble,
    compare_with_declared,
    link_pairs,
    slower_ranks,
    write_cluster,
)

GIB = 2**30


def _profile(scale: float, n: int = 12, slow_blocks: float = 1.0) -> Profile:
    blocks = [BlockProfile(f"b{i}", scale * (slow_blocks if i % 2 else 1.0),
                           2 * scale * (slow_blocks if i % 2 else 1.0), 10**5, 10**4, 10**5)
              for i in range(n)]
    return Profile("m", 4, "cpu", blocks, fingerprint="f")


def _report(rank: int, host: str, scale: float, device: str = "cpu X") -> RankReport:
    return RankReport(rank, host, device, 8 * GIB, 1, _profile(scale))


LINK = LinkFigures(100.0, 20.0)


def test_a_slowed_rank_is_its_own_device_type_and_gets_less_work():
    reports = [_report(0, "h", 1.0), _report(1, "h", 2.0)]
    cluster, ref = assemble(reports, {(0, 1): LINK}, reduce_gbps=9.0)
    assert [s.name for s in cluster.servers] == ["h"]
    specs = [d.spec for d in cluster.devices]
    assert len({s.name for s in specs}) == 2
    assert specs[0].speed == 1.0
    assert specs[1].speed == pytest.approx(0.5)
    # one device name: a slowed class is priced by its speed (a uniform slowdown)
    assert all(s.profile is None for s in specs)
    assert ref.blocks == reports[0].profile.blocks
    assert specs[0].reduce_gbps == 9.0
    lv = cluster.servers[0].levels
    assert (lv[0].size, lv[0].gbps, lv[0].latency_us) == (2, 20.0, 100.0)
    plan = make_plan(ref, cluster, 16, num_stages=2, replicas=1)
    work = {st.devices[0]: st.blocks[1] - st.blocks[0] for st in plan.stages}
    assert work["h:1"] < work["h:0"]


def test_other_device_models_keep_their_own_profiles():
    old = RankReport(1, "h", "V100", 8 * GIB, 0, _profile(2.0, slow_blocks=3.0))
    cluster, ref = assemble([_report(0, "h", 1.0, "H100"), old], {(0, 1): LINK})
    specs = [d.spec for d in cluster.devices]
    assert [s.name for s in specs] == ["H100", "V100"]
    assert specs[0].profile is ref
    assert specs[1].profile.blocks == old.profile.blocks
    assert specs[1].speed == pytest.approx(ref.total_ms / old.profile.total_ms)


def test_the_ranks_to_confirm_are_those_the_cluster_types_as_slower_classes():
    """``slower_ranks`` (which the measuring phase profiles again) names exactly the ranks
    that the assembled cluster gives a slower class of their device name."""
    reports = [_report(0, "h", 1.0), _report(1, "h", 1.1), _report(2, "h", 1.5),
               _report(3, "h", 3.0), RankReport(4, "h", "V100", 8 * GIB, 0, _profile(2.0))]
    cluster, _ = assemble(reports, {(0, 1): LINK, (0, 2): LINK})
    fastest = cluster.devices[0].spec.name
    classed = [d.rank for d in cluster.devices
               if d.spec.name not in (fastest, "V100")]
    assert slower_ranks(reports) == classed == [2, 3]
    assert slower_ranks(reports[:2]) == []


def test_ranks_within_noise_are_one_type_and_plan_as_the_local_cluster():
    reports = [_report(0, "h", 1.0), _report(1, "h", 1.1)]
    cluster, ref = assemble(reports, {(0, 1): LINK})
    assert len({d.spec.name for d in cluster.devices}) == 1
    assert all(d.spec.profile is None and d.spec.speed == 1.0 for d in cluster.devices)
    local = Cluster.local(2, device_name="cpu X", gbps=LINK.gbps, latency_us=LINK.latency_us,
                          memory_gb=8.0)
    got = search_plan(ref, cluster, [d.name for d in cluster.devices], 16)
    want = search_plan(ref, local, [d.name for d in local.devices], 16)
    names = {"search_ms": 0, "stages": 0, "peak_memory_bytes": 0}  # device names differ
    assert got.to_dict() | names == want.to_dict() | names
    assert [s.blocks for s in got.stages] == [s.blocks for s in want.stages]
    assert list(got.peak_memory_bytes.values()) == list(want.peak_memory_bytes.values())


def test_two_hosts_are_two_servers_with_their_own_levels_and_the_network_between():
    hosts = ["a", "a", "b", "b"]
    assert link_pairs(hosts) == [(0, 1), (2, 3), (0, 2)]
    links = {(0, 1): LinkFigures(50, 40.0), (2, 3): LinkFigures(60, 30.0),
             (0, 2): LinkFigures(300, 5.0)}
    cluster, _ = assemble([_report(r, h, 1.0) for r, h in enumerate(hosts)], links)
    assert [(s.name, s.gpus) for s in cluster.servers] == [("a", 2), ("b", 2)]
    assert [s.levels[0].gbps for s in cluster.servers] == [40.0, 30.0]
    assert cluster.network_gbps == 5.0
    assert cluster.network_latency_us == 300
    assert cluster.bandwidth_gbps("a:1", "b:0") == 5.0


def test_levels_of_an_eight_device_server_follow_the_pairs_measured():
    hosts = ["g"] * 8
    assert link_pairs(hosts) == [(0, 1), (0, 2), (0, 4)]
    links = {(0, 1): LinkFigures(2, 300.0), (0, 2): LinkFigures(5, 250.0),
             (0, 4): LinkFigures(9, 40.0)}
    cluster, _ = assemble([_report(r, "g", 1.0, "H100") for r in range(8)], links)
    # the 2- and 4-groups measure alike (within 25%): one level of 4, then the socket level
    assert [(lv.size, lv.gbps) for lv in cluster.servers[0].levels] == [(4, 250.0), (8, 40.0)]


def test_written_cluster_loads_back_and_plans_the_same(tmp_path):
    reports = [_report(0, "h", 1.0, "A"), _report(1, "h", 1.9, "B")]
    cluster, ref = assemble(reports, {(0, 1): LINK})
    path = write_cluster(cluster, tmp_path / "autopipe")
    again = Cluster.load(path)
    assert again.to_dict() == cluster.to_dict()
    assert (tmp_path / "autopipe" / again.device("h:1").spec.profile_path).exists()
    a = make_plan(ref, cluster, 16, num_stages=2, replicas=1)
    b = make_plan(ref, again, 16, num_stages=2, replicas=1)
    assert a.to_dict() | {"search_ms": 0} == b.to_dict() | {"search_ms": 0}


def test_ranks_of_one_host_must_be_consecutive():
    with pytest.raises(ClusterError, match=r"not consecutive.*node by node"):
        assemble([_report(0, "a", 1), _report(1, "b", 1), _report(2, "a", 1)], {})


def test_a_declared_file_that_contradicts_the_measurement_is_reported_with_both_figures():
    declared = Cluster.local(2)  # both at speed 1.0
    lines = compare_with_declared(declared, [_report(0, "h", 1.0), _report(1, "h", 2.0)])
    assert len(lines) == 1
    assert "rank 1" in lines[0]
    assert "declared relative speed 1.00, measured 0.50" in lines[0]
    assert compare_with_declared(declared, [_report(0, "h", 1.0), _report(1, "h", 1.05)]) == []
    rack = Cluster.from_dict({"name": "r", "network_gbps": 10, "servers": [
        {"name": "s", "count": 2, "gpus": 4, "device": {"name": "d", "speed": 1.0,
                                                        "memory_gb": 8},
         "levels": [{"size": 4, "gbps": 10}]}]})
    hosts = [_report(r, h, 1.0) for r, h in enumerate(["x", "x", "y", "y"])]
    lines = compare_with_declared(rack, hosts)
    assert any("host 'x' runs 2 ranks, its server 's0' declares 4 devices" in x for x in lines)


def test_unprofiled_reports_give_a_cluster_priced_by_speed_one():
    reports = [RankReport(0, "h", "cpu X", 8 * GIB, 1), RankReport(1, "h", "cpu X", 8 * GIB, 1)]
    cluster, ref = assemble(reports, {(0, 1): LINK})
    assert ref is None
    assert math.isinf(cluster.devices[0].spec.reduce_gbps)


def test_cpu_ranks_reading_their_host_s_free_memory_either_side_of_a_gib_are_one_device():
    """A CPU rank reports its host's free memory, read at its own moment: a slowed rank
    whose reading fell on the other side of a GiB must still be compared with its peer
    (it was once taken for another device of the same name, and both got one speed)."""
    reports = [RankReport(0, "h", "cpu X", int(6.02 * GIB), 1, _profile(1.0), True),
               RankReport(1, "h", "cpu X", int(5.98 * GIB), 1, _profile(2.0), True)]
    cluster, _ = assemble(reports, {(0, 1): LINK})
    speeds = [d.spec.speed for d in cluster.devices]
    assert speeds == [1.0, pytest.approx(0.5)]
    assert all(d.spec.profile is None for d in cluster.devices)  # one device name


def test_one_device_in_two_memory_sizes_gives_each_size_its_own_type():
    reports = [RankReport(0, "h", "GPU", 80 * GIB, 0, _profile(1.0)),
               RankReport(1, "h", "GPU", 40 * GIB, 0, _profile(2.0))]
    cluster, _ = assemble(reports, {(0, 1): LINK})
    specs = [d.spec for d in cluster.devices]
    assert [s.name for s in specs] == ["GPU 80 GiB", "GPU 40 GiB"]
    assert [s.speed for s in specs] == [1.0, pytest.approx(0.5)]
