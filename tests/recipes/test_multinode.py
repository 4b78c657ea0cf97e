"""Two torchrun "nodes" on 127.0.0.1 train exactly like one 4-process run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._launch import free_port
from tests.recipes._run import ROOT, TINY_GPT, env, losses, run

pytestmark = [pytest.mark.slow, pytest.mark.launch]

STEPS = ["trainer.max_steps=3", "strategy.startup_slices=2", *TINY_GPT]


def test_two_torchrun_nodes_match_one_four_process_run(tmp_path):
    ref_dir, multi_dir = tmp_path / "one_node", tmp_path / "two_nodes"
    # Reference: Lightning's own launcher starts 4 local ranks.
    run(["recipes/train_gpt.py", *STEPS, "trainer.devices=4", f"run_dir={ref_dir}"])
    plan = ref_dir / "plan.json"  # the same layout for both (a saved plan, as users pass it)
    assert plan.exists()
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes=2", "--nproc-per-node=2", f"--node-rank={rank}",
                "--master-addr=127.0.0.1", f"--master-port={port}",
                "recipes/train_gpt.py", *STEPS, f"strategy.plan={plan}",
                "trainer.devices=2", "trainer.num_nodes=2", f"run_dir={multi_dir}",
            ],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:  # a node whose peer died would otherwise wait for it forever
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-6000:]
    ref, multi = losses(ref_dir), losses(multi_dir)
    assert sorted(ref) == sorted(multi) == [0, 1, 2]
    for step in ref:
        assert multi[step] == pytest.approx(ref[step], rel=1e-5), step
