"""The forward inputs setup draws from a batch must fit the module's forward, or the error says
how the strategy took them and that ``pipeline_inputs`` picks them; the entries a step passes
to ``self(...)`` are read off the step itself (no processes)."""

from __future__ import annotations

from collections import UserDict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_autopipe.errors import InputError
from lightning_autopipe.lightning.example import _check_forward, read_step_inputs
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


class MaskedNet(pl.LightningModule):
    """A forward of two inputs, the step unpacking a tuple batch ``(x, mask, y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
        self.steps = 0

    def forward(self, x, mask=None):
        return self.lin(x * mask if mask is not None else x)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, mask, y = batch
        return nn.functional.cross_entropy(self(x, mask), y)


TUPLE_BATCH = (torch.randn(4, 6), torch.ones(4, 6), torch.zeros(4, dtype=torch.long))


def test_the_entries_a_step_passes_to_self_become_the_forward_inputs():
    """Without pipeline_inputs the default (batch[0]) would drop the mask; the step's own call
    names both entries, and every later batch (a slice of it too) is read the same way."""
    module = MaskedNet()
    read_step_inputs(module, TUPLE_BATCH, TrainerFn.FITTING)
    inputs = as_call_args(model_inputs(module, TUPLE_BATCH))
    assert len(inputs) == 2
    assert inputs[0] is TUPLE_BATCH[0]
    assert inputs[1] is TUPLE_BATCH[1]
    other = tuple(t[:2] for t in TUPLE_BATCH)
    assert model_inputs(module, other)[1] is other[1]
    _check_forward(module, inputs, "the first batch of the dataloader")
    assert "forward" not in module.__dict__  # the stand-in forward is gone


class KeywordNet(MaskedNet):
    def training_step(self, batch, batch_idx):
        return self(mask=batch["m"], x=batch["features"]).sum()


def test_a_call_by_keyword_on_a_dict_batch_is_read_by_parameter_name():
    module = KeywordNet()
    batch = {"features": TUPLE_BATCH[0], "m": TUPLE_BATCH[1], "y": TUPLE_BATCH[2]}
    read_step_inputs(module, batch, TrainerFn.FITTING)
    inputs = model_inputs(module, batch)
    assert set(inputs) == {"x", "mask"}
    assert inputs["x"] is batch["features"]
    assert inputs["mask"] is batch["m"]


class CastingNet(MaskedNet):
    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        return self(x.double(), mask).sum()


def test_a_step_that_computes_its_inputs_keeps_the_default_rules():
    """A cast is not an entry of the batch: the pipeline cannot feed it, and the strategy's
    check at the first step names pipeline_inputs."""
    module = CastingNet()
    read_step_inputs(module, TUPLE_BATCH, TrainerFn.FITTING)
    assert model_inputs(module, TUPLE_BATCH) is TUPLE_BATCH[0]


class NoisyNet(MaskedNet):
    def training_step(self, batch, batch_idx):
        self.log("noise", torch.rand(()))  # before self(...): not logged, its draw undone
        x, mask, y = batch
        out = self(x, mask)
        return (out + torch.randn_like(out)).sum()


def test_reading_the_step_leaves_the_random_streams_and_the_logs_as_they_were():
    module = NoisyNet()
    torch.manual_seed(3)
    read_step_inputs(module, TUPLE_BATCH, TrainerFn.FITTING)
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)
    assert "log" not in module.__dict__
    assert len(model_inputs(module, TUPLE_BATCH)) == 2  # read past the step's self.log


class FailingNet(MaskedNet):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("needs the optimizers")


class PicksItsInputs(MaskedNet):
    def pipeline_inputs(self, batch):
        return batch[0], batch[1]


@pytest.mark.parametrize("module", [FailingNet(), PicksItsInputs()], ids=["fails", "picks"])
def test_a_step_that_fails_or_a_module_that_picks_its_inputs_keeps_its_rule(module):
    read_step_inputs(module, TUPLE_BATCH, TrainerFn.FITTING)
    assert module.steps == 0
    expected = TUPLE_BATCH[0] if isinstance(module, FailingNet) else TUPLE_BATCH[:2]
    got = model_inputs(module, TUPLE_BATCH)
    assert got is expected if isinstance(module, FailingNet) else tuple(got) == tuple(expected)


class Encoding(UserDict):
    """A mapping that is not a ``dict``, as a tokenizer's ``BatchEncoding`` is."""


def test_a_mapping_batch_that_is_not_a_dict_is_read_as_a_dict_batch():
    """What Hugging Face collators return: forward gets the entries naming its parameters (a
    plain dict, as the graph layer takes keyword inputs), a step's keyword call is read off it,
    and ``pipeline_inputs`` may return such a mapping too."""
    batch = Encoding(DICT_BATCH)
    inputs = as_call_args(model_inputs(TakesX(), batch))
    assert type(inputs) is dict
    assert list(inputs) == ["x"]
    assert inputs["x"] is batch["x"]
    assert type(model_inputs(TakesAnything(), batch)) is dict
    module = KeywordNet()
    batch = Encoding(features=TUPLE_BATCH[0], m=TUPLE_BATCH[1], y=TUPLE_BATCH[2])
    read_step_inputs(module, batch, TrainerFn.FITTING)
    inputs = model_inputs(module, batch)
    assert set(inputs) == {"x", "mask"}
    assert inputs["x"] is batch["features"]
    assert inputs["mask"] is batch["m"]
    picked = as_call_args(Encoding(x=batch["features"]))  # what a pipeline_inputs may return
    assert type(picked) is dict
    assert picked["x"] is batch["features"]
