"""Link calibration of the local cluster: the fit, and real gloo ranks agreeing on the figures."""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.pricing import allreduce_ms
from lightning_autopipe.runtime import calibrate
from lightning_autopipe.runtime.calibrate import (
    MIN_LATENCY_US,
    fit_link,
    fit_reduce,
    measure_link,
    measure_reduce,
)
from lightning_autopipe.runtime.pipeline import resolve_cluster
from tests._gloo import run_forked
from tests._launch import free_port, init_gloo

CPU = torch.device("cpu")
KB, MB = 2**10, 2**20


# ------------------------------------------------------------------------------ the fit
def test_fit_link_recovers_an_exact_line():
    lat_s, bps = 80e-6, 16e9 / 8  # 80 us, 16 Gb/s
    t = lambda n: lat_s + n / bps  # noqa: E731
    latency_us, gbps = fit_link((4 * KB, t(4 * KB)), (4 * MB, t(4 * MB)))
    assert latency_us == pytest.approx(80.0)
    assert gbps == pytest.approx(16.0)


def test_fit_link_floors_noisy_fits():
    # The large message no slower than the small: bandwidth is what the large one alone shows.
    latency_us, gbps = fit_link((4 * KB, 2e-3), (4 * MB, 1e-3))
    assert gbps == pytest.approx(4 * MB * 8 / 1e-3 / 1e9)
    assert MIN_LATENCY_US <= latency_us <= 2e3
    # A steep slope (negative intercept): latency floored, bandwidth >= n / t(n) of the large.
    latency_us, gbps = fit_link((4 * KB, 1e-6), (4 * MB, 1e-3))
    assert latency_us == MIN_LATENCY_US
    assert gbps >= 4 * MB * 8 / 1e-3 / 1e9
    with pytest.raises(ValueError, match="larger"):
        fit_link((4 * MB, 1e-3), (4 * KB, 1e-4))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fit_reduce_recovers_the_rate_the_cluster_prices(world):
    # The reference: what pricing.allreduce_ms predicts for a known reduction rate.
    devs = [f"local:{i}" for i in range(world)]
    slow = Cluster.local(world, gbps=30, latency_us=100, reduce_gbps=9)
    ms = allreduce_ms(slow, devs, 16 * MB)
    assert fit_reduce(world, 16 * MB, ms / 1e3, 100, 30) == pytest.approx(9)
    # An all-reduce the link explains (to within noise) reduces for free.
    free = allreduce_ms(Cluster.local(world, gbps=30, latency_us=100), devs, 16 * MB)
    assert fit_reduce(world, 16 * MB, free / 1e3, 100, 30) == math.inf
    assert fit_reduce(world, 16 * MB, 1.02 * free / 1e3, 100, 30) == math.inf
    assert fit_reduce(1, 16 * MB, 1.0, 100, 30) == math.inf


def test_no_process_group_keeps_the_defaults():
    assert not dist.is_initialized()
    assert measure_link() is None
    assert measure_reduce((100.0, 30.0)) is None
    got, default = resolve_cluster(None, 2, CPU), Cluster.local(2)
    assert got.bandwidth_gbps("local:0", "local:1") == default.bandwidth_gbps("local:0", "local:1")
    assert got.latency_us("local:0", "local:1") == default.latency_us("local:0", "local:1")


def test_a_cluster_file_must_match_the_launched_nodes(monkeypatch):
    from pathlib import Path

    from lightning_autopipe.errors import ClusterError
    from lightning_autopipe.runtime import log as runtime_log

    rack = Path(__file__).resolve().parents[2] / "conf" / "cluster" / "pcie_2x8.yaml"
    assert resolve_cluster(str(rack), 16, CPU, num_nodes=2).num_devices == 16
    with pytest.raises(ClusterError, match="as many processes per node as each server has GPUs"):
        resolve_cluster(str(rack), 8, CPU, num_nodes=2)  # 2 nodes x 4 processes
    said: list[str] = []
    monkeypatch.setattr(runtime_log, "rank_zero_info", lambda msg, *a, **k: said.append(msg))
    resolve_cluster(str(rack), 2, CPU)  # a larger file: say which devices the run is planned on
    assert said == [
        "cluster 'pcie-2x8' describes 16 devices; this run of 2 processes is planned on the "
        "first 2 in file order (pcie0:0 .. pcie0:1)"
    ]


