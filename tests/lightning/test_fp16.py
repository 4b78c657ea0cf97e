"""fp16 with loss scaling under the pipeline equals one process with the same scaler (gloo ranks).

The cases of ``tests/lightning/_fp16_run.py`` run in the shared worlds (2 stages x 1 replica,
then 2 x 2, which also resumes from the 2x1 run's checkpoint); this process trains the same
net in one process on the global batches the ranks saw (:func:`tests.lightning._fp16.reference`:
``torch.autocast(float16)``, ``torch.amp.GradScaler`` with the same settings, ``unscale_``, norm
clipping, SGD). The settings make stage 1 alone overflow at step 2 (see ``_fp16.py``).

Tolerances (fp16's unit roundoff is ``u = 2**-11 ~ 4.9e-4``): the pipeline rounds every unit's
activations and weight gradients to fp16 on their own, one process a whole batch's at once, so
gradients and losses differ by a few ``u`` relative (losses and norms: ``rtol = 2u``; measured:
under ``5e-5``). Each step moves the weights by at most ``LR * CLIP = 0.075`` (clipped norm),
so after 5 steps they may differ by ``~5 * 4u * 0.075 ~ 7e-4``; ``2e-4`` is allowed (measured:
under ``1.3e-5``), far below one step's move, so a step skipped or taken on one side only, or
clipping of scaled gradients, fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.lightning import _fp16 as F16

U = 2.0**-11
LOSS_RTOL, WEIGHT_ATOL = 2 * U, 2e-4

pytestmark = pytest.mark.slow


MODULE = "tests.lightning._fp16_run"
WORLD_CASES = {2: [f"{MODULE}:fp16", f"{MODULE}:fp16-zbv"],
               4: [f"{MODULE}:fp16", f"{MODULE}:resume"]}


def _global_batches(ranks: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the replicas' batches joined in replica order (stage 0's ranks)."""
    firsts = sorted((r for r in ranks if r["stage"] == 0), key=lambda r: r["replica"])
    return [tuple(torch.cat([r["rows"][i]["batch"][j] for r in firsts]) for j in (0, 1))
            for i in range(len(firsts[0]["rows"]))]


def _run(ranks: list[dict], world: int, ckpt: Path | None = None) -> SimpleNamespace:
    ref = F16.reference(_global_batches(ranks))
    return SimpleNamespace(world=world, ranks=ranks, ref=ref, ckpt=ckpt)


@pytest.fixture(scope="module")
def runs2(worlds):
    torch.set_num_threads(1)
    ranks = worlds.results(2, MODULE, "fp16", weights_only=False)
    return _run(ranks, 2, worlds.folder(2, MODULE) / "fp16.ckpt")


@pytest.fixture(scope="module")
def runs4(worlds, runs2):
    torch.set_num_threads(1)
    run = _run(worlds.results(4, MODULE, "fp16", weights_only=False), 4)
    run.resumed = worlds.results(4, MODULE, "resume", weights_only=False)
    return run


@pytest.fixture(scope="module")
def runs2zbv(worlds):
    """ZB-V, two chunks per rank: the overflow in ``side``'s chunk, the scale and the skipped
    step as with one chunk per rank."""
    torch.set_num_threads(1)
    run = _run(worlds.results(2, MODULE, "fp16-zbv", weights_only=False), 2)
    run.side_row = 0  # V placement: the last block is chunk 3, on rank 0 with chunk 0
    return run


@pytest.fixture(params=["runs2", "runs4", "runs2zbv"], ids=["2x1", "2x2", "zbv-2x1"])
def runs(request, worlds):
    """The parametrised run (``worlds`` named here, so that these tests run in the
    suite's launch lane: a lazy ``getfixturevalue`` alone hides it from the lane split)."""
    return request.getfixturevalue(request.param)


def _same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_an_overflow_in_one_stage_skips_that_step_on_every_rank(runs):
    want_skips = [step == F16.OVERFLOW_STEP for step in range(F16.STEPS)]
    assert runs.ref["skipped"] == want_skips  # the settings do what _fp16.py says
    for rank in runs.ranks:
        rows = rank["rows"]
        assert rank["scaler_class"] == "PipelineGradScaler"
        assert [r["found_inf"] for r in rows] == want_skips, rank["stage"]
        # only the rank holding ``side`` (the last block) saw its own gradients overflow; the
        # other skipped on the shared flag alone
        side = getattr(runs, "side_row", 1)
        assert [r["local_inf"] for r in rows] == [s and rank["stage"] == side
                                                  for s in want_skips]
        assert [r["scale"] for r in rows] == pytest.approx(runs.ref["scales"], rel=1e-6)
        step = F16.OVERFLOW_STEP
        assert rows[step]["scale"] == pytest.approx(
            rows[step - 1]["scale"] * F16.SCALER["backoff_factor"], rel=1e-6)
        states = [r["state"] for r in rows]
        for i in range(1, F16.STEPS):  # the skipped step moved no weight; every other did
            assert _same_state(states[i], states[i - 1]) == (i == step), (rank["stage"], i)


def test_losses_norms_and_weights_equal_one_process(runs):
    ref = runs.ref
    for rank in runs.ranks:
        rows = rank["rows"]
        torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]),
                                   torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
        for step, (row, norm) in enumerate(zip(rows, ref["norms"])):
            if step == F16.OVERFLOW_STEP:  # inf/NaN on both sides: the step was skipped
                assert not math.isfinite(row["norm"])
                assert not math.isfinite(norm)
            else:  # over every stage, seen after unscale_ and before clipping
                assert row["norm"] == pytest.approx(norm, rel=LOSS_RTOL), step
        for name, value in rows[-1]["state"].items():
            torch.testing.assert_close(value, ref["states"][-1][name], rtol=0, atol=WEIGHT_ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")


def test_the_scale_survives_a_checkpoint_into_another_layout(runs2, runs4):
    saved = torch.load(runs2.ckpt, weights_only=True)
    final = runs2.ranks[0]["rows"][-1]["scale"]
    assert saved["MixedPrecision"]["scale"] == pytest.approx(final, rel=1e-6)
    assert saved["MixedPrecision"]["_growth_tracker"] == 0
    resumed = runs4.resumed
    batches = _global_batches(resumed)
    ref = F16.reference(batches, saved["state_dict"], saved["MixedPrecision"])
    fresh = F16.reference(batches, saved["state_dict"])  # a scale that was not restored
    assert ref["skipped"][0]  # the saved scale overflows at once,
    assert not fresh["skipped"][0]  # a fresh one would not
    for rank in resumed:
        rows = rank["rows"]
        assert rank["start_scale"] == pytest.approx(final, rel=1e-6)
        assert [r["found_inf"] for r in rows] == ref["skipped"]
        assert [r["scale"] for r in rows] == pytest.approx(ref["scales"], rel=1e-6)
        torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]),
                                   torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
        for name, value in rows[-1]["state"].items():
            torch.testing.assert_close(value, ref["states"][-1][name], rtol=0, atol=WEIGHT_ATOL)
