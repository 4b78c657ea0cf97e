"""The forward inputs setup draws from a batch must fit the module's forward, or the error says
how the strategy took them and that ``pipeline_inputs`` picks them (no processes)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_autopipe.errors import InputError
from lightning_autopipe.lightning.example import _check_forward
from lightning_autopipe.runtime.local_stage import as_call_args, model_inputs


class TakesX(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x)


class PicksX(TakesX):
    def pipeline_inputs(self, batch):
        return batch["x"]


DICT_BATCH = {"x": torch.randn(4, 6), "y": torch.zeros(4, dtype=torch.long)}


def test_a_dict_batch_gives_forward_the_entries_that_name_its_parameters():
    """Hugging Face style: the targets ride in the batch beside the inputs; forward gets the
    entries it names, the steps read the rest from the batch."""
    module = TakesX()
    inputs = as_call_args(model_inputs(module, DICT_BATCH))
    assert list(inputs) == ["x"]
    assert inputs["x"] is DICT_BATCH["x"]
    _check_forward(module, inputs, "the first batch of the dataloader")


class TakesAnything(nn.Module):
    def forward(self, **inputs):
        return inputs


def test_a_forward_taking_keywords_gets_every_entry():
    assert list(model_inputs(TakesAnything(), DICT_BATCH)) == ["x", "y"]


class TakesTheBatch(nn.Module):
    def forward(self, batch):
        return batch["x"]


def test_a_dict_batch_naming_no_parameter_names_pipeline_inputs():
    module = TakesTheBatch()
    with pytest.raises(InputError) as info:
        _check_forward(module, as_call_args(model_inputs(module, DICT_BATCH)),
                       "the first batch of the dataloader")
    text = str(info.value)
    assert "keyword arguments ['x', 'y']" in text
    assert "TakesTheBatch.forward(batch)" in text
    assert "missing a required argument: 'batch'" in text
    assert "pipeline_inputs(self, batch)" in text


def test_inputs_that_fit_pass_and_pipeline_inputs_picks_them():
    for module, batch in ((TakesX(), (DICT_BATCH["x"], DICT_BATCH["y"])),
                          (PicksX(), DICT_BATCH), (TakesX(), {"x": DICT_BATCH["x"]})):
        _check_forward(module, as_call_args(model_inputs(module, batch)), "a batch")
