"""Start-up failures of the process group end every rank, naming the cause.

A rank started by another ends with it while the process group forms
(:func:`lightning_autopipe.runtime.failure.ending_with_launcher`).

torch's store connects holding the interpreter lock, so the launcher watch's thread cannot run
then: a rank 0 that failed to bind its port (another program listened there) left its child
waiting on that port as long as the program lived. Here a launcher starts a child that waits
inside the block as a joining rank would, and exits; and a child whose launcher had already
exited before it got there ends at once. A rank left waiting for others that never come is
told which and what to do.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests._launch import ROOT, launch_env

pytestmark = pytest.mark.ranks

_CHILD = ("import time; from lightning_autopipe.runtime.failure import ending_with_launcher\n"
          "with ending_with_launcher():\n"
          "    print('waiting', flush=True); time.sleep(120)\n")
#: starts the child as the strategy's launcher does (its pid in the child's environment)
_LAUNCHER = ("import os, subprocess, sys, time\n"
             "env = dict(os.environ, AUTOPIPE_LAUNCHER_PID=str(os.getpid()))\n"
             "child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env)\n"
             "print(child.pid, flush=True); time.sleep(float(sys.argv[2]))\n")


def _ended_within(pid: int, seconds: float) -> bool:
    import psutil

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_a_rank_waiting_to_join_ends_when_its_launcher_exits():
    # the launcher exits 8 s after the start, while the child (importing torch, then in the
    # block) waits; it must not outlive the launcher by more than a moment
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _CHILD, "8"], cwd=ROOT,
                                env=launch_env(), stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    launcher.wait(timeout=60)
    try:
        assert _ended_within(child, 10), "the child outlived its launcher"
    finally:
        subprocess.run(["kill", "-9", str(child)], capture_output=True)


def test_a_rank_whose_launcher_is_already_gone_ends_at_once():
    """The launcher's pid (set by the strategy's launcher for the ranks it starts) is not the
    parent any more: the child says so and ends instead of joining."""
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env=launch_env({"AUTOPIPE_LAUNCHER_PID": "999999999"}))
    assert done.returncode == 1
    assert "launching process has exited before this rank joined" in done.stderr
    assert "waiting" not in done.stdout


def test_ranks_that_never_join_are_named_with_the_fix(monkeypatch):
    """Rank 0 of 2 waits for a rank that never starts (a node not launched, devices unlike the
    launch): torch's DistStoreError and its C++ frames named no rank and no fix."""
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_autopipe import AutoPipeStrategy
    from lightning_autopipe.errors import PipelineRuntimeError
    from tests._launch import free_port

    port = free_port()
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                       "LOCAL_RANK": "0", "NODE_RANK": "0", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    strategy = AutoPipeStrategy(timeout=2)
    strategy.accelerator = CPUAccelerator()
    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    with pytest.raises(PipelineRuntimeError, match=rf"rank 0: the 2 ranks did not all join the "
                       rf"process group at 127.0.0.1:{port} within 2 s .*start every rank"):
        strategy.setup_environment()
