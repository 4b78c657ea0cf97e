"""The sharded format: a ``torch.distributed.checkpoint`` directory, one named shard per stage.

Each rank writes its stage's tensors under ``model.<name>`` / ``optim.<i>.<name>.<key>`` (DCP
writes replicated keys once), so no rank ever holds the whole model. Loading reads only the
names a rank needs, which is how a different layout re-shards it. The directory is written
beside the target and swapped in by rank 0.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_autopipe.checkpoint.files import fsync_dir
from lightning_autopipe.checkpoint.optimizer import (
    local_optimizer_state,
    numbered_state,
    unwrap,
)
from lightning_autopipe.checkpoint.safe import SafeFileSystemReader, refusing_unsafe, safe_load
from lightning_autopipe.errors import CheckpointReadError, PlanError

__all__ = [
    "ShardedModelState",
    "ShardedOptimizerState",
    "is_sharded",
    "load_for_stage",
    "load_sharded",
    "load_sharded_optimizer",
    "read_model_state",
    "save_sharded",
]

_META = "lightning"  # everything of Lightning's checkpoint but the tensors we shard
_MODEL = "model."
_EXTRA = "__extra__"  # a parameter's non-tensor optimizer state, serialised


def is_sharded(path: str | Path) -> bool:
    """A ``torch.distributed.checkpoint`` directory (has DCP's ``.metadata``)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def _blob(obj: Any) -> Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unblob(t: Tensor, path: Any, weights_only: bool = True) -> Any:
    """A non-tensor part saved by :func:`_blob`; only plain containers unless told otherwise."""
    data = io.BytesIO(t.numpy().tobytes())
    if weights_only:
        return safe_load(data, path=path)
    return torch.load(data, weights_only=False)


def _flat_sharded(checkpoint: Mapping[str, Any], include_meta: bool) -> dict[str, Any]:
    flat: dict[str, Any] = {
        f"{_MODEL}{k}": v.detach() for k, v in checkpoint.get("state_dict", {}).items()
    }
    optims = checkpoint.get("optimizer_states")
    for i, named in enumerate(optims or []):
        if include_meta:
            flat[f"optim.{i}.param_groups"] = _blob(named["param_groups"])
        for name, pstate in named["state"].items():
            extra = {}
            for key, value in pstate.items():
                if isinstance(value, Tensor):
                    flat[f"optim.{i}.{name}.{key}"] = value.detach()
                else:
                    extra[key] = value
            if extra:
                flat[f"optim.{i}.{name}.{_EXTRA}"] = _blob(extra)
    if include_meta:
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        rest["autopipe_num_optimizers"] = None if optims is None else len(optims)
        flat[_META] = _blob(rest)
    return flat


def save_sharded(
    checkpoint: Mapping[str, Any], path: str | Path, *, is_rank_zero: bool, barrier: Any
) -> None:
    """Write a DCP directory at ``path`` collectively (every rank calls this), atomically.

    Args:
        checkpoint: this rank's Lightning checkpoint dict: ``state_dict`` holds the tensors
            this rank writes (its stage, under the original names; empty on replicas other
            than 0), ``optimizer_states`` the named form of :func:`named_optimizer_state` with
            ``param_groups`` already merged across stages (rank 0 writes them).
        is_rank_zero: rank 0 writes the non-tensor part and swaps the finished directory in.
        barrier: called between the phases (every rank has finished writing before the swap).
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    if is_rank_zero and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    dcp.save(_flat_sharded(checkpoint, is_rank_zero), storage_writer=dcp.FileSystemWriter(tmp))
    barrier()
    if is_rank_zero:
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    barrier()


def _metadata(path: str | Path) -> Any:
    if not (Path(path) / ".metadata").is_file():  # torch's own error names only the file
        raise CheckpointReadError(
            f"cannot read the checkpoint {str(path)!r}: the folder holds no .metadata, so it is "
            "no complete sharded checkpoint (an empty folder, or a save that never finished); "
            "save it again, or resume from an earlier one")
    return SafeFileSystemReader(path).read_metadata().state_dict_metadata


def _load(template: dict[str, Any], path: str | Path, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    with refusing_unsafe(path):
        dcp.load(template, storage_reader=SafeFileSystemReader(path), no_dist=no_dist)


def _empty_like_meta(md: Any) -> Tensor:
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def load_sharded(
    path: str | Path,
    model_state: Mapping[str, Tensor],
    *,
    no_dist: bool = False,
    partial: bool = False,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Lightning's checkpoint dict from a DCP directory, the model part loaded into a template.

    Args:
        model_state: the (whole or local) model's ``state_dict`` under the original names; its
            tensors' shapes say what to read. Every key must be in the checkpoint.
        partial: ``model_state`` is one stage's (a module already split into a pipeline): the
            checkpoint may hold more keys, only these are read.
        weights_only: the non-tensor parts must be plain containers (else refused); False only
            for a directory from a source you trust.

    Returns:
        Lightning's checkpoint with ``state_dict`` filled and ``optimizer_states`` a list of
        :class:`ShardedOptimizerState` markers (resolved by :func:`load_sharded_optimizer` once
        the optimizers exist).

    Raises:
        PlanError: the model has names the checkpoint lacks (or the other way round).
        UnsafeCheckpointError: the directory holds a pickled object other than plain data.
    """
    meta = _metadata(path)
    saved = {k[len(_MODEL) :] for k in meta if k.startswith(_MODEL)}
    missing = sorted(set(model_state) - saved)
    unexpected = [] if partial else sorted(saved - set(model_state))
    if missing or unexpected:
        raise PlanError(
            f"the sharded checkpoint {str(path)!r} does not match the model: missing "
            f"{missing[:8]} ({len(missing)}), unexpected {unexpected[:8]} ({len(unexpected)}); "
            "resume the model that wrote it"
        )
    template: dict[str, Any] = {
        f"{_MODEL}{k}": torch.empty_like(v, device="cpu") for k, v in model_state.items()
    }
    template[_META] = _empty_like_meta(meta[_META])
    _load(template, path, no_dist)
    out = _unblob(template.pop(_META), path, weights_only)
    num = out.pop("autopipe_num_optimizers", None)
    out["state_dict"] = {k[len(_MODEL) :]: v for k, v in template.items()}
    if num is not None:
        out["optimizer_states"] = [
            ShardedOptimizerState(str(path), i, weights_only) for i in range(num)
        ]
    return out


class ShardedOptimizerState(dict):
    """Stands in for an optimizer state of a sharded checkpoint until the optimizer exists."""

    def __init__(self, path: str, index: int, weights_only: bool = True) -> None:
        super().__init__(path=path, index=index, weights_only=weights_only)


def load_sharded_optimizer(
    marker: Mapping[str, Any], optimizer: Any, names: Mapping[int, str], *, no_dist: bool = False
) -> dict[str, Any]:
    """This rank's optimizer state dict from a sharded checkpoint (reads only its names)."""
    path, i = marker["path"], int(marker["index"])
    weights_only = bool(marker.get("weights_only", True))
    meta = _metadata(path)
    opt = unwrap(optimizer)
    local = [names.get(id(p)) for g in opt.param_groups for p in g["params"]]
    prefix = f"optim.{i}."
    template: dict[str, Any] = {f"{prefix}param_groups": None}
    for name in local:
        for key in meta:
            if key.startswith(f"{prefix}{name}.") and "." not in key[len(prefix) + len(name) + 1 :]:
                template[key] = None
    for key in template:
        template[key] = _empty_like_meta(meta[key])
    _load(template, path, no_dist)
    groups = _unblob(template.pop(f"{prefix}param_groups"), path, weights_only)
    state: dict[str, dict[str, Any]] = {}
    for key, value in template.items():
        rest = key[len(prefix) :]
        name = next(n for n in local if rest.startswith(f"{n}.") and "." not in rest[len(n) + 1 :])
        field = rest[len(name) + 1 :]
        if field == _EXTRA:
            state.setdefault(name, {}).update(_unblob(value, path, weights_only))
        else:
            state.setdefault(name, {})[field] = value
    return local_optimizer_state(numbered_state(groups, state), opt, names)


def read_model_state(path: str | Path) -> dict[str, Tensor]:
    """The whole model's ``state_dict`` (original names) from either checkpoint format.

    For a plain model in one process: ``model.load_state_dict(read_model_state(p), strict=True)``
    (strip a LightningModule attribute prefix yourself when loading a bare sub-module). Only
    tensors and plain containers are unpickled.

    Raises:
        UnsafeCheckpointError: the file holds another pickled object (it would run code).
    """
    if Path(path).is_dir():
        meta = _metadata(path)
        template = {k: _empty_like_meta(v) for k, v in meta.items() if k.startswith(_MODEL)}
        _load(template, path, no_dist=True)
        return {k[len(_MODEL) :]: v for k, v in template.items()}
    return safe_load(path, map_location="cpu")["state_dict"]


class ShardedModelState:
    """A sharded checkpoint's model tensors, read only when asked for, only the names asked for.

    What a model built on the meta device is loaded from: each rank reads its own stage's
    names (:class:`~lightning_autopipe.runtime.materialize.Materializer` calls
    :meth:`load_into` with them), straight into the stage's tensors.
    """

    def __init__(self, path: str | Path, no_dist: bool = False) -> None:
        self.path = str(path)
        self.no_dist = no_dist
        meta = _metadata(path)
        self._keys = [k[len(_MODEL) :] for k in meta if k.startswith(_MODEL)]

    def keys(self) -> list[str]:
        return list(self._keys)

    def load_into(self, targets: Mapping[str, Tensor]) -> None:
        """Read ``targets``' names into them (CPU targets directly, others via the host)."""
        template = {
            f"{_MODEL}{k}": t if t.device.type == "cpu" else torch.empty_like(t, device="cpu")
            for k, t in targets.items()
        }
        _load(template, self.path, self.no_dist)
        for k, t in targets.items():
            if t.device.type != "cpu":
                with torch.no_grad():
                    t.copy_(template[f"{_MODEL}{k}"])


def load_for_stage(
    path: str | Path, *, no_dist: bool = False, weights_only: bool = True
) -> dict[str, Any]:
    """Lightning's checkpoint dict for a model built on the meta device, its weights unread.

    A consolidated file is memory-mapped (``torch.load(mmap=True)``: a tensor's bytes are read
    when it is copied into a stage, so each rank reads only its stage's); a sharded directory's
    ``state_dict`` is a :class:`ShardedModelState`. Either way no rank reads the whole model.

    Raises:
        UnsafeCheckpointError: the file holds a pickled object other than plain data.
    """
    if is_sharded(path):
        out = load_sharded(path, {}, no_dist=no_dist, partial=True, weights_only=weights_only)
        out["state_dict"] = ShardedModelState(path, no_dist=no_dist)
        return out
    with refusing_unsafe(path):
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
