"""Layout-independent checkpoints: model and optimizer state under the original model's names.

A pipeline rank holds one stage, so neither its ``state_dict`` nor its optimizer's integer
parameter ids mean anything to another layout. Everything here is keyed by the original model's
``state_dict`` names instead:

* **Consolidated** (default): one file, written by rank 0 only, in Lightning's usual format. The
  ``state_dict`` is the whole model's; each optimizer state is a plain ``torch.optim`` state dict
  whose ids follow the whole model's parameter order (what ``Optimizer(model.parameters())``
  would use), plus a top-level ``"param_names"`` list per group. It loads into the plain model
  (``strict=True``), into ``strategy="auto"`` training, and into any pipeline layout.
* **Sharded** (``checkpoint_format="sharded"``): a ``torch.distributed.checkpoint`` directory;
  each rank writes its stage's tensors under ``model.<name>`` / ``optim.<i>.<name>.<key>`` (DCP
  writes replicated keys once), so no rank ever holds the whole model. Loading reads only the
  names a rank needs, which is how a different layout re-shards it.

Writes are atomic: a file goes to a temporary sibling, is fsynced and ``os.replace``-d over the
target; a sharded directory is written beside the target and swapped in by rank 0.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch import Tensor, nn

from lightning_autopipe.errors import PlanError

__all__ = [
    "AtomicCheckpointIO",
    "atomic_torch_save",
    "param_names_by_id",
    "named_optimizer_state",
    "merge_param_groups",
    "merge_optimizer_states",
    "group_names",
    "local_optimizer_state",
    "is_sharded",
    "save_sharded",
    "load_sharded",
    "load_sharded_optimizer",
    "ShardedOptimizerState",
    "read_model_state",
]

_NAMES = "param_names"  # top-level key of a consolidated optimizer state: names per group
_META = "lightning"  # sharded: everything of Lightning's checkpoint but tensors we shard
_MODEL = "model."
_EXTRA = "__extra__"  # sharded: a parameter's non-tensor optimizer state, serialised


# ---------------------------------------------------------------------------------- files
def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary sibling, fsync, then ``os.replace`` over ``path``.

    A crash at any point leaves either the previous file or the complete new one at ``path``
    (plus, at worst, a stray ``.<name>.*.tmp`` sibling), never a truncated checkpoint.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; match a plain open()
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with fsynced temp-file + ``os.replace`` writes locally.

    Remote (fsspec URL) paths keep Lightning's own transactional write.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_torch_save(checkpoint, str(path).removeprefix("file://"))


# ------------------------------------------------------------------------ optimizer state
def param_names_by_id(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` with tied parameters under their first (canonical) name.

    On a pipeline rank the module's parameters are the local stage's under the original names
    (``bind_local_stage``), so these are the names the whole model uses.
    """
    return {id(p): name for name, p in module.named_parameters()}


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer


def named_optimizer_state(optimizer: Any, names: Mapping[int, str]) -> dict[str, Any]:
    """The optimizer's state keyed by parameter *name*: the layout-independent form.

    Returns:
        ``{"state": {name: per-param state}, "param_groups": [hyper-parameters + names]}``;
        each group carries its parameters' names under ``"param_names"``.

    Raises:
        PlanError: the optimizer holds a parameter the module does not have.
    """
    opt = _unwrap(optimizer)
    sd = opt.state_dict()
    state: dict[str, Any] = {}
    groups = []
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group_names = []
        for p, pid in zip(group["params"], saved["params"]):
            if id(p) not in names:
                raise PlanError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one "
                    "of the module's parameters; build optimizers from self.parameters() inside "
                    "configure_optimizers"
                )
            name = names[id(p)]
            group_names.append(name)
            if pid in sd["state"]:
                state[name] = sd["state"][pid]
        hyper = {k: v for k, v in saved.items() if k not in ("params", _NAMES)}
        groups.append({**hyper, _NAMES: group_names})
    return {"state": state, "param_groups": groups}


