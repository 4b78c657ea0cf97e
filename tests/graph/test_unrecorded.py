"""What torch.fx runs at trace time without recording it: the split model must not lose it.

symbolic_trace runs the forward's Python once with proxies. A ``torch.no_grad()`` /
``torch.autocast`` section and a buffer updated by a value that does not depend on the inputs
run then and are missing from its graph, so a split made from it would differentiate the
no-grad section, compute the autocast section in float32, or never count. ``tracer="auto"``
must capture such models with torch.export instead (chained stages equal to the model, its
gradients, outputs and buffers), and ``tracer="fx"`` must refuse them naming the construct.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe import TraceError, split_model
from tests.graph._reference import call, check_split


class Three(nn.Module):
    """Three linear layers of ``WIDTH`` features; each model below wires them its own way."""

    WIDTH = 4

    def __init__(self) -> None:
        super().__init__()
        w = self.WIDTH
        self.l1, self.l2, self.l3 = nn.Linear(w, w), nn.Linear(w, w), nn.Linear(w, w)


class NoGradSection(Three):
    """``l2`` runs without autograd: no gradient reaches ``l2`` or ``l1`` through it."""

    def forward(self, x):
        h = self.l1(x)
        with torch.no_grad():
            t = self.l2(h)
        return self.l3(h * t)


class AutocastSection(Three):
    WIDTH = 8

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.l2(h)
        return self.l3(h.float())


class StepCounter(Three):
    """Counts its calls in a buffer (an update that reads no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


@pytest.mark.parametrize("model_cls", [NoGradSection, AutocastSection])
def test_a_mode_section_is_captured_by_export_and_the_stages_equal_the_model(model_cls):
    torch.manual_seed(0)
    model, x = model_cls(), (torch.randn(3, model_cls.WIDTH),)
    blocks = split_model(model, x)
    assert blocks.tracer == "export"
    n = len(blocks)
    for cuts in ([0, n], [0, 1, n], list(range(n + 1))):
        check_split(blocks, model, x, cuts)
    with torch.no_grad():
        torch.testing.assert_close(blocks.run(x, list(range(n + 1))), call(model, x),
                                   rtol=0, atol=0)


@pytest.mark.parametrize(("model_cls", "construct"), [(NoGradSection, "torch.no_grad()"),
                                                      (AutocastSection, "torch.autocast"),
                                                      (StepCounter, "buffer 'steps'")])
def test_tracer_fx_refuses_what_it_cannot_record_and_names_it(model_cls, construct):
    model = model_cls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TraceError) as info:
        split_model(model, (torch.randn(2, model_cls.WIDTH),), tracer="fx")
    assert construct in str(info.value)
    assert "tracer='export'" in str(info.value)
    for k, v in model.state_dict().items():  # the trace left the model as it found it
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_a_buffer_update_runs_in_every_pipelined_step():
    model, x = StepCounter(), (torch.randn(2, 4),)
    blocks = split_model(model, x)
    assert int(model.steps) == 0  # neither tracing nor the example run counted
    n = len(blocks)
    blocks.run(x, [0, 1, n])
    blocks.run(x, list(range(n + 1)))
    assert int(model.steps) == 2


@pytest.mark.parametrize("container", ["list", "dict"])
def test_list_and_dict_outputs_keep_their_type_under_fx(container):
    class Outputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return [self.b(h), h] if container == "list" else {"out": self.b(h), "h": h}

    model, x = Outputs(), (torch.randn(2, 4),)
    blocks = split_model(model, x)
    assert blocks.tracer == "fx"
    out = blocks.run(x, [0, 1, len(blocks)])
    assert type(out) is type(call(model, x))
    if container == "list":
        out.append(None)  # a user may change what the model returned, as with the model's
        check_split(blocks, model, x, [0, 1, len(blocks)])
    else:
        out["extra"] = None


class _ModeBranch(Three):
    """``if self.training`` decides a scale, as ``how`` says: ``"branch"``, a Python branch;
    ``"functional"``, ``F.dropout(training=self.training)``; ``"module"``, an ``nn.Dropout``
    (whose mode the stages' ``train()`` / ``eval()`` switch: nothing to warn about)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.drop = how, nn.Dropout(0.5)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        if self.how == "branch" and self.training:
            h = h * 1.5
        elif self.how == "functional":
            h = torch.nn.functional.dropout(h, 0.5, training=self.training)
        elif self.how == "module":
            h = self.drop(h)
        return self.l3(self.l2(h))


@pytest.mark.parametrize(("how", "mode", "line"), [
    ("branch", "training", "* 1.5"), ("functional", "training", "training = True"),
    ("branch", "evaluation", "self.l2(relu)"), ("module", None, None)])
def test_a_forward_branching_on_self_training_is_warned_with_the_line(how, mode, line):
    """The graph keeps the mode it was traced in as constants: without the warning the split
    model's validation ran the training branch (predictions 1.5x the model's in eval mode)."""
    import warnings

    model = _ModeBranch(how).train(mode != "evaluation")
    x = torch.randn(3, Three.WIDTH)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        blocks = split_model(model, (x,))
    said = [str(w.message) for w in seen if "computes differently" in str(w.message)]
    if mode is None:
        assert said == []
        return
    assert len(said) == 1
    assert line in said[0]
    assert f"keeps the {mode}-mode code" in said[0]
    model.train(mode == "evaluation")  # the other mode: the split model still runs the traced
    torch.manual_seed(0)
    split = blocks.run((x,))
    torch.manual_seed(0)
    assert not torch.allclose(split, call(model, (x,)))
