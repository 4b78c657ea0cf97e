"""Loading checkpoints without running code from them: tensors and plain containers only.

``torch.load(..., weights_only=False)`` and plain ``pickle.load`` execute whatever a file's
pickle asks for, so a checkpoint from an untrusted source could run arbitrary code. Every path
that reads a checkpoint here goes through ``torch.load(..., weights_only=True)`` (tensors,
numbers, strings, lists, tuples, dicts) or, for the pickled metadata file of a
``torch.distributed.checkpoint`` directory, an unpickler that admits only DCP's own metadata
classes; a file holding anything else is refused with :class:`UnsafeCheckpointError`, which names
the file and the object.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_autopipe.errors import UnsafeCheckpointError

__all__ = ["SafeFileSystemReader", "refusing_unsafe", "safe_load", "unsafe_message"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "WindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.load's own allowlist has it too
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


def unsafe_message(path: Any, exc: BaseException) -> str:
    """The refusal: the file, what in it is not plain data, and what to do."""
    text = " ".join(str(exc).split())
    reason = text
    for marker in ("WeightsUnpickler error:", "Unsupported global:"):
        if marker in text:
            reason = text[text.index(marker) :].split(". ")[0]
            break
    if len(reason) > 300:
        reason = reason[:297] + "..."
    return (
        f"refusing to load the checkpoint {str(path)!r}: it holds a pickled object that is not "
        f"a tensor or a plain container ({reason}); unpickling it would run code from the file. "
        "Checkpoints written by lightning_autopipe and Lightning hold none. If the file comes "
        "from a source you trust, pass weights_only=False to trainer.fit/validate/test/predict"
    )


@contextmanager
def refusing_unsafe(path: Any) -> Iterator[None]:
    """Turn a weights-only unpickling failure inside the block into an UnsafeCheckpointError."""
    try:
        yield
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(unsafe_message(path, exc)) from None


def safe_load(source: Any, path: Any = None, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True, **kwargs)``; a refusal names ``path`` (or source)."""
    with refusing_unsafe(source if path is None else path):
        return torch.load(source, weights_only=True, **kwargs)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, resolving only DCP's metadata types."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _DCP_METADATA:
            found = super().find_class(module, name)
            if isinstance(found, type):  # dataclasses and enums: no code of the file's choosing
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"Unsupported global: {module}.{name} is not part of a checkpoint's metadata"
        )


def _read_metadata(path: Path) -> Any:
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            with refusing_unsafe(path):
                metadata = _read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    _Reader.__name__ = _Reader.__qualname__ = "SafeFileSystemReader"
    return _Reader


def SafeFileSystemReader(path: str | Path) -> Any:  # noqa: N802 - stands in for a class
    """A ``torch.distributed.checkpoint.FileSystemReader`` whose metadata read runs no code.

    DCP's own reader unpickles ``.metadata`` with plain ``pickle.load``; this one admits only
    DCP's metadata types (and refuses the directory otherwise). Built on first use, so importing
    this module does not import ``torch.distributed.checkpoint``.
    """
    global _READER
    if _READER is None:
        _READER = _reader_class()
    return _READER(str(path))


_READER: type | None = None
