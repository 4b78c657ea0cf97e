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
from torch.distributed.checkpoint.api import CheckpointException

from lightning_autopipe.errors import CheckpointReadError, UnsafeCheckpointError

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


def _reason(exc: BaseException, kind: bool = False) -> str:
    """What an unpickling (or reading) error says, without torch's paragraph around it."""
    text = " ".join(str(exc).split())
    reason = f"{type(exc).__name__}: {text}" if kind else text
    for marker in ("WeightsUnpickler error:", "Unsupported global:"):
        if marker in text:
            reason = text[text.index(marker) :].split(". ")[0].split(" Check the doc")[0]
            break
    return reason if len(reason) <= 300 else reason[:297] + "..."


def unsafe_message(path: Any, exc: BaseException) -> str:
    """The refusal: the file, what in it is not plain data, and what to do."""
    reason = _reason(exc)
    return (
        f"refusing to load the checkpoint {str(path)!r}: it holds a pickled object that is not "
        f"a tensor or a plain container ({reason}); unpickling it would run code from the file. "
        "Checkpoints written by lightning_autopipe and Lightning hold none. If the file comes "
        "from a source you trust, pass weights_only=False to trainer.fit/validate/test/predict"
    )


#: what the weights-only unpicklers say of an object they refuse (anything else they raise is
#: a damaged file: "pickle data was truncated", "Unsupported operand 101", ...)
_UNSAFE_MARKERS = ("Unsupported global", "Unsupported class", "unrecognized function",
                   "Can only build", "Could not find reduce", "allowlist")


def damaged_message(path: Any, exc: BaseException) -> str:
    """The error for a file that cannot be read as a checkpoint, naming the file and why."""
    if isinstance(exc, CheckpointException):  # torch.distributed.checkpoint: per-rank failures
        exc = next((e for e, _ in exc.failures.values()), exc)
    reason = _reason(exc, kind=True)
    return (f"cannot read the checkpoint {str(path)!r}: it is empty, truncated, not a checkpoint "
            f"or missing a shard ({reason}); save it again, or resume from an earlier one")


@contextmanager
def refusing_unsafe(path: Any) -> Iterator[None]:
    """Turn a weights-only unpickling refusal inside the block into an
    :class:`UnsafeCheckpointError`, and a damaged file (truncated, not a pickle, a shard
    missing) into a :class:`CheckpointReadError`: "unsafe, pass weights_only=False" would
    advise switching the check off for a file nothing can read."""
    try:
        yield
    except (UnsafeCheckpointError, CheckpointReadError):
        raise
    except pickle.UnpicklingError as exc:
        if any(marker in str(exc) for marker in _UNSAFE_MARKERS):
            raise UnsafeCheckpointError(unsafe_message(path, exc)) from None
        raise CheckpointReadError(damaged_message(path, exc)) from None
    except (EOFError, CheckpointException) as exc:
        raise CheckpointReadError(damaged_message(path, exc)) from None
    except (KeyError, OSError, RuntimeError) as exc:
        # what torch.load's readers raise on a file that is no checkpoint (a text file:
        # KeyError of an unknown opcode; a cut zip archive: OSError or RuntimeError), told
        # apart from a missing file and from errors of the code around the load
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)) or not \
                _raised_in(exc, ("torch/serialization.py", "torch/_weights_only_unpickler.py")):
            raise
        if isinstance(exc, RuntimeError) and "PytorchStreamReader" not in str(exc):
            raise  # e.g. a CUDA tensor on a machine without one: not a damaged file
        raise CheckpointReadError(damaged_message(path, exc)) from None


def _raised_in(exc: BaseException, files: tuple[str, ...]) -> bool:
    """Whether ``exc`` was raised inside one of ``files`` (a frame of its traceback is)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(files):
            return True
        tb = tb.tb_next
    return False


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
