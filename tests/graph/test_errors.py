"""Bad input at the graph layer's public entry points gets a specific, actionable error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe import BlockRangeError, InputError, TraceError, split_model
from lightning_autopipe.errors import OptionError
from lightning_autopipe.zoo.models import TinyGPT, build_model


class DataDependent(nn.Module):
    """A Python branch on tensor *values*: neither fx nor torch.export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_untraceable_model_names_construct_and_both_remedies() -> None:
    with pytest.raises(TraceError) as info:
        split_model(DataDependent(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "if y.sum() > 0" in text  # the failing construct
    assert "torch.fx failed" in text
    assert "torch.export failed" in text
    assert "example_inputs" in text
    assert "torch.where / torch.cond" in text
    assert "GraphModule" in text


def test_fx_only_tracer_reports_the_fx_failure() -> None:
    with pytest.raises(TraceError, match="symbolic_trace failed.*control flow.*GraphModule"):
        split_model(DataDependent(), (torch.randn(2, 4),), tracer="fx")


def test_an_fx_only_trace_that_fails_where_the_model_runs_names_the_cause_not_the_inputs(
) -> None:
    from tests.graph.test_split import PeeksAtItsOutput

    with pytest.raises(TraceError) as info:
        split_model(PeeksAtItsOutput(), (torch.randn(2, 4),), tracer="fx")
    text = str(info.value)
    assert "fails on example_inputs where PeeksAtItsOutput itself runs" in text
    assert "no attribute 'logits'" in text  # the node's error
    assert "hasattr" in text  # its cause
    assert "tracer='export'" in text


def test_wrong_example_shape_fx_path() -> None:
    model, _ = build_model("small_cnn", "tiny")
    with pytest.raises(InputError, match=r"\(2, 5, 16, 16\).*stem") as info:
        split_model(model, (torch.randn(2, 5, 16, 16),))  # 5 channels, the stem takes 3
    assert "shape" in str(info.value)


def test_wrong_example_shape_export_path() -> None:
    model, example = build_model("gpt2", "tiny")
    bad = {"input_ids": torch.randint(0, 256, (2, 40))}  # longer than n_positions = 16
    with pytest.raises(InputError, match=r"example_inputs.*\(2, 40\)"):
        split_model(model, bad)


def test_wrong_arity_and_types() -> None:
    model = TinyGPT()
    ids = torch.randint(0, 128, (2, 16))
    with pytest.raises(InputError, match="do not fit forward"):
        split_model(model, (ids, ids))
    with pytest.raises(InputError, match="do not fit forward"):
        split_model(model, {"tokens": ids})
    with pytest.raises(InputError, match="not a tensor"):
        split_model(model, (ids.tolist(),))
    with pytest.raises(InputError, match="needs example_inputs"):
        split_model(model, None)
    with pytest.raises(OptionError, match="granularity"):
        split_model(model, (ids,), granularity="layers")
    with pytest.raises(OptionError, match=r"tracer must be one of \('auto', 'fx', 'export'\)"):
        split_model(model, (ids,), tracer="jit")


def test_later_inputs_must_match_the_traced_structure() -> None:
    model = TinyGPT()
    blocks = split_model(model, (torch.randint(0, 128, (2, 16)),))
    with pytest.raises(InputError, match=r"input 0 has shape \(2, 8\).*\(2, 16\).*pad every "
                       r"batch to the traced length"):
        blocks.flatten_inputs((torch.randint(0, 128, (2, 8)),))
    with pytest.raises(InputError, match="2 positional inputs"):
        blocks.flatten_inputs((torch.zeros(2, 16), torch.zeros(2, 16)))
    with pytest.raises(InputError, match="traced with"):
        blocks.flatten_inputs({"ids": torch.zeros(2, 16)})
    hf, example = build_model("gpt2", "tiny")
    hf_blocks = split_model(hf, example)
    with pytest.raises(InputError, match="keys"):
        hf_blocks.flatten_inputs({"ids": example["input_ids"]})
    with pytest.raises(InputError, match="traced with kwargs"):
        hf_blocks.flatten_inputs((example["input_ids"],))


def test_block_ranges_out_of_bounds() -> None:
    blocks = split_model(TinyGPT(), (torch.randint(0, 128, (2, 16)),))
    n = len(blocks)
    for i, j in [(0, n + 1), (-1, 2), (3, 3), (4, 2)]:
        with pytest.raises(BlockRangeError, match=rf"\[{i}, {j}\).*0 <= i < j <= {n}"):
            blocks.stage(i, j)
    with pytest.raises(BlockRangeError, match="strictly increasing"):
        blocks.run((torch.randint(0, 128, (2, 16)),), cuts=[0, 4, 2, n])
    with pytest.raises(BlockRangeError, match="must start at 0 and end at"):
        blocks.run((torch.randint(0, 128, (2, 16)),), cuts=[1, n])
    with pytest.raises(BlockRangeError, match="must start at 0 and end at"):
        blocks.tie_groups([0, n - 1])
    with pytest.raises(BlockRangeError):
        blocks.stage_io(0, n + 2)


def test_a_dataclass_output_is_refused_with_the_fix() -> None:
    """torch.fx records a ``@dataclass`` the forward returns as one node: its tensors were no
    block's outputs, and profiling the split failed with "stack expects a non-empty
    TensorList". A dict output (the fix the message names) splits and runs."""
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor

    class Net(nn.Module):
        def __init__(self, as_dict: bool) -> None:
            super().__init__()
            self.as_dict = as_dict
            self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            y = self.l2(torch.relu(self.l1(x)))
            return {"logits": y} if self.as_dict else Out(y)

    x = torch.randn(3, 4)
    with pytest.raises(TraceError, match=r"forward returns a .*Out, .*return a dict or a tuple"):
        split_model(Net(as_dict=False), (x,))
    net = Net(as_dict=True)
    blocks = split_model(net, (x,))
    assert torch.equal(blocks.run((x,))["logits"], net(x)["logits"])
