"""The failure board on a real c10d store: a rank that reads it after rank 0 (the store's host)
has exited is told so, instead of blaming the innocent peer it was waiting on (one process: the
store's server and a client, as rank 0 and another rank hold them)."""

from __future__ import annotations

import gc
from datetime import timedelta

import torch.distributed as dist

from lightning_autopipe.runtime.failure import GONE, FailureBoard, pipeline_failure
from tests._launch import free_port


def _stores() -> tuple[dist.TCPStore, dist.TCPStore]:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    return server, dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=5))


def test_a_posted_failure_is_what_the_other_ranks_report():
    server, client = _stores()
    FailureBoard(server, "p").post("rank 1 (stage 1) failed in forward 1F0.0: boom")
    err = pipeline_failure(FailureBoard(client, "p"), TimeoutError("timed out"),
                           where="rank 2", what="receive of activations", when="step 1",
                           peer=1, communication=True)
    assert "because rank 1 (stage 1) failed in forward 1F0.0: boom" in str(err)


def test_a_board_whose_host_has_exited_blames_no_peer():
    server, client = _stores()
    board = FailureBoard(client, "q")
    del server
    gc.collect()
    assert board.first(wait_s=0.1) is GONE
    err = pipeline_failure(board, TimeoutError("timed out"), where="rank 3",
                           what="receive of activations", when="step 1", peer=2,
                           communication=True)
    assert "because rank 0, which holds the job's failure board, is gone" in str(err)
    assert "rank 2 has probably died" not in str(err)
    # waiting on rank 0 itself, the board's host: rank 0 is the one that died or hung
    err = pipeline_failure(board, TimeoutError("timed out"), where="rank 1",
                           what="receive of activations", when="step 1", peer=0,
                           communication=True)
    assert "rank 0 has probably died or hung" in str(err)


def test_a_collective_lightning_asks_for_names_the_peer_that_failed(monkeypatch):
    """A rank whose hook raised (an epoch-end hook on rank 0) leaves its peer in Lightning's
    reduction of a logged value; the peer's error names rank 0's failure, not the transport's
    "Connection closed by peer"."""
    import pytest

    from lightning_autopipe import AutoPipeStrategy
    from lightning_autopipe.errors import PipelineRuntimeError

    server, client = _stores()
    FailureBoard(server, "c").post("rank 0 failed: RuntimeError: stack expects a non-empty "
                                   "TensorList")
    strategy = AutoPipeStrategy()
    monkeypatch.setattr(strategy, "_failure_board", lambda: FailureBoard(client, "c"))

    def closed(*args, **kwargs):
        raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:4242")

    with pytest.raises(PipelineRuntimeError, match=r"stopped in Lightning's barrier of the run "
                       r"because rank 0 failed: RuntimeError: stack expects a non-empty"):
        strategy._collective("Lightning's barrier", closed)

    def wrong(*args, **kwargs):  # not a transport failure: the rank's own, untouched
        raise ValueError("a bad value")

    with pytest.raises(ValueError, match="a bad value"):
        strategy._collective("Lightning's barrier", wrong)
