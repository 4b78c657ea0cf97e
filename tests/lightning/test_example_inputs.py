"""The forward inputs setup draws from a batch must fit the module's forward, or the error says
how the strategy took them and that ``pipeline_inputs`` picks them (no processes)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

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


def test_a_dict_batch_with_more_keys_than_forward_takes_names_pipeline_inputs():
    module = TakesX()
    with pytest.raises(InputError) as info:
        _check_forward(module, as_call_args(model_inputs(module, DICT_BATCH)),
                       "the first batch of the dataloader")
    text = str(info.value)
    assert "keyword arguments ['x', 'y']" in text
    assert "TakesX.forward(x)" in text
    assert "unexpected keyword argument 'y'" in text
    assert "pipeline_inputs(self, batch)" in text


def test_inputs_that_fit_pass_and_pipeline_inputs_picks_them():
    for module, batch in ((TakesX(), (DICT_BATCH["x"], DICT_BATCH["y"])),
                          (PicksX(), DICT_BATCH), (TakesX(), {"x": DICT_BATCH["x"]})):
        _check_forward(module, as_call_args(model_inputs(module, batch)), "a batch")
