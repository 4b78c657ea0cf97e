"""Atomic checkpoint files: a crash mid-save leaves the previous checkpoint, never half a file.

A file goes to a temporary sibling, is fsynced and ``os.replace``-d over the target (the
directory is fsynced too, so the rename survives a power cut). Remote (fsspec URL) paths keep
Lightning's own transactional write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

__all__ = ["AtomicCheckpointIO", "atomic_torch_save", "fsync_dir", "with_atomic_writes"]


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
    fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
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


def with_atomic_writes(io: CheckpointIO | None) -> CheckpointIO:
    """The checkpoint IO a strategy should use: ``io``, with atomic writes where it has none.

    None becomes an :class:`AtomicCheckpointIO`; a wrapper without an inner IO (e.g.
    ``AsyncCheckpointIO``) gets one; any IO the user chose is kept as it is.
    """
    if io is None:
        return AtomicCheckpointIO()
    if isinstance(io, _WrappingCheckpointIO):
        io.checkpoint_io = AtomicCheckpointIO()  # only fills a gap
    return io
