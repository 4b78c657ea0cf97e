"""A GPT built in ``configure_model`` under ``Trainer(strategy=AutoPipeStrategy(...))`` holds
its stage only: each rank's peak host memory growth during setup, meta-device vs eager build.

Measured with the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` right before the LightningModule is built, read when training
starts): everything the rank touched, not only tensors. The model's fp32 weights are 389 MiB.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import pytest
import torch

from lightning_autopipe.runtime.materialize import deferred_init
from lightning_autopipe.runtime.memory import reset_resident_peak, resident_peak_bytes
from lightning_autopipe.zoo.models import TinyGPT

MiB = 2**20
SLACK = 32 * MiB  # process groups, the plan, Lightning's own setup: not the model


def _clear_refs_works() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _clear_refs_works(),
                                reason="needs Linux /proc/self/clear_refs to reset VmHWM")


MODULE = "tests.runtime._meta_lightning_run"
WORLD_CASES = {2: [f"{MODULE}:resume", f"{MODULE}:meta", f"{MODULE}:eager"],
               4: [f"{MODULE}:meta", f"{MODULE}:eager"]}


def test_the_resident_peak_grows_by_a_written_buffer_and_forgets_it_after_a_reset():
    """The measure the launches use, against a known size: 64 MiB of fresh anonymous pages,
    every one written (a tensor could reuse pages a long-lived process's heap already holds)."""
    base = reset_resident_peak()
    buffer = mmap.mmap(-1, 64 * MiB)
    page = b"\1" * MiB
    for _ in range(64):
        buffer.write(page)
    grown = resident_peak_bytes() - base
    buffer.close()
    assert 64 * MiB - MiB <= grown < 64 * MiB + SLACK
    assert reset_resident_peak() < base + grown - 32 * MiB  # freed: the old peak is forgotten


def _whole_model_bytes() -> int:
    from tests.runtime._meta_lightning_run import SIZES

    with deferred_init():
        net = TinyGPT(**SIZES)
    return sum(p.numel() * p.element_size() for p in net.parameters())


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_holds_its_stage_not_the_model_while_the_eager_build_holds_the_model(
        world, worlds):
    """2 ranks plan from block-by-block profiles: growth < stage + one block's parameters and
    gradients + slack; 4 ranks run a given plan (nothing profiled): growth < stage + slack and
    < 0.35 x the model. The eager build of the same model (on 2 ranks it runs the plan the meta
    build chose) grows by the whole model and more."""
    runs = {b: worlds.results(world, MODULE, b) for b in ("meta", "eager")}
    whole = _whole_model_bytes()
    for meta, eager in zip(runs["meta"], runs["eager"]):
        stage = meta["stage_bytes"]
        assert stage < 0.7 * whole  # a stage of a split model, not the model
        block = 2 * meta["largest_block"] if world == 2 else 0
        bound = stage + block + SLACK
        assert meta["growth"] < bound, (meta, bound / MiB)
        if world == 4:
            assert meta["growth"] < 0.35 * whole, meta
        assert eager["growth"] > whole > bound, (eager, whole / MiB)
        assert len(meta["losses"]) == 1  # the step ran
        assert math.isfinite(meta["losses"][0])
    # one global loss: every rank of the step agrees
    assert len({round(m["losses"][0], 6) for m in runs["meta"]}) == 1
    if world == 2:
        _check_resumed(worlds.folder(2, MODULE))


def _check_resumed(out: Path) -> None:
    """``fit(ckpt_path=...)`` into the ``configure_model`` build (its stage read from the
    memory-mapped file, the Adam state re-sharded) continues as one process resuming the same
    checkpoint: steps 3 and 4's losses, rtol 1e-5."""
    from lightning_autopipe.checkpoint import safe_load
    from tests.runtime import _cases as C
    from tests.runtime._meta_lightning_run import TINY, batch

    ranks = [torch.load(out / f"resume.rank{r}.pt") for r in range(2)]
    ckpt = safe_load(out / "tiny.ckpt", map_location="cpu")
    net = TinyGPT(**TINY)
    state = {k[len("net."):]: v for k, v in ckpt["state_dict"].items()}
    net.load_state_dict(state, strict=True)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    # the whole model's Adam state in its parameter order (names aside): loads as it is
    saved = ckpt["optimizer_states"][0]
    opt.load_state_dict({k: v for k, v in saved.items() if k != "param_names"})
    want = []
    x, y = batch(TINY)
    for _ in range(2):
        loss = C.loss_fn(net(x), (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(float(loss.detach()))
    for r in ranks:
        assert r["step"] == 4
        assert len(r["first"]) == 2
        torch.testing.assert_close(r["resumed"], want, rtol=1e-5, atol=0)
