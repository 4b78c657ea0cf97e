"""The test harness itself: shared gloo worlds report a failing rank and recover; shared
Lightning worlds collect the selected modules' cases in order; a rest shard behind the launch
lane waits for it before starting processes."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tests._worlds import collect_cases


def _sum_of_ranks(rank: int, world: int, offset: int) -> tuple[int, int]:
    import torch

    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    return rank, int(value)


def _raises_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one breaks on purpose")


def test_a_gloo_world_runs_a_case_on_every_rank_with_the_group_ready(gloo):
    assert gloo(2).run(_sum_of_ranks, 10) == [(0, 21), (1, 21)]


def test_a_failing_rank_fails_the_case_with_its_traceback_and_the_world_recovers(gloo):
    with pytest.raises(pytest.fail.Exception, match="(?s)rank 1: .*rank one breaks on purpose"):
        gloo(2).run(_raises_on_rank_1)
    assert gloo(2).run(_sum_of_ranks, 0) == [(0, 1), (1, 1)]  # a fresh world serves the next


def test_world_cases_merge_per_size_without_repeats_and_late_modules_last():
    a = SimpleNamespace(WORLD_CASES={2: ["m.a:x", "m.a:y"], 4: ["m.a:z"]})
    late = SimpleNamespace(WORLD_CASES={2: ["m.c:w"]}, WORLD_ORDER=90)
    b = SimpleNamespace(WORLD_CASES={2: ["m.b:x", "m.a:x"]})
    none = SimpleNamespace()
    assert collect_cases([late, a, none, b]) == {2: ["m.a:x", "m.a:y", "m.b:x", "m.c:w"],
                                                 4: ["m.a:z"]}


_BEHIND_SHARD = """
import os, sys
sys.path.insert(0, sys.argv[1])
os.environ.update(AUTOPIPE_SUITE_LOCK=sys.argv[2], AUTOPIPE_SUITE_BEHIND=sys.argv[3])
from tests import _machine
_machine.configure()
print(os.sched_getscheduler(0) == os.SCHED_IDLE, _machine.behind(), flush=True)
_machine.begin_test()
_machine.need_the_machine()
print(os.sched_getscheduler(0) == os.SCHED_OTHER, _machine.behind(), flush=True)
_machine.end_test()
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling policies")
def test_a_shard_behind_the_launch_lane_runs_idle_and_starts_processes_only_after_it(tmp_path):
    """tests/suite.py holds a file locked while the launch lane runs: a shard started behind
    it runs as SCHED_IDLE, and a test of its that starts processes waits for the lock and then
    runs at the ordinary policy."""
    from tests._launch import ROOT, launch_env

    behind = tmp_path / "launch.running"
    with open(behind, "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        shard = subprocess.Popen(
            [sys.executable, "-c", _BEHIND_SHARD, str(ROOT), str(tmp_path / "rest.lock"),
             str(behind)], env=launch_env(), stdout=subprocess.PIPE, text=True)
        try:
            assert shard.stdout.readline().split() == ["True", "True"]
            time.sleep(1.0)
            assert shard.poll() is None  # waiting for the launch lane
        except BaseException:
            shard.kill()
            raise
    out, _ = shard.communicate(timeout=60)
    assert shard.returncode == 0
    assert out.split() == ["True", "False"]
