"""The model summary of a module split into stages counts the whole model, layer by layer."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities.model_summary import ModelSummary

from lightning_autopipe.graph import split_model
from lightning_autopipe.lightning.summary import PipelineSummary, whole_model_parameters
from lightning_autopipe.runtime.local_stage import bind_local_stage
from lightning_autopipe.zoo.models import TinyGPT
from tests.lightning._module import Classifier


def _split(module, stop: int) -> None:
    example = (torch.zeros(2, 3, 8, 8),)
    blocks = split_model(module, example)
    stage = blocks.stage(0, stop)
    bind_local_stage(module, stage, stage.param_names)


def test_a_split_module_is_summarised_as_the_whole_model():
    whole = ModelSummary(Classifier(), max_depth=2)
    module = Classifier()
    table = whole_model_parameters(module)
    _split(module, 3)
    plain = ModelSummary(module, max_depth=2)
    assert plain.total_parameters < whole.total_parameters  # what rank 0 alone would report
    ours = PipelineSummary(module, table, max_depth=2)
    assert ours.total_parameters == whole.total_parameters
    assert ours.trainable_parameters == whole.trainable_parameters
    assert dict(zip(ours.layer_names, ours.param_nums)) == dict(
        zip(whole.layer_names, whole.param_nums))
    columns = dict(ours._get_summary_data())
    per_device = dict(zip(ours.layer_names, columns["Params per Device"]))
    assert per_device["net.fc"].strip() == "0"  # the head is on another stage
    stem = columns["Params"][ours.layer_names.index("net.stem")]
    assert per_device["net.stem"].strip() == stem.strip()  # the stem is this stage's


def test_tied_weights_count_once():
    torch.manual_seed(0)
    net = TinyGPT(vocab=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    table = whole_model_parameters(net)
    assert sum(numel for _, numel, _ in table) == sum(p.numel() for p in net.parameters())
    tied = [names for names, _, _ in table if len(names) > 1]
    assert tied, "TinyGPT ties its embedding and head"
