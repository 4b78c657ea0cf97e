"""What a strategy's ranks do at exit (:func:`held_pipeline.leave`): wait for every rank, then
destroy the released pipelines' groups and the default group, on a real gloo world."""

from __future__ import annotations

import time

import pytest

from tests._launch import free_port, init_gloo


def _leave_case(rank: int, world: int, ports: list[int], late_s: float) -> dict:
    import torch.distributed as dist

    from lightning_autopipe.lightning import held_pipeline
    from lightning_autopipe.runtime.groups import RankLayout, build_groups

    out = {}
    for failed, port in zip((False, True), ports):
        layout = RankLayout(rank=rank, stage=rank, replica=0,
                            grid=tuple((r,) for r in range(world)))
        groups = build_groups(layout)
        held_pipeline._RELEASED.append(groups)  # a pipeline released before exit
        held_pipeline._FAILED[:] = [True] if failed else []
        if rank == world - 1:
            time.sleep(late_s)  # the last rank reaches its exit late
        start = time.perf_counter()
        held_pipeline.leave(wait_s=30)
        out["failed" if failed else "ok"] = {
            "waited_s": time.perf_counter() - start,
            "initialized": dist.is_initialized(),
            "queued": len(held_pipeline._RELEASED),
            "created": len(groups.created),
        }
        init_gloo(rank, world, port)  # the world serves the next cases
    held_pipeline._FAILED.clear()
    return out


@pytest.mark.quiet  # asserts how long the ranks wait
def test_every_rank_waits_for_the_others_then_destroys_its_groups_and_the_world(gloo):
    late_s = 1.0
    results = gloo(2).run(_leave_case, [free_port(), free_port()], late_s)
    for rank, r in enumerate(results):
        for case in ("ok", "failed"):
            assert not r[case]["initialized"], (rank, case)
            assert r[case]["queued"] == 0, (rank, case)
            assert r[case]["created"] == 0, (rank, case)
    # the early rank waited at its exit for the late one ...
    assert results[0]["ok"]["waited_s"] > 0.8 * late_s
    # ... unless a run failed on it: its peers may be gone, so it leaves at once
    assert results[0]["failed"]["waited_s"] < 0.5 * late_s


def _stuck_case(rank: int, world: int, ports: list[int]) -> dict:
    """Rank 1 reaches its exit 3 s after rank 0, which waits 1 s: once still inside its run
    (a hang in an epoch-end hook), once after its run ended (its own work after ``fit``)."""
    from lightning_autopipe.lightning import held_pipeline

    out = {}
    for inside, port in zip((True, False), ports):
        told: list[str] = []
        held_pipeline.mark_in_run(True)
        if rank == 0 or not inside:
            held_pipeline.mark_in_run(False)  # its teardown ran
        if rank == 1:
            time.sleep(3.0)
        held_pipeline.leave(wait_s=1.0, on_stuck=told.append)
        out["inside" if inside else "after"] = told
        init_gloo(rank, world, port)  # the world serves the next cases
    return out


@pytest.mark.quiet  # times rank 0's wait against rank 1's late exit
def test_a_peer_still_inside_its_run_at_exit_fails_the_job_and_one_after_it_does_not(gloo):
    """Rank 0 is the job's status under Lightning's launcher: a peer hung (or failing) after
    the run's last collective made it end with status 0 and no error; a peer that finished its
    run and does its own work may be late without failing anything."""
    results = gloo(2).run(_stuck_case, [free_port(), free_port()])
    (told,) = results[0]["inside"]
    assert "rank(s) [1] never finished their run" in told
    assert "1 s after rank 0 reached its exit" in told
    assert results[0]["after"] == []
    assert results[1] == {"inside": [], "after": []}  # only rank 0 judges
