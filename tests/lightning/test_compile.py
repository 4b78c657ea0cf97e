"""``compile=True`` through the Trainer on 2 gloo ranks equals the eager pipeline, compiling each
stage once for training and once for evaluation whatever the unit sizes.

One launch of ``tests/lightning/_compile_run.py`` runs the same fixed 1F1B plan (tied
embedding across the stages, startup slices, a short last batch) eager, then compiled with
inductor, then compiled under ZB-H1 (the same cut, the backward split into B and W); units of
4, 2 and 1 samples pass through every stage.

Tolerance: inductor fuses operators and may sum in another order than eager kernels do, so
activations differ by a few float32 roundings (``~1e-7`` relative per operation, more through
the reductions of layer norm, softmax and the matrix products); ``rtol=1e-5, atol=1e-6`` is the
suite's float32 tolerance for sums taken in another order (pipeline vs one process). Measured
here: losses equal to the printed digits, weights within ``6e-8``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_autopipe.runtime.units import fit_units, unit_bounds
from tests.lightning import _compile_run as R

RTOL, ATOL = 1e-5, 1e-6
CASES = ("eager", "compiled", "compiled-zb", "eager-zbv", "compiled-zbv")

pytestmark = pytest.mark.slow


MODULE = "tests.lightning._compile_run"
WORLD_CASES = {2: [f"{MODULE}:{case}" for case in CASES]}
WORLD_ORDER = 90  # after the eager cases of other modules: compiling leaves Dynamo's caches


@pytest.fixture(scope="module")
def runs(worlds) -> dict:
    return {case: worlds.results(2, MODULE, case, weights_only=False) for case in CASES} | {
        "out": worlds.folder(2, MODULE)}


def _unit_sizes(batch: int) -> set[int]:
    m, k, j = fit_units(batch, 2, 2, 1)
    return {b - a for a, b in unit_bounds(batch, m, k, j).values()}


@pytest.mark.parametrize("case", ["compiled", "compiled-zb"])
def test_the_compiled_pipeline_trains_and_validates_like_the_eager_one(runs, case):
    for eager, compiled in zip(runs["eager"], runs[case]):
        assert (eager["compiled_class"], compiled["compiled_class"]) == ("StageModule",
                                                                         "CompiledStage")
        assert len(compiled["losses"]) == 3
        torch.testing.assert_close(torch.tensor(compiled["losses"]),
                                   torch.tensor(eager["losses"]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(compiled["val_loss"], eager["val_loss"], rtol=RTOL, atol=ATOL)
        assert list(compiled["state"]) == list(eager["state"])
        for name, value in compiled["state"].items():
            torch.testing.assert_close(value, eager["state"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")
    # the weights did move: the comparison is not of two untouched models
    start = R.Task().state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in runs[case][0]["state"].items())


def test_zero_bubble_splits_the_compiled_backward_of_the_second_stage(runs):
    """ZB-H1 ran (W actions on both ranks); the last stage's compiled backward was cut into
    input- and weight-gradient graphs and none stayed whole; the first stage, whose backward
    is never split, compiled as under 1F1B."""
    first, last = runs["compiled-zb"]
    assert "WEIGHT" in first["actions"]
    assert "WEIGHT" in last["actions"]
    assert "WEIGHT" not in runs["compiled"][1]["actions"]
    assert first["deferral"] is None
    assert last["deferral"] == (1, 0)  # one training graph, split


@pytest.mark.parametrize("case", ["compiled", "compiled-zb"])
def test_each_stage_compiles_once_for_training_and_once_for_evaluation(runs, case):
    train_sizes = _unit_sizes(R.BATCH) | _unit_sizes(R.TRAIN_SAMPLES % R.BATCH)
    assert train_sizes == {1, 2, 4}  # startup slices, micro-batches, the short last batch
    for rank in runs[case]:
        assert rank["compilations_after_fit"] == 1, rank["compiled_shapes"]
        assert rank["compilations_after_validate"] == 2, rank["compiled_shapes"]


def test_the_checkpoint_keeps_the_model_names_and_loads_into_the_plain_model(runs):
    eager = torch.load(runs["out"] / "eager.ckpt", weights_only=True)["state_dict"]
    saved = torch.load(runs["out"] / "compiled.ckpt", weights_only=True)["state_dict"]
    plain = R.Task()
    assert list(saved) == list(plain.state_dict()) == list(eager)
    plain.load_state_dict(saved, strict=True)
    trained = {k: v for rank in runs["compiled"] for k, v in rank["state"].items()}
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)


def test_chunks_per_rank_compile_one_graph_each_and_train_like_eager(runs):
    """ZB-V, two chunks per rank: every chunk compiles once for training and once for
    evaluation; the chunks after the first split their compiled backward; losses, validation
    and weights equal the eager ZB-V run, which equals the eager two-stage 1F1B run."""
    for eager, zbv, compiled in zip(runs["eager"], runs["eager-zbv"], runs["compiled-zbv"]):
        assert compiled["compiled_class"] == "CompiledStage"
        assert set(compiled["compilations_after_fit"].values()) == {1}
        assert set(compiled["compilations_after_validate"].values()) == {2}
        for c, d in compiled["deferral"].items():
            assert d == (None if c == 0 else (1, 0)), (c, d)
        for other in (zbv, eager):
            torch.testing.assert_close(torch.tensor(compiled["losses"]),
                                       torch.tensor(other["losses"]), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(compiled["val_loss"], other["val_loss"], rtol=RTOL,
                                       atol=ATOL)
    trained = {k: v for rank in runs["compiled-zbv"] for k, v in rank["state"].items()}
    reference = {k: v for rank in runs["eager"] for k, v in rank["state"].items()}
    assert set(trained) == set(reference)
    for name, value in trained.items():
        torch.testing.assert_close(value, reference[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda s, n=name: f"{n}: {s}")
