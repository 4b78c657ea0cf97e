"""The test harness itself: shared gloo worlds report a failing rank and recover; shared
Lightning worlds collect the selected modules' cases in order."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tests._launch import free_port
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


@pytest.mark.ranks
def test_a_world_whose_port_was_taken_starts_on_another(monkeypatch):
    """The port a world found free is taken before its rank 0 binds it (another process got
    it first): the start is retried on a new port instead of failing this and every later
    case of the size."""
    import socket

    import tests._gloo as G

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(G, "free_port", lambda: next(ports, None) or free_port())
    world = G.GlooWorld(2, timeout_s=30)
    try:
        assert world.run(_sum_of_ranks, 0) == [(0, 1), (1, 1)]
    finally:
        world.close()
        taken.close()


def test_world_cases_merge_per_size_without_repeats_and_late_modules_last():
    a = SimpleNamespace(WORLD_CASES={2: ["m.a:x", "m.a:y"], 4: ["m.a:z"]})
    late = SimpleNamespace(WORLD_CASES={2: ["m.c:w"]}, WORLD_ORDER=90)
    b = SimpleNamespace(WORLD_CASES={2: ["m.b:x", "m.a:x"]})
    none = SimpleNamespace()
    assert collect_cases([late, a, none, b]) == {2: ["m.a:x", "m.a:y", "m.b:x", "m.c:w"],
                                                 4: ["m.a:z"]}


def _start_world(tmp_path, patch: str) -> subprocess.CompletedProcess:
    """:mod:`tests._world` launched on 2 ranks through ``patch`` (Python run in the launching
    process first), with pipes that every rank holds open, as the shared worlds once ran."""
    from tests._launch import ROOT, launch_env, run_script

    start = (f"import runpy, sys; import tests._launch as L; {patch}; "
             "runpy.run_path(str(L.ROOT / 'tests' / '_world.py'), run_name='__main__')")
    return run_script(["-c", start, tmp_path, 2, "none:case"], timeout=120, env=launch_env(),
                      cwd=ROOT, check=False)


@pytest.mark.ranks
@pytest.mark.parametrize("failure", ["rank 0's port taken", "rank 1 never starts"])
def test_a_lightning_world_whose_ranks_cannot_start_ends_at_once(tmp_path, failure):
    """A rank of a shared Lightning world (:mod:`tests._world`) fails before the start barrier:
    rank 0's start store finds its port taken, or the rank it started dies at once. The
    launch ends at once, instead of the surviving ranks waiting out their start timeout
    (600 s) while pytest waits on their pipes."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    if failure == "rank 0's port taken":
        patch = f"L.free_port = lambda: {taken.getsockname()[1]}"
        says = "EADDRINUSE"
    else:  # the other rank is forked by rank 0: it dies as soon as it exists
        patch = "import os; fork = os.fork; os.fork = lambda: fork() or os._exit(1)"
        says = "a rank never started"
    try:
        done = _start_world(tmp_path, patch)
    finally:
        taken.close()
    assert done.returncode != 0
    assert says in done.stderr, done.stderr[-3000:]
