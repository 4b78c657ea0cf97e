"""Where pipeline messages travel: the transport rule, and host staging over real gloo ranks.

gloo's send/recv read and write host memory, so a stage on a device gloo cannot move is staged
through the CPU. Without a GPU the ``meta`` device plays that device here: a message received
for a ``meta`` stage must arrive on ``meta`` (shapes, dtypes, gradient leaves) after travelling
on the CPU, and a send from such a stage must put its header on the CPU (gloo would otherwise
be handed a tensor without host memory). ``tests/gpu`` runs the same path with CUDA stages.
"""

from __future__ import annotations

import pytest
import torch

from lightning_autopipe.runtime.calibrate import link_device
from lightning_autopipe.runtime.comm import recv_tensors, send_tensors, transport_device

CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", CPU, CPU),
        ("gloo", torch.device("cuda", 0), CPU),  # staged through the host
        ("GLOO", torch.device("cuda", 1), CPU),
        ("gloo", META, CPU),
        ("nccl", torch.device("cuda", 1), torch.device("cuda", 1)),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 0), torch.device("cuda", 0)),
        ("cpu:gloo,cuda:nccl", CPU, CPU),
        ("mpi", torch.device("cuda", 0), torch.device("cuda", 0)),
        ("mpi", None, CPU),
        ("gloo", None, CPU),
    ],
)
def test_transport_device_per_backend_and_stage_device(backend, device, expected):
    assert transport_device(backend, device) == expected
    if device is not None:  # a device given by name takes the same way
        assert transport_device(backend, str(device)) == expected




def _message() -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(7)
    act = torch.randn(3, 4, generator=g).requires_grad_(True)
    half = torch.randn(2, 5, generator=g).bfloat16()
    return [act, None, torch.randint(0, 9, (3,), generator=g), half]


def _staging_case(rank: int, world: int, out: str) -> None:
    assert link_device(None, META) == CPU  # the link is measured where messages travel
    if rank == 0:
        # a stage on a device gloo cannot move: the header (and any tensor) go via the CPU
        works = send_tensors(_message(), 1, tag=3, device=META, ack=5)
        works += send_tensors(_message(), 1, tag=4, device=CPU)
        assert all(buf.device == CPU for _, buf in works)
        for work, _ in works:
            work.wait()
    else:
        staged, ack = recv_tensors(0, tag=3, device=META)
        plain, _ = recv_tensors(0, tag=4, device=CPU)
        rows = [
            None if t is None else (t.device.type, t.dtype, tuple(t.shape),
                                    t.requires_grad, t.is_leaf)
            for t in staged
        ]
        torch.save({"staged": rows, "ack": ack, "plain": [
            None if t is None else (t.detach().clone(), t.requires_grad) for t in plain
        ]}, out)


def test_messages_of_a_stage_gloo_cannot_move_are_staged_through_the_host(tmp_path, gloo):
    out = str(tmp_path / "received.pt")
    gloo(2).run(_staging_case, out)
    got = torch.load(out)
    sent = _message()
    assert got["ack"] == 5
    # arrived on the stage's device, with shapes and dtypes, a gradient leaf where one was sent
    assert got["staged"] == [
        ("meta", torch.float32, (3, 4), True, True),
        None,
        ("meta", torch.int64, (3,), False, True),
        ("meta", torch.bfloat16, (2, 5), False, True),
    ]
    # the same message for a CPU stage carries the sender's values
    for want, have in zip(sent, got["plain"]):
        if want is None:
            assert have is None
            continue
        value, requires_grad = have
        assert requires_grad == want.requires_grad
        torch.testing.assert_close(value, want.detach(), rtol=0, atol=0)
