"""The wire format of a layout migration: JSON catalogs and flat byte buffers.

A sender describes every entry it sends (a tensor, and per optimizer its state's structure:
dicts, lists, numbers and tensor specs) in its catalog; the receiver allocates from that and
rebuilds the entry from raw bytes. Nothing received is unpickled, and one buffer carries every
entry one rank sends another (entries in the order both sides are given, tensors in the order
:func:`pack` writes them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.optim_state import NAMES

__all__ = ["all_gather_json", "describe_entry", "pack", "payload_size", "unpack_entry"]


def _tensor_spec(t: Tensor, device: torch.device) -> list[Any]:
    """``[dtype, shape, on the stage device]``: what a receiver allocates."""
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.device.type != "cpu"
            or device.type == "cpu"]


def _skeleton(obj: Any, leaves: list[Tensor], device: torch.device) -> Any:
    """A JSON form of an optimizer's per-parameter state; tensors become specs in ``leaves``."""
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return {"t": _tensor_spec(obj, device)}
    if isinstance(obj, Mapping):
        return {"d": [[k, _skeleton(v, leaves, device)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return {"l" if isinstance(obj, list) else "u": [_skeleton(v, leaves, device) for v in obj]}
    if obj is None or isinstance(obj, bool | int | float | str):
        return {"v": obj}
    raise PlanError(
        f"optimizer state holds a {type(obj).__name__}, which a migration cannot move (tensors, "
        "numbers, strings and lists/dicts of them can)"
    )


def describe_entry(
    name: str, tensors: Mapping[str, Tensor], optimizers: Sequence[Mapping[str, Any]],
    device: torch.device,
) -> dict[str, Any]:
    leaves: list[Tensor] = []
    entry: dict[str, Any] = {"t": _tensor_spec(tensors[name], device), "groups": [], "state": []}
    for opt in optimizers:
        entry["groups"].append(
            next((g for g, grp in enumerate(opt["param_groups"]) if name in grp[NAMES]), None))
        state = opt["state"].get(name)
        entry["state"].append(None if state is None else _skeleton(state, leaves, device))
    return entry


def _leaves(name: str, tensors: Mapping[str, Tensor],
            optimizers: Sequence[Mapping[str, Any]]) -> list[Tensor]:
    """The tensors of one entry, in wire order: the tensor, then each optimizer's state."""
    out = [tensors[name]]
    for opt in optimizers:
        state = opt["state"].get(name)
        if state is not None:
            _skeleton(state, out, torch.device("cpu"))
    return out


def _nbytes(spec: Sequence[Any]) -> int:
    dtype, shape = getattr(torch, spec[0]), spec[1]
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _entry_specs(entry: Mapping[str, Any]) -> list[list[Any]]:
    specs = [entry["t"]]

    def walk(node: Any) -> None:
        if "t" in node:
            specs.append(node["t"])
        for key in ("l", "u"):
            for v in node.get(key, ()):
                walk(v)
        for _, v in node.get("d", ()):
            walk(v)

    for state in entry["state"]:
        if state is not None:
            walk(state)
    return specs


def payload_size(names: Sequence[str], catalog: Mapping[str, Any]) -> int:
    return sum(_nbytes(s) for n in names for s in _entry_specs(catalog[n]))


def pack(names: Sequence[str], catalog: Mapping[str, Any], tensors: Mapping[str, Tensor],
          optimizers: Sequence[Mapping[str, Any]], wire: torch.device) -> Tensor:
    buf = torch.empty(payload_size(names, catalog), dtype=torch.uint8, device=wire)
    pos = 0
    for name in names:
        for t in _leaves(name, tensors, optimizers):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[pos : pos + raw.numel()].copy_(raw)
            pos += raw.numel()
    return buf


def unpack_entry(entry: Mapping[str, Any], buf: Tensor, pos: int,
                  device: torch.device) -> tuple[Tensor, list[Any], int]:
    """Rebuild one entry from ``buf`` at ``pos``: its tensor, each optimizer's state, new pos."""

    def take(spec: Sequence[Any]) -> Tensor:
        nonlocal pos
        dtype, shape, on_device = getattr(torch, spec[0]), spec[1], spec[2]
        t = torch.empty(shape, dtype=dtype, device=device if on_device else "cpu")
        n = _nbytes(spec)
        t.reshape(-1).view(torch.uint8).copy_(buf[pos : pos + n])
        pos += n
        return t

    def build(node: Mapping[str, Any]) -> Any:
        if "t" in node:
            return take(node["t"])
        if "d" in node:
            return {(k): build(v) for k, v in node["d"]}
        if "l" in node:
            return [build(v) for v in node["l"]]
        if "u" in node:
            return tuple(build(v) for v in node["u"])
        return node["v"]

    tensor = take(entry["t"])
    states = [None if s is None else build(s) for s in entry["state"]]
    return tensor, states, pos




def all_gather_json(obj: Any, size: int, wire: torch.device, group: Any,
                     timeout: timedelta) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in group rank order; each wait bounded by ``timeout``."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(wire)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=wire)
    sizes = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(sizes, n, group=group, async_op=True).wait(timeout)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=wire)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group, async_op=True).wait(timeout)
    return [json.loads(bytes(p[: int(s.item())].cpu().tolist()).decode())
            for p, s in zip(parts, sizes)]
