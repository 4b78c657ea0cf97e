"""A rank's optimizers when its stage holds none of what an optimizer is given (one process:
the agreement between ranks is the Lightning worlds' ``optimizer`` case)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn

from lightning_autopipe.errors import PlanError
from lightning_autopipe.lightning.local_optimizers import group_facts, make_local_optimizers


def test_an_optimizer_given_no_parameter_is_built_with_empty_groups_and_steps():
    """``AdamW(self.head.named_parameters())`` on a rank holding no part of the head, and
    parameter groups of which one is empty here: built (torch refuses an empty list) with no
    placeholder left behind, and they step, save and load as empty groups do."""
    body, head = nn.Linear(3, 3), nn.Module()  # the head's layers live on another rank
    made = []

    def make():
        made.append(torch.optim.AdamW(head.named_parameters(), lr=0.1))
        made.append(torch.optim.SGD([{"params": list(body.parameters()), "lr": 0.5},
                                     {"params": []}], lr=0.1))

    make_local_optimizers(make, lambda: made, lambda: None, device=torch.device("cpu"),
                          distributed=False)
    head_opt, body_opt = made
    assert [len(g["params"]) for g in head_opt.param_groups] == [0]
    assert not head_opt.state
    assert [len(g["params"]) for g in body_opt.param_groups] == [2, 0]
    body(torch.ones(2, 3)).sum().backward()
    before = body.weight.detach().clone()
    for opt in made:
        opt.step()
        opt.load_state_dict(opt.state_dict())
    assert not torch.equal(body.weight, before)
    with pytest.raises(ValueError, match="empty parameter list"):  # torch's own check is back
        torch.optim.SGD([], lr=0.1)


def test_an_error_in_configure_optimizers_is_raised_as_it_is():
    def make():
        raise KeyError("no such group")

    with pytest.raises(KeyError, match="no such group"):
        make_local_optimizers(make, list, lambda: None, device=torch.device("cpu"),
                              distributed=False)


@pytest.mark.parametrize("mistake", ["two optimizers", "optimizer_idx"])
def test_two_optimizers_are_refused_with_the_parameter_group_fix_not_manual_optimization(
        mistake):
    """Lightning's own check (its ``_init_optimizers_and_lr_schedulers``, what the strategy's
    ``setup_optimizers`` runs) suggests manual optimization, which the strategy refuses too: the
    refusal names one optimizer with parameter groups instead (and a Lightning 1.x
    ``optimizer_idx`` argument, refused with one optimizer too, is named as such)."""
    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

        def configure_optimizers(self):
            if mistake == "optimizer_idx":
                return torch.optim.SGD(self.parameters(), lr=0.1)
            return [torch.optim.SGD(self.a.parameters(), lr=0.1),
                    torch.optim.SGD(self.b.parameters(), lr=0.1)]

    class OldSignature(TwoOptimizers):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return None

    module = OldSignature() if mistake == "optimizer_idx" else TwoOptimizers()
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False)
    phrase = "declares an optimizer_idx" if mistake == "optimizer_idx" else "several optimizers"
    with pytest.raises(PlanError, match=phrase) as info:
        make_local_optimizers(lambda: _init_optimizers_and_lr_schedulers(module), list,
                              lambda: None, device=torch.device("cpu"), distributed=False)
    assert "parameter group" in str(info.value)
    assert "automatic_optimization = False" not in str(info.value)


def test_the_ranks_compare_the_settings_a_step_sets_and_not_an_optimizers_own_state():
    """What the ranks compare after each step (:func:`group_facts`): a learning rate set by
    the step, on the last stage alone, differs; a number an optimizer keeps in its groups as
    its own per-stage state (Prodigy's ``d``) does not, so no rank imposes its own on the
    others; a tensor learning rate is compared by its value."""
    def facts(lr, d, tensor=False):
        opt = torch.optim.Adam([nn.Parameter(torch.ones(2))],
                               lr=torch.tensor(lr) if tensor else lr)
        opt.param_groups[0]["d"] = d
        return group_facts([opt])

    assert facts(0.1, d=1.0) == facts(0.1, d=2.0)
    assert facts(0.1, d=1.0) != facts(0.2, d=1.0)
    assert facts(0.1, d=1.0, tensor=True) == facts(0.1, d=1.0, tensor=True)
    assert facts(0.1, d=1.0, tensor=True) != facts(0.2, d=1.0, tensor=True)