def merge_param_groups(
    group_lists: Iterable[Sequence[Mapping[str, Any]]], order: Sequence[str]
) -> list[dict[str, Any]]:
    """Merge named parameter groups of several stages: group ``g`` = union of their names.

    Names follow the whole model's parameter order ``order``; hyper-parameters come from the
    first list (every stage's scheduler steps alike).

    Raises:
        PlanError: the stages built different numbers of groups.
    """
    lists = [list(gl) for gl in group_lists]
    counts = {len(gl) for gl in lists}
    if len(counts) != 1:
        raise PlanError(
            f"the stages' optimizers have different numbers of parameter groups {sorted(counts)}; "
            "configure_optimizers must build the same groups on every stage"
        )
    rank_of = {name: i for i, name in enumerate(order)}
    merged = []
    for g in range(counts.pop()):
        seen: dict[str, None] = {}
        for gl in lists:
            seen.update(dict.fromkeys(gl[g][_NAMES]))
        names = sorted(seen, key=lambda n: (rank_of.get(n, len(rank_of)), n))
        hyper = {k: v for k, v in lists[0][g].items() if k != _NAMES}
        merged.append({**hyper, _NAMES: names})
    return merged


def merge_optimizer_states(
    parts: Iterable[Mapping[str, Any]], order: Sequence[str]
) -> dict[str, Any]:
    """Merge per-stage named states into one plain ``torch.optim`` state dict.

    Group ``g`` holds the union of every part's group ``g`` names, in the whole model's
    parameter order ``order``; ids are numbered across groups as ``Optimizer.state_dict`` does,
    so the result loads into ``Optimizer(model.parameters())`` of the plain model. A name held by
    several parts (a tied weight) is kept once, from the first part.
    """
    parts = [p for p in parts if p]
    if not parts:
        return {}
    state: dict[str, Any] = {}
    for part in parts:
        for name, value in part["state"].items():
            state.setdefault(name, value)
    groups = merge_param_groups([p["param_groups"] for p in parts], order)
    out_groups, out_state, all_names = [], {}, []
    next_id = 0
    for group in groups:
        names = group[_NAMES]
        ids = list(range(next_id, next_id + len(names)))
        next_id += len(names)
        for pid, name in zip(ids, names):
            if name in state:
                out_state[pid] = state[name]
        out_groups.append({**{k: v for k, v in group.items() if k != _NAMES}, "params": ids})
        all_names.append(list(names))
    return {"state": out_state, "param_groups": out_groups, _NAMES: all_names}


def group_names(saved: Mapping[str, Any]) -> list[list[str]] | None:
    """Parameter names per group of a saved optimizer state, when it records them."""
    if _NAMES in saved:
        return [list(g) for g in saved[_NAMES]]
    groups = saved.get("param_groups", [])
    if groups and all(_NAMES in g for g in groups):
        return [list(g[_NAMES]) for g in groups]
    return None


