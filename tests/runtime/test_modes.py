"""The stages keep the modes of the user's modules through a training step's ``train()``
(``lightning_autopipe/runtime/modes.py``), no processes: a torch.fx stage calls the model's own
modules, which keep the user's modes; a torch.export stage cannot, and warns only for the
modules whose operations it holds."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_autopipe import split_model
from lightning_autopipe.runtime.modes import ModeFollower


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop = nn.Linear(4, 8), nn.Dropout(0.5)
        self.b, self.bn, self.c = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.bn(self.b(self.drop(self.a(x)))))


def _step(tracer: str, cuts: tuple[int, int]) -> tuple[nn.Module, nn.Module, list[str]]:
    torch.manual_seed(0)
    model = _Net()
    blocks = split_model(model, (torch.randn(4, 4),), tracer=tracer)
    lo, hi = cuts
    stage = blocks.stage(lo, len(blocks) if hi < 0 else hi)
    model.drop.eval()  # what fine-tuning code does in on_train_epoch_start
    model.bn.eval()
    follow = ModeFollower(model, {0: stage})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        follow(stage.train)
    return model, stage, [str(w.message) for w in seen]


@pytest.mark.parametrize("cuts", [(0, 2), (2, -1)])
def test_a_torch_fx_stage_keeps_the_users_modes_through_train(cuts):
    model, stage, said = _step("fx", cuts)
    assert not said
    assert not model.drop.training
    assert not model.bn.training
    called = [m for _, m in stage.named_modules() if isinstance(m, nn.Dropout | nn.BatchNorm1d)]
    assert called
    assert all(not m.training for m in called)
    x = torch.randn(4, 4) if cuts[0] == 0 else torch.randn(4, 8)
    before = model.bn.running_mean.clone()
    torch.testing.assert_close(stage(x)[0], stage(x)[0])  # no dropout draws
    assert torch.equal(model.bn.running_mean, before)  # the statistics stay frozen


@pytest.mark.parametrize(("cuts", "named"), [((0, 2), "drop"), ((2, -1), "bn")])
def test_a_torch_export_stage_warns_only_of_the_modules_it_runs(cuts, named):
    _, _, said = _step("export", cuts)
    assert len(said) == 1, said
    assert said[0].startswith(f"{named} is in evaluation mode while the model trains")


def test_an_evaluation_step_leaves_the_users_modes_as_they_were():
    """A torch.fx stage's ``eval()`` reaches the model's own modules: after the evaluation
    step they are in training mode again, so the next training step (which reads the user's
    modes) does not train them in evaluation mode."""
    torch.manual_seed(0)
    model = _Net()
    blocks = split_model(model, (torch.randn(4, 4),), tracer="fx")
    stage = blocks.stage(0, len(blocks))
    follow = ModeFollower(model, {0: stage})
    with follow.evaluating(stage.eval):
        assert not model.bn.training
        assert not any(m.training for m in stage.modules())
    assert all(m.training for m in model.modules())
    follow(stage.train)
    assert all(m.training for m in stage.modules())