# ---------------------------------------------------------------------------- multi-process
def _link(cluster: Cluster, a: int, b: int) -> tuple[float, float]:
    return cluster.latency_us(f"local:{a}", f"local:{b}"), cluster.bandwidth_gbps(
        f"local:{a}", f"local:{b}"
    )


def _check_same_everywhere(value: object) -> None:
    seen: list[object] = [None] * dist.get_world_size()  # every rank checks every rank's value
    dist.all_gather_object(seen, value)
    assert all(v == seen[0] for v in seen), seen


def _check_sane(link: tuple[float, float] | None) -> None:
    assert link is not None
    latency_us, gbps = link
    assert math.isfinite(latency_us)
    assert math.isfinite(gbps)
    assert 0 < latency_us < 50_000  # generous: a correctness test, not a speed test
    assert gbps > 0.01


def _case(rank: int, world: int) -> None:
    """On a shared gloo world (tests._gloo)."""
    link = measure_link()
    _check_sane(link)
    _check_same_everywhere(link)

    # resolve_cluster builds the local cluster from what measure_link and measure_reduce
    # returned on this rank.
    returned: dict[str, list] = {"measure_link": [], "measure_reduce": []}
    real = {name: getattr(calibrate, name) for name in returned}

    def recording(name):
        def call(*args, **kwargs):
            returned[name].append(real[name](*args, **kwargs))
            return returned[name][-1]

        return call

    for name in returned:
        setattr(calibrate, name, recording(name))
    try:
        cluster = resolve_cluster(None, world, CPU)
    finally:
        for name, fn in real.items():
            setattr(calibrate, name, fn)
    assert len(returned["measure_link"]) == 1
    _check_sane(returned["measure_link"][0])
    assert cluster.num_devices == world
    assert len(returned["measure_reduce"]) == 1
    reduce = returned["measure_reduce"][0]
    assert reduce > 0  # a rate in Gb/s, or inf: the link explains the whole all-reduce
    assert {d.spec.reduce_gbps for d in cluster.devices} == {reduce}
    _check_same_everywhere(reduce)
    for a in range(world):
        for b in range(world):
            if a != b:
                assert _link(cluster, a, b) == returned["measure_link"][0]
    _check_same_everywhere(_link(cluster, 0, 1))
    assert _link(resolve_cluster(None, world, CPU, calibrate=False), 0, 1) == _link(
        Cluster.local(world), 0, 1
    )

    if world >= 3:
        # A group of ranks 1 and 2: rank 0 is no member, the group's rank 0 is global 1.
        pair = dist.new_group([1, 2])
        alone = dist.new_group([2])
        sub = measure_link(pair)
        if rank == 0:
            assert sub is None
        else:
            _check_sane(sub)
        seen: list[object] = [None] * world
        dist.all_gather_object(seen, sub)
        assert seen[1] == seen[2]
        assert measure_link(alone) is None  # one rank (or no member): nothing to measure
        sub_reduce = measure_reduce((100.0, 30.0), pair)
        assert (sub_reduce is None) == (rank == 0)
        assert measure_reduce((100.0, 30.0), alone) is None


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_rank_zeros_link(gloo, world):
    gloo(world).run(_case)


def _timeout_worker(rank: int, port: int) -> None:
    init_gloo(rank, 2, port, timeout_s=3)
    store = dist.distributed_c10d._get_default_store()  # rank 0 serves it: it leaves last
    if rank == 1:  # never takes part: rank 0 must fail within the group's timeout
        deadline = time.monotonic() + 60
        while not store.check(["rank0-done"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.destroy_process_group()
        store.set("rank1-gone", "1")
        return
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="(?i)timed out|closed"):
            measure_link()
        assert time.monotonic() - start < 30
    finally:
        store.set("rank0-done", "1")
        store.wait(["rank1-gone"], timedelta(seconds=60))
        dist.destroy_process_group()


@pytest.mark.quiet  # asserts the time a collective takes to fail
def test_a_missing_peer_fails_instead_of_hanging():
    run_forked(_timeout_worker, free_port())
