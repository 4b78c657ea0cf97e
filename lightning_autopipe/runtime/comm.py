"""Point-to-point transfer of a tuple of tensors with a small shape/dtype header.

``torch.distributed.pipelining`` sizes its receive buffers once, so micro-batches of different
sizes (startup slices) cannot share a step. Here each message is preceded by a fixed-size int64
header that says how many tensors follow and, per tensor, whether it is present, its dtype, its
shape and whether the receiver should treat it as requiring grad. The header's last int is a
free acknowledgement the sender may fill (the executor says how many gradient messages it has
received, so its peer can release the buffers of those sends without waiting on the network).

Messages travel on the device the default group's backend moves (:func:`transport_device`).
gloo's send/recv hand the tensor's data pointer to its host transport as it is, so a CUDA stage
on a gloo group (e.g. two ranks sharing one GPU, which NCCL refuses) is *staged*: its tensors
are copied to host memory before they are sent and received ones are copied back to the stage
device; the header always lives on the transport device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_autopipe.errors import PipelineRuntimeError

__all__ = [
    "HEADER_LEN",
    "decode_header",
    "encode_header",
    "recv_tensors",
    "send_tensors",
    "transport_device",
]

HEADER_LEN = 256
_ACK = HEADER_LEN - 1  # position of the acknowledgement; tensor specs end before it
# Tensor i of the message with tag t travels under tag t * _TAG_STRIDE + 1 + i (the header under
# t * _TAG_STRIDE): at most (HEADER_LEN - 2) // 4 tensors fit in a header, so tags never collide.
_TAG_STRIDE = 64
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def transport_device(backend: str, device: torch.device | None = None) -> torch.device:
    """The device whose tensors a process group of ``backend`` moves, for a stage on ``device``.

    NCCL moves CUDA tensors: a CUDA ``device`` is kept (also on ``"cpu:gloo,cuda:nccl"``,
    which routes CUDA tensors to NCCL), and a pure NCCL group gets the current CUDA device.
    gloo's point-to-point transport reads and writes host memory, so gloo gets the CPU whatever
    ``device`` is (a CUDA stage's messages are staged through the host). Any other backend
    (MPI, UCC) is taken to move ``device``'s tensors (default: the CPU).
    """
    name = str(backend).lower()
    dev = torch.device(device) if device is not None else None
    cuda = dev is not None and dev.type == "cuda"
    if "nccl" in name and (cuda or "gloo" not in name):
        if cuda and dev.index is not None:
            return dev
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in name:
        return torch.device("cpu")
    return dev if dev is not None else torch.device("cpu")


def _wire(device: torch.device) -> torch.device:
    """Where this rank's messages travel: :func:`transport_device` of the default group."""
    return transport_device(dist.get_backend(), device)


def encode_header(tensors: Sequence[Tensor | None], ack: int = 0) -> list[int]:
    """``[n, (present, dtype code, requires_grad, ndim, *shape) per tensor]``, zero padded,
    with ``ack`` in the last position."""
    out = [len(tensors)]
    for t in tensors:
        if t is None:
            out += [0, 0, 0, 0]
            continue
        if t.dtype not in _CODE:
            raise PipelineRuntimeError(
                f"cannot send a tensor of dtype {t.dtype} between stages; supported: "
                f"{[str(d) for d in _DTYPES]}"
            )
        out += [1, _CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if len(out) > _ACK:
        raise PipelineRuntimeError(
            f"{len(tensors)} tensors cross this stage boundary and their header needs {len(out)} "
            f"ints (> {_ACK}); choose cuts where fewer values are live"
        )
    return out + [0] * (_ACK - len(out)) + [int(ack)]


def decode_header(header: Sequence[int]) -> list[tuple[torch.dtype, tuple[int, ...], bool] | None]:
    """Inverse of :func:`encode_header`: per tensor ``(dtype, shape, requires_grad)`` or None."""
    n, pos = int(header[0]), 1
    specs: list[tuple[torch.dtype, tuple[int, ...], bool] | None] = []
    for _ in range(n):
        present, code, grad, ndim = (int(v) for v in header[pos : pos + 4])
        pos += 4
        if not present:
            specs.append(None)
            continue
        shape = tuple(int(v) for v in header[pos : pos + ndim])
        pos += ndim
        specs.append((_DTYPES[code], shape, bool(grad)))
    return specs


def send_tensors(
    tensors: Sequence[Tensor | None], dst: int, tag: int, device: torch.device, ack: int = 0
) -> list[tuple[dist.Work, Tensor]]:
    """Non-blocking send of the header (carrying ``ack``) and every present tensor; wait on the
    returned works.

    Each work is returned with the buffer it reads so the caller keeps it alive until then.
    A tensor that is not on the transport device (a CUDA stage on gloo) is copied there first;
    the copy to host memory completes before the send starts, so the stage may reuse or free
    its tensor at once.
    """
    wire = _wire(torch.device(device))
    header = torch.tensor(encode_header(tensors, ack), dtype=torch.int64, device=wire)
    works = [(dist.isend(header, dst, tag=tag * _TAG_STRIDE), header)]
    for i, t in enumerate(tensors):
        if t is None:
            continue
        buf = t.detach().to(wire).contiguous()
        works.append((dist.isend(buf, dst, tag=tag * _TAG_STRIDE + 1 + i), buf))
    return works


def recv_tensors(src: int, tag: int, device: torch.device) -> tuple[list[Tensor | None], int]:
    """Blocking receive of one message from :func:`send_tensors`: its tensors and its ``ack``.

    Tensors arrive on ``device`` (received on the transport device and copied over when the two
    differ). Floating tensors that were sent with ``requires_grad`` come back as leaves
    requiring grad *on ``device``*, so the receiving stage can hand their ``.grad`` back after
    its backward.
    """
    device = torch.device(device)
    wire = _wire(device)
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=wire)
    dist.recv(header, src, tag=tag * _TAG_STRIDE)
    ints = header.tolist()
    specs = decode_header(ints)
    out: list[Tensor | None] = []
    works = []
    for i, spec in enumerate(specs):
        if spec is None:
            out.append(None)
            continue
        dtype, shape, _ = spec
        buf = torch.empty(shape, dtype=dtype, device=wire)
        works.append(dist.irecv(buf, src, tag=tag * _TAG_STRIDE + 1 + i))
        out.append(buf)
    for w in works:
        w.wait()
    if wire != device:
        out = [t.to(device) if t is not None else None for t in out]
    for t, spec in zip(out, specs):
        if t is not None and spec is not None and spec[2] and t.is_floating_point():
            t.requires_grad_(True)
    return out, int(ints[_ACK])
