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
