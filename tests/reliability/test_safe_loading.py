"""Checkpoints are read without running code from them; the project's own still load.

A crafted file (consolidated, or a sharded directory's metadata or non-tensor blob) whose
unpickling would create a marker file is refused, naming the file and the object, and the marker
is never created; the same payload unpickled the unsafe way does create it.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch

from lightning_autopipe import checkpoint as ckpt
from lightning_autopipe.checkpoint import sharded
from lightning_autopipe.errors import UnsafeCheckpointError
from tests.reliability import _task as T


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _sharded_dir(path: Path, extra: dict | None = None) -> torch.nn.Module:
    """A sharded checkpoint directory of the tiny GPT, as the strategy writes it."""
    import torch.distributed.checkpoint as dcp

    net = T.build_net()
    flat = sharded._flat_sharded(
        {"epoch": 1, "global_step": 4, **(extra or {}), "state_dict": net.state_dict()},
        include_meta=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process here
        dcp.save(flat, checkpoint_id=str(path), no_dist=True)
    return net


def test_a_consolidated_file_with_a_payload_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "x": _RunsCode(marker)}, tmp_path / "bad.ckpt")
    with pytest.raises(UnsafeCheckpointError, match=r"bad\.ckpt.*Unsupported global.*open"):
        ckpt.read_model_state(tmp_path / "bad.ckpt")
    from lightning_autopipe import AutoPipeStrategy

    with pytest.raises(UnsafeCheckpointError, match=r"bad\.ckpt.*weights_only=False"):
        AutoPipeStrategy().load_checkpoint(tmp_path / "bad.ckpt")
    assert not marker.exists()
    torch.load(tmp_path / "bad.ckpt", weights_only=False)  # the payload is live
    assert marker.exists()


def test_an_explicit_weights_only_false_is_honoured(tmp_path):
    from lightning_autopipe import AutoPipeStrategy

    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "x": _RunsCode(marker)}, tmp_path / "trusted.ckpt")
    AutoPipeStrategy().load_checkpoint(tmp_path / "trusted.ckpt", weights_only=False)
    assert marker.exists()


def test_a_sharded_directory_with_a_payload_in_its_metadata_is_refused(tmp_path):
    _sharded_dir(tmp_path / "d")
    marker = tmp_path / "ran"
    meta = tmp_path / "d" / ".metadata"
    real = pickle.loads(meta.read_bytes())  # plain pickle: the file is ours here
    real.planner_data = _RunsCode(marker)  # an attribute DCP keeps anyway
    meta.write_bytes(pickle.dumps(real))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*Unsupported global.*open"):
        ckpt.read_model_state(tmp_path / "d")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
        ckpt.load_sharded(tmp_path / "d", T.build_net().state_dict(), no_dist=True)
    assert not marker.exists()


def test_a_sharded_directory_with_a_payload_in_a_blob_is_refused(tmp_path):
    marker = tmp_path / "ran"
    net = _sharded_dir(tmp_path / "d", extra={"hyper_parameters": {"x": _RunsCode(marker)}})
    state = ckpt.read_model_state(tmp_path / "d")  # the tensors alone are still readable
    assert set(state) == set(net.state_dict())
    with pytest.raises(UnsafeCheckpointError, match=r"'.*d'.*Unsupported global.*open"):
        ckpt.load_sharded(tmp_path / "d", net.state_dict(), no_dist=True)
    assert not marker.exists()


def test_the_projects_own_sharded_checkpoint_loads_weights_only(tmp_path):
    net = _sharded_dir(tmp_path / "d", extra={"loops": {"fit": [1, 2]}, "hparams_name": "kw"})
    loaded = ckpt.load_sharded(tmp_path / "d", net.state_dict(), no_dist=True)
    assert loaded["loops"] == {"fit": [1, 2]}
    first = next(iter(net.state_dict()))
    part = ckpt.load_sharded(tmp_path / "d", {first: net.state_dict()[first]}, no_dist=True,
                             partial=True)  # one stage of a split module: its keys only
    assert list(part["state_dict"]) == [first]
    torch.testing.assert_close(part["state_dict"][first], net.state_dict()[first])


@pytest.mark.parametrize("damage", ["empty", "text", "bytes", "zip", "metadata", "shard-missing",
                                    "shard-truncated", "no-metadata"])
def test_a_damaged_checkpoint_is_a_read_error_naming_the_file_not_an_unsafe_one(tmp_path,
                                                                                damage):
    """A file nothing can read (empty, text, random bytes, a cut zip; a sharded directory with a
    cut ``.metadata``, a lost or cut shard) was refused as unsafe with the advice to pass
    weights_only=False, or raised a bare EOFError / KeyError / DCP's CheckpointException (a
    BaseException that ``except Exception`` misses). It is a CheckpointReadError naming it."""
    from lightning_autopipe import AutoPipeStrategy, CheckpointReadError

    if damage == "no-metadata":  # an empty folder, or a save that never finished
        path = tmp_path / "d"
        path.mkdir()
        read = [lambda: ckpt.read_model_state(path),
                lambda: ckpt.load_sharded(path, T.build_net().state_dict(), no_dist=True)]
    elif damage.startswith("shard") or damage == "metadata":
        path = tmp_path / "d"
        net = _sharded_dir(path)
        shard = sorted(path.glob("*.distcp"))[0]
        if damage == "metadata":
            meta = path / ".metadata"
            meta.write_bytes(meta.read_bytes()[:100])
        elif damage == "shard-missing":
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[:200])
        read = [lambda: ckpt.load_sharded(path, net.state_dict(), no_dist=True)]
    else:
        path = tmp_path / "bad.ckpt"
        torch.save({"state_dict": T.build_net().state_dict()}, tmp_path / "good.ckpt")
        good = (tmp_path / "good.ckpt").read_bytes()
        path.write_bytes({"empty": b"", "text": b"hello\n", "bytes": bytes(range(256)) * 20,
                          "zip": good[: len(good) // 2]}[damage])
        read = [lambda: ckpt.read_model_state(path),
                lambda: AutoPipeStrategy().load_checkpoint(path)]
    for attempt in read:
        with pytest.raises(CheckpointReadError, match=rf"cannot read the checkpoint '{path}"):
            attempt()