def local_optimizer_state(
    saved: Mapping[str, Any],
    optimizer: Any,
    names: Mapping[int, str],
    full_names: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The part of a consolidated optimizer state this rank's optimizer holds, as its state dict.

    Args:
        saved: a plain ``torch.optim`` state dict (ids in the whole model's order), from a
            pipeline checkpoint (names recorded) or from ``strategy="auto"`` (no names).
        optimizer: this rank's optimizer (over the local stage's parameters).
        names: ``id(parameter) -> original name`` on this rank.
        full_names: names per group of the whole model's optimizer, used when ``saved`` records
            no names (its ids are then matched to these names by position).

    Raises:
        PlanError: the groups do not match, or a local parameter is missing from the checkpoint.
    """
    opt = _unwrap(optimizer)
    per_group = group_names(saved) or (
        [list(g) for g in full_names] if full_names is not None else None
    )
    saved_groups = saved["param_groups"]
    if per_group is None:
        raise PlanError(
            "the checkpoint's optimizer state records no parameter names and the whole model's "
            "parameter order is unknown; resume with the strategy that wrote it"
        )
    if len(saved_groups) != len(opt.param_groups) or len(per_group) != len(saved_groups):
        raise PlanError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but "
            f"configure_optimizers built {len(opt.param_groups)}; build the same groups"
        )
    state: dict[int, Any] = {}
    groups = []
    local_id = 0
    for g, (group, sgroup, gnames) in enumerate(zip(opt.param_groups, saved_groups, per_group)):
        if len(gnames) != len(sgroup["params"]):
            raise PlanError(
                f"optimizer group {g} of the checkpoint holds {len(sgroup['params'])} parameters "
                f"but the model's group {g} has {len(gnames)}; resume the same model with the "
                "same configure_optimizers"
            )
        id_of = dict(zip(gnames, sgroup["params"]))
        ids = []
        for p in group["params"]:
            name = names.get(id(p))
            if name not in id_of:
                raise PlanError(
                    f"parameter {name!r} of optimizer group {g} is not in the checkpoint's group "
                    f"{g} ({len(gnames)} parameters); resume the same model with the same "
                    "configure_optimizers"
                )
            if id_of[name] in saved["state"]:
                state[local_id] = saved["state"][id_of[name]]
            ids.append(local_id)
            local_id += 1
        hyper = {k: v for k, v in sgroup.items() if k not in ("params", _NAMES)}
        groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------- sharded
def is_sharded(path: str | Path) -> bool:
    """A ``torch.distributed.checkpoint`` directory (has DCP's ``.metadata``)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def _blob(obj: Any) -> Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unblob(t: Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=False)


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
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    barrier()


def _metadata(path: str | Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def _load(template: dict[str, Any], path: str | Path, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(template, storage_reader=dcp.FileSystemReader(str(path)), no_dist=no_dist)


def _empty_like_meta(md: Any) -> Tensor:
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def load_sharded(
    path: str | Path, model_state: Mapping[str, Tensor], *, no_dist: bool = False
) -> dict[str, Any]:
    """Lightning's checkpoint dict from a DCP directory, the model part loaded into a template.

    Args:
        model_state: the (whole or local) model's ``state_dict`` under the original names; its
            tensors' shapes say what to read. Every key must be in the checkpoint.

    Returns:
        Lightning's checkpoint with ``state_dict`` filled and ``optimizer_states`` a list of
        :class:`ShardedOptimizerState` markers (resolved by :func:`load_sharded_optimizer` once
        the optimizers exist).

    Raises:
        PlanError: the model has names the checkpoint lacks (or the other way round).
    """
    meta = _metadata(path)
    saved = {k[len(_MODEL) :] for k in meta if k.startswith(_MODEL)}
    missing = sorted(set(model_state) - saved)
    unexpected = sorted(saved - set(model_state))
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
    out = _unblob(template.pop(_META))
    num = out.pop("autopipe_num_optimizers", None)
    out["state_dict"] = {k[len(_MODEL) :]: v for k, v in template.items()}
    if num is not None:
        out["optimizer_states"] = [ShardedOptimizerState(str(path), i) for i in range(num)]
    return out


class ShardedOptimizerState(dict):
    """Stands in for an optimizer state of a sharded checkpoint until the optimizer exists."""

    def __init__(self, path: str, index: int) -> None:
        super().__init__(path=path, index=index)


def load_sharded_optimizer(
    marker: Mapping[str, Any], optimizer: Any, names: Mapping[int, str], *, no_dist: bool = False
) -> dict[str, Any]:
    """This rank's optimizer state dict from a sharded checkpoint (reads only its names)."""
    path, i = marker["path"], int(marker["index"])
    meta = _metadata(path)
    opt = _unwrap(optimizer)
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
    groups = _unblob(template.pop(f"{prefix}param_groups"))
    state: dict[str, dict[str, Any]] = {}
    for key, value in template.items():
        rest = key[len(prefix) :]
        name = next(n for n in local if rest.startswith(f"{n}.") and "." not in rest[len(n) + 1 :])
        field = rest[len(name) + 1 :]
        if field == _EXTRA:
            state.setdefault(name, {}).update(_unblob(value))
        else:
            state.setdefault(name, {})[field] = value
    ids = 0
    out_groups, out_state, full = [], {}, []
    for g in groups:
        gnames = list(g[_NAMES])
        pids = list(range(ids, ids + len(gnames)))
        ids += len(gnames)
        for pid, name in zip(pids, gnames):
            if name in state:
                out_state[pid] = state[name]
        out_groups.append({**{k: v for k, v in g.items() if k != _NAMES}, "params": pids})
        full.append(gnames)
    saved = {"state": out_state, "param_groups": out_groups, _NAMES: full}
    return local_optimizer_state(saved, opt, names)


def read_model_state(path: str | Path) -> dict[str, Tensor]:
    """The whole model's ``state_dict`` (original names) from either checkpoint format.

    For a plain model in one process: ``model.load_state_dict(read_model_state(p), strict=True)``
    (strip a LightningModule attribute prefix yourself when loading a bare sub-module).
    """
    if Path(path).is_dir():
        meta = _metadata(path)
        template = {k: _empty_like_meta(v) for k, v in meta.items() if k.startswith(_MODEL)}
        _load(template, path, no_dist=True)
        return {k[len(_MODEL) :]: v for k, v in template.items()}
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
