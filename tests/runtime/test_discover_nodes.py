"""Two torchrun "nodes" on 127.0.0.1 with distinct host identities are discovered as two
servers, each with its own link level and the network between them; the written cluster.yaml
loads back through the cluster loader and plans the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.search import search_plan
from lightning_autopipe.profile import Profile
from tests._launch import free_port, launch_env

ROOT = Path(__file__).resolve().parents[2]
# Its ranks discover and plan from the profiles they take, but no assertion depends on the
# timings: the servers come from the host names, each 2-device server has one link level
# whatever it measures, and the plan is compared with one re-made from the files written. So
# it runs beside the launch lane like any other ranks test.
pytestmark = [pytest.mark.slow, pytest.mark.ranks]




def test_two_nodes_are_two_servers_and_the_written_cluster_plans_the_same(tmp_path):
    port = free_port()
    nodes = []
    for node, host in enumerate(("node-a", "node-b")):
        env = launch_env({"AUTOPIPE_HOST": host})
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
             "tests/runtime/_discover_node.py", str(tmp_path)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    try:
        outputs = [n.communicate(timeout=300)[0] for n in nodes]
    finally:  # a node whose peer died would otherwise wait for it
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait()
    for n, out in zip(nodes, outputs):
        assert n.returncode == 0, out[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert [(name, gpus) for name, gpus, _ in r["servers"]] == [("node-a", 2), ("node-b", 2)]
    assert all(len(levels) == 1 for _, _, levels in r["servers"])
    assert 0 < r["network_gbps"] < float("inf")
    folder = tmp_path / "autopipe"
    cluster = Cluster.load(folder / "cluster.yaml")
    assert [d.name for d in cluster.devices] == ["node-a:0", "node-a:1", "node-b:0", "node-b:1"]
    assert cluster.bandwidth_gbps("node-a:1", "node-b:0") == pytest.approx(r["network_gbps"])
    ran = Plan.from_dict(r["plan"])
    again = search_plan(Profile.load(folder / "profile.json"), cluster,
                        [d.name for d in cluster.devices], 8, num_stages=2)
    keys = ("num_microbatches", "startup_slices", "drain_slices", "schedule", "iteration_ms")
    assert [s.blocks for s in again.stages] == [s.blocks for s in ran.stages]
    assert [s.devices for s in again.stages] == [s.devices for s in ran.stages]
    assert {k: getattr(again, k) for k in keys} == pytest.approx({k: getattr(ran, k) for k in keys})
