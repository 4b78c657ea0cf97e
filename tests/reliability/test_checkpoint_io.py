"""Checkpoint building blocks in one process: atomic writes, name-keyed optimizer re-sharding."""

from __future__ import annotations

import io
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from lightning_autopipe import checkpoint as ckpt
from lightning_autopipe.checkpoint import sharded
from lightning_autopipe.errors import PlanError
from tests.reliability import _task as T


# ----------------------------------------------------------------------------- atomic files
def test_failed_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt.atomic_torch_save({"step": 1, "w": torch.ones(3)}, path)

    def broken_save(obj, f, *args, **kwargs):  # writes half a file, then the "disk" fails
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        ckpt.atomic_torch_save({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    kept = torch.load(path)
    assert kept["step"] == 1
    torch.testing.assert_close(kept["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left


def _writer(path: Path, tensors: list[torch.Tensor], signal_fd: int) -> None:
    """Forked child: rewrite the checkpoint forever, a byte on the pipe before each save."""
    try:
        for step in range(100_000):
            os.write(signal_fd, b".")
            ckpt.atomic_torch_save({"step": step, "w": tensors[step % 2]}, path)
    finally:
        os._exit(0)


def test_a_killed_writer_never_leaves_a_truncated_checkpoint(tmp_path):
    """SIGKILL a process at a random point while it rewrites one checkpoint, several times.

    The same harness with a plain ``torch.save(obj, path)`` leaves an unreadable file in most
    trials (checked by hand: 5 of 6), so the trials do probe the write window.
    """
    path = tmp_path / "last.ckpt"
    tensors = [torch.arange(2**20, dtype=torch.float32), -torch.arange(2**20, dtype=torch.float32)]
    rng = random.Random(0)
    for _trial in range(5):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            os.close(read_fd)
            _writer(path, tensors, write_fd)
        os.close(write_fd)
        os.read(read_fd, 1)
        os.read(read_fd, 1)
        start = time.perf_counter()
        os.read(read_fd, 1)  # one whole save between two signals: the period
        time.sleep(rng.uniform(0.05, 0.95) * (time.perf_counter() - start))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_fd)
        saved = torch.load(path)  # a truncated zip would not load
        torch.testing.assert_close(saved["w"], tensors[saved["step"] % 2], rtol=0, atol=0)


# ------------------------------------------------------------------- optimizer re-sharding
def _trained(steps: int = 2):
    net = T.build_net()
    opt = torch.optim.Adam(net.parameters(), lr=T.LR)
    for x, y in T.global_batches(steps, steps):
        opt.zero_grad()
        T.lm_loss(net(x), (x, y)).backward()
        opt.step()
    return net, opt


def _through_file(obj):
    """A save/load round trip (in memory the state would share tensors with the source)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _split(net, parts: int) -> list[list[str]]:
    """Contiguous groups of parameter names, as pipeline stages hold them."""
    names = [n for n, _ in net.named_parameters()]
    size = -(-len(names) // parts)
    return [names[i : i + size] for i in range(0, len(names), size)]


def test_named_states_merge_into_the_plain_optimizer_state():
    net, opt = _trained()
    params = dict(net.named_parameters())
    names = ckpt.param_names_by_id(net)
    stage_states = []
    for stage in _split(net, 3):  # three "stages", each with its own optimizer over its params
        sub = torch.optim.Adam([params[n] for n in stage], lr=T.LR)
        sub.load_state_dict(
            ckpt.local_optimizer_state(
                ckpt.merge_optimizer_states(
                    [ckpt.named_optimizer_state(opt, names)], list(params)
                ),
                sub,
                names,
            )
        )
        stage_states.append(ckpt.named_optimizer_state(sub, names))
    merged = ckpt.merge_optimizer_states(stage_states[::-1], list(params))  # any order
    plain = opt.state_dict()
    assert merged["param_groups"][0]["params"] == plain["param_groups"][0]["params"]
    assert merged["param_names"] == [list(params)]
    for pid, state in plain["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(merged["state"][pid][key], value, rtol=0, atol=0)


def test_resharded_adam_continues_like_the_uninterrupted_optimizer():
    net, opt = _trained()
    saved = _through_file(
        ckpt.merge_optimizer_states(
            [ckpt.named_optimizer_state(opt, ckpt.param_names_by_id(net))],
            [n for n, _ in net.named_parameters()],
        )
    )
    # a copy of the model, its optimizer re-sharded into 4 stages from the saved state
    twin = T.build_net()
    twin.load_state_dict(net.state_dict())
    params, names = dict(twin.named_parameters()), ckpt.param_names_by_id(twin)
    stages = []
    for stage in _split(twin, 4):
        sub = torch.optim.Adam([params[n] for n in stage], lr=T.LR)
        sub.load_state_dict(ckpt.local_optimizer_state(saved, sub, names))
        stages.append(sub)
    x, y = T.global_batches(3, 3)[2]
    for model, optimizers in ((net, [opt]), (twin, stages)):
        for o in optimizers:
            o.zero_grad()
        T.lm_loss(model(x), (x, y)).backward()
        for o in optimizers:
            o.step()
    for (name, a), b in zip(net.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda s, n=name: f"{n}: {s}")


def test_unnamed_state_is_matched_by_position_and_mismatches_are_named():
    net, opt = _trained()
    plain = opt.state_dict()  # what strategy="auto" writes: integer ids, no names
    order = [n for n, _ in net.named_parameters()]
    names = ckpt.param_names_by_id(net)
    local = ckpt.local_optimizer_state(plain, opt, names, full_names=[order])
    assert local["state"].keys() == plain["state"].keys()
    with pytest.raises(PlanError, match="records no parameter names"):
        ckpt.local_optimizer_state(plain, opt, names)
    with pytest.raises(PlanError, match=r"holds 28 parameters but the model's group 0 has 27"):
        ckpt.local_optimizer_state(plain, opt, names, full_names=[order[:-1]])


def test_sharded_directory_round_trip_without_processes(tmp_path):
    net, opt = _trained()
    names = ckpt.param_names_by_id(net)
    order = [n for n, _ in net.named_parameters()]
    named = ckpt.named_optimizer_state(opt, names)
    named["param_groups"] = ckpt.merge_param_groups([named["param_groups"]], order)
    lightning_part = {"epoch": 3, "global_step": 7, "loops": {"x": [1, 2]}}
    import torch.distributed.checkpoint as dcp

    flat = sharded._flat_sharded(
        {**lightning_part, "state_dict": net.state_dict(), "optimizer_states": [named]},
        include_meta=True,
    )
    dcp.save(flat, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert ckpt.is_sharded(tmp_path / "d")
    state = ckpt.read_model_state(tmp_path / "d")
    fresh = T.build_net(seed=5)
    fresh.load_state_dict(state, strict=True)
    for (n, a), b in zip(net.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda s, n=n: f"{n}: {s}")
    loaded = ckpt.load_sharded(tmp_path / "d", fresh.state_dict(), no_dist=True)
    assert loaded["global_step"] == 7
    assert loaded["loops"] == {"x": [1, 2]}
    sub_names = _split(fresh, 2)[1]
    params = dict(fresh.named_parameters())
    sub = torch.optim.Adam([params[n] for n in sub_names], lr=T.LR)
    local = ckpt.load_sharded_optimizer(
        loaded["optimizer_states"][0], sub, ckpt.param_names_by_id(fresh), no_dist=True
    )
    sub.load_state_dict(local)
    plain = opt.state_dict()["state"]
    for i, name in enumerate(sub_names):
        want = plain[order.index(name)]
        torch.testing.assert_close(sub.state_dict()["state"][i]["exp_avg"], want["exp_avg"])


def test_the_strategy_io_writes_atomically_unless_the_user_chose_an_io():
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    from lightning_autopipe import AutoPipeStrategy

    assert isinstance(AutoPipeStrategy().checkpoint_io, ckpt.AtomicCheckpointIO)
    wrapped = AutoPipeStrategy(checkpoint_io=AsyncCheckpointIO()).checkpoint_io
    assert isinstance(wrapped, AsyncCheckpointIO)
    assert isinstance(wrapped.checkpoint_io, ckpt.AtomicCheckpointIO)
    mine = TorchCheckpointIO()
    assert AutoPipeStrategy(checkpoint_io=mine).checkpoint_io is mine


def test_a_gather_of_the_checkpoint_that_fails_says_saving_is_collective():
    """``if trainer.is_global_zero: trainer.save_checkpoint(...)`` (DDP's habit) left rank 0
    in the gather of every stage's part until gloo's raw timeout, naming nothing."""
    from lightning_autopipe.checkpoint.hooks import _every_rank_saves
    from lightning_autopipe.errors import PipelineRuntimeError

    timed_out = RuntimeError("Timed out waiting 30000ms for send operation to complete")
    with pytest.raises(PipelineRuntimeError, match=r"rank 0: gathering .*Timed out.*"
                       r"save_checkpoint must be called on every rank"), _every_rank_saves(0):
        raise timed_out


def test_a_gather_failing_because_a_peer_failed_names_that_failure_not_the_usual_mistake():
    """A rank that raised (or died) while a checkpoint was saved left its peer with the
    'call save_checkpoint on every rank' advice, which was wrong, and the cause unnamed: the
    failure its peer posted on the run's board is named instead (one store, two boards as
    two ranks hold them)."""
    from torch.distributed import HashStore

    from lightning_autopipe.checkpoint.hooks import _every_rank_saves
    from lightning_autopipe.errors import PipelineRuntimeError
    from lightning_autopipe.runtime.failure import FailureBoard

    store = HashStore()
    theirs, mine = FailureBoard(store, "run"), FailureBoard(store, "run")
    theirs.post("rank 1 failed: OSError: [Errno 28] No space left on device")
    with pytest.raises(PipelineRuntimeError) as info, _every_rank_saves(0, mine):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4321")
    assert str(info.value) == ("rank 0 stopped while gathering the checkpoint's parts because "
                               "rank 1 failed: OSError: [Errno 28] No space left on device")
