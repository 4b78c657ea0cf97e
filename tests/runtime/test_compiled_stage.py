"""``CompiledStage``: one graph for every unit size (a dynamic batch where a graph cannot take an
unbacked one), eager numerics, bounded compiles; a backend that cannot split a backward is
refused a zero-bubble plan; the compiled profile scales each block as the whole model sped up
(split backwards: ``test_compiled_split.py``).

Graph counts are Dynamo's (which graphs it traces and when its guards force a recompile) and do
not depend on the backend that compiles each graph, so these in-process tests use
``aot_eager`` (Dynamo + AOTAutograd, no code generation: seconds instead of minutes); the
multi-process test (``tests/lightning/test_compile.py``) and the profile correction below run
inductor.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import lightning_autopipe.runtime.compiled_stage as cs
from lightning_autopipe.errors import PlanError
from lightning_autopipe.graph import split_model
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.profile import BlockProfile, Profile
from lightning_autopipe.runtime.compiled_stage import CompiledStage, compiled_profile
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from lightning_autopipe.runtime.profiler import profile_blocks, saved_activation_bytes
from lightning_autopipe.runtime.recompute import Recomputed
from tests.reliability import _task as T


def _gpt_stage() -> tuple[nn.Module, int]:
    """The middle of the tiny tied GPT (blocks 2..4: a transformer layer), and its width."""
    blocks = split_model(T.build_net(), (torch.zeros(2, T.SEQ, dtype=torch.long),))
    return blocks.stage(2, 4), 16


def _run(stage: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = stage(x)
    out = out[0] if isinstance(out, tuple | list) else out
    out.pow(2).mean().backward()
    grads = [x.grad, *(p.grad.clone() for p in stage.parameters())]
    for p in stage.parameters():
        p.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
def test_every_unit_size_reuses_one_graph_and_equals_eager(recompute):
    eager, width = _gpt_stage()
    inner = copy.deepcopy(eager)
    compiled = CompiledStage(Recomputed(inner) if recompute else inner, backend="aot_eager")
    assert list(compiled.parameters()) == list(inner.parameters())  # the stage's own
    g = torch.Generator().manual_seed(0)
    for size in (4, 2, 1, 3, 4, 1):  # slices, micro-batches, a short last batch
        x = torch.randn(size, T.SEQ, width, generator=g)
        want, want_grads = _run(eager, x)
        got, got_grads = _run(compiled, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiled.compilations == 1, compiled.compiled_shapes
    compiled.eval()
    with torch.no_grad():  # evaluation: one more graph, then none for any size
        for size in (4, 1, 3):
            x = torch.randn(size, T.SEQ, width, generator=g)
            torch.testing.assert_close(compiled(x), eager.eval()(x), rtol=1e-5, atol=1e-6)
    assert compiled.compilations == 2
    compiled.train()
    eager.train()
    _run(compiled, torch.randn(5, T.SEQ, width, generator=g))
    assert compiled.compilations == 2  # back to training: the first graph again


def test_a_backed_batch_would_compile_one_sample_slices_again():
    """Why the batch is unbacked: a dynamic (backed) batch specialises size 1."""
    eager, width = _gpt_stage()
    seen = []

    def counted(gm, example_inputs):
        seen.append(1)
        return gm.forward

    backed = torch.compile(copy.deepcopy(eager), backend=counted)
    for size in (4, 2, 1):
        x = torch.randn(size, T.SEQ, width)
        torch._dynamo.mark_dynamic(x, 0)
        backed(x)
    assert len(seen) == 2


class _Repeats(nn.Module):
    """A learned row repeated per sample (DeBERTa's relative attention, learned queries): the
    backward of ``repeat`` guards on whether the batch is 0 or 1, so no graph serves an
    unbacked batch. Here the compile fails at the first one-sample unit (a graph of its own,
    for BatchNorm's check of its batch), after a graph has updated the running statistics."""

    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.graph_break = graph_break
        self.bn = nn.BatchNorm1d(8)
        self.row = nn.Parameter(torch.randn(1, 8, 3))

    def forward(self, x):
        h = self.bn(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return h * self.row.repeat(x.size(0), 1, 1)


def _run_split(stage: CompiledStage, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """:func:`_run` as a zero-bubble stage runs: B defers the weight halves, W adds them."""
    x = x.clone().requires_grad_(True)
    out = stage(x)
    with stage.deferring_weights() as pending:
        out.pow(2).mean().backward()
    stage.backward_weight(pending)
    grads = [x.grad, *(p.grad.clone() for p in stage.parameters())]
    for p in stage.parameters():
        p.grad = None
    return out.detach(), grads


@pytest.mark.parametrize(("split", "graph_break"), [(False, False), (False, True), (True, False)],
                         ids=["whole", "whole-after-a-break", "split"])
def test_a_stage_guarding_on_its_batch_compiles_with_a_dynamic_batch_and_equals_eager(
        split, graph_break):
    torch.manual_seed(0)
    eager = _Repeats(graph_break)
    compiled = CompiledStage(copy.deepcopy(eager), "aot_eager", split_backward=split)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for size in (4, 2, 1, 3):
            x = torch.randn(size, 8, 3, generator=g)
            want, want_grads = _run(eager, x)
            got, got_grads = (_run_split if split else _run)(compiled, x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            for a, b in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    said = [w for w in warned if "cannot serve every batch size" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in warned]
    assert not compiled.unbacked
    # the running statistics saw each batch once: the failed attempt's update was undone
    for name, value in eager.bn.state_dict().items():
        torch.testing.assert_close(compiled.stage.bn.state_dict()[name], value)


def test_the_compile_option_names_a_backend():
    assert AutoPipeOptions(replan="off").schedules == ("1f1b", "zb-h1", "interleaved-1f1b", "zbv")
    assert AutoPipeOptions(compile="aot_eager").compile_backend == "aot_eager"
    assert AutoPipeOptions(compile=True).compile_backend == "inductor"
    with pytest.raises(ValueError, match="compile must be True, False or a torch.compile"):
        AutoPipeOptions(compile=1)


def test_a_given_zero_bubble_plan_is_refused_when_the_backend_cannot_split():
    n = len(split_model(T.build_net(), (torch.zeros(2, T.SEQ, dtype=torch.long),)))
    plan = Plan("pinned", 8, 2, 1, [StagePlan((0, n), ["local:0"])], schedule="zb-h1")
    with pytest.raises(PlanError, match="splits each backward.*'eager'"):
        build_local_pipeline(T.NetWithLoss(), (torch.zeros(8, T.SEQ, dtype=torch.long),), 8,
                             AutoPipeOptions(plan=plan, compile="eager"), rank=0,
                             world_size=1, device=torch.device("cpu"),
                             broadcast=lambda obj, src: obj)


def test_a_planned_compiled_run_profiles_plans_and_trains_like_eager():
    """The whole path of ``build_local_pipeline`` in one process: eager profile, compiled
    correction, a plan, the compiled stage; its step equals the eager model's."""
    module = T.NetWithLoss()
    reference = copy.deepcopy(module)
    x, y = T.dataset(8, seed=4).tensors
    pipe = build_local_pipeline(module, (x,), 8, AutoPipeOptions(
        compile="aot_eager", num_stages=1, num_microbatches=2, startup_slices=2,
        profile_repeats=1), rank=0, world_size=1, device=torch.device("cpu"),
        broadcast=lambda obj, src: obj)
    assert isinstance(pipe.executor.stage, CompiledStage)
    loss = pipe.executor.train_step((x, y))
    want = reference.pipeline_loss(reference(x), (x, y))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6)
    assert pipe.executor.stage.compilations == 1  # units of 2, 2 and 4 samples


def _profile() -> Profile:
    blocks = [BlockProfile(f"b{i}", forward_ms=10.0 + i, backward_ms=20.0 + i, param_bytes=1,
                           activation_bytes=1, memory_bytes=1, forward_fixed_ms=4.0,
                           backward_fixed_ms=6.0) for i in range(3)]
    return Profile("toy", 4, "cpu", blocks)


def test_the_correction_scales_fixed_and_per_sample_parts_by_the_measured_ratios(monkeypatch):
    """Eager whole model: forward 4 + 2n ms, backward 6 + 4n; compiled: forward 1 + 1.5n,
    backward 3 + 3n (n = 4 and 2 samples). Each block's fixed part must scale by 1/4 (forward)
    and 1/2 (backward), its per-sample part by 3/4 (both)."""
    lines = {"eager": ((4, 2), (6, 4)), "compiled": ((1, 1.5), (3, 3))}

    def timed(fn, inputs, device, repeats):
        n = inputs[0].shape[0]
        kind = "compiled" if isinstance(fn, CompiledStage) else "eager"
        return tuple(a + b * n for a, b in lines[kind])

    monkeypatch.setattr(cs, "_timed", timed)
    blocks = split_model(T.build_net(), (torch.zeros(4, T.SEQ, dtype=torch.long),))
    prof = _profile()
    got, ratios = compiled_profile(prof, blocks, (torch.zeros(4, T.SEQ, dtype=torch.long),),
                                   torch.device("cpu"), backend="aot_eager")
    assert ratios["forward_fixed"] == pytest.approx(0.25)
    assert ratios["backward_fixed"] == pytest.approx(0.5)
    assert ratios["forward_per_sample"] == pytest.approx(0.75)
    assert ratios["backward_per_sample"] == pytest.approx(0.75)
    for old, new in zip(prof.blocks, got.blocks):
        assert new.forward_fixed_ms == pytest.approx(old.forward_fixed_ms * 0.25)
        assert new.forward_ms == pytest.approx(
            old.forward_fixed_ms * 0.25 + (old.forward_ms - old.forward_fixed_ms) * 0.75)
        assert new.backward_ms == pytest.approx(
            old.backward_fixed_ms * 0.5 + (old.backward_ms - old.backward_fixed_ms) * 0.75)
        assert (new.name, new.param_bytes, new.memory_bytes) == (old.name, 1, 1)


def test_a_fit_compiles_once_and_corrects_a_later_profile_by_the_same_ratios(monkeypatch):
    """Discovery's confirming profile is corrected by the ratios measured on the first: the
    whole model is compiled and timed once per fit, and the later profile comes out as a
    fresh measurement of the same lines would correct it."""
    lines = {"eager": ((4, 2), (6, 4)), "compiled": ((1, 1.5), (3, 3))}
    calls = []

    def timed(fn, inputs, device, repeats):
        n = inputs[0].shape[0]
        kind = "compiled" if isinstance(fn, CompiledStage) else "eager"
        calls.append(kind)
        return tuple(a + b * n for a, b in lines[kind])

    monkeypatch.setattr(cs, "_timed", timed)
    example = (torch.zeros(4, T.SEQ, dtype=torch.long),)
    blocks = split_model(T.build_net(), example)
    correct = cs.CompileCorrection("aot_eager", blocks, example, torch.device("cpu"))
    first, later = _profile(), Profile("toy", 4, "cpu", [
        replace(b, forward_ms=2 * b.forward_ms, backward_ms=3 * b.backward_ms)
        for b in _profile().blocks])
    assert correct(first) == compiled_profile(first, blocks, example, torch.device("cpu"),
                                              backend="aot_eager")[0]
    timings = len(calls) // 2  # the reference above timed as often as the correction
    want = compiled_profile(later, blocks, example, torch.device("cpu"), backend="aot_eager")[0]
    before = len(calls)
    assert correct(later) == want
    assert len(calls) == before, "the later profile compiled and timed the model again"
    assert timings == 4  # eager and compiled, at the micro-batch and at half of it
    eager = cs.CompileCorrection(None, blocks, example, torch.device("cpu"))
    assert eager(later) is later


class _Pointwise(nn.Module):
    """Forty pointwise ops on a tiny tensor: eager pays ~20 us per op, inductor fuses them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        for _ in range(20):
            x = torch.tanh(x * self.scale) + 0.1
        return x


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Pointwise(), _Pointwise()

    def forward(self, x):
        return self.b(self.a(x))

    def pipeline_loss(self, outputs, batch):
        return outputs.pow(2).mean()


@pytest.mark.quiet  # asserts on timings taken in this process
def test_inductor_measures_the_fused_model_faster_and_the_profile_follows():
    model = _Chain()
    example = (torch.randn(4, 8),)
    blocks = split_model(model, example)
    prof = _profile()
    prof = Profile("chain", 4, "cpu", prof.blocks[: len(blocks)])
    got, ratios = compiled_profile(prof, blocks, example, torch.device("cpu"),
                                   backend="inductor", repeats=11)
    assert ratios["forward"] < 0.7, ratios  # eager: 80 dispatched ops; compiled: one kernel
    for old, new in zip(prof.blocks, got.blocks):
        assert new.forward_ms == pytest.approx(
            old.forward_fixed_ms * ratios["forward_fixed"]
            + (old.forward_ms - old.forward_fixed_ms) * ratios["forward_per_sample"])


def test_the_profile_holds_what_the_compiled_graph_saves():
    """A compiled graph saves what its partitioner keeps for the backward (aot_eager's
    recomputes the chain's pointwise ops), about half of what the eager ops save here: the
    planner predicted a compiled ALBERT stage at 1.2x its measured peak. The corrected
    profile's blocks save, summed, what the compiled whole model saves (counted as the memory
    meter counts, by saved-tensor hooks)."""
    torch.manual_seed(0)
    model, example = _Chain(), (torch.randn(4, 8),)
    blocks = split_model(model, example)
    prof = profile_blocks(blocks, example, repeats=1)
    got, ratios = compiled_profile(prof, blocks, example, torch.device("cpu"),
                                   backend="aot_eager", repeats=1)
    whole = blocks.stage(0, len(blocks))
    flat = tuple(blocks.flatten_inputs(example))
    compiled = saved_activation_bytes(CompiledStage(copy.deepcopy(whole), "aot_eager"), flat)
    assert compiled < 0.75 * saved_activation_bytes(whole, flat)
    assert ratios["memory"] < 0.75
    assert sum(b.memory_bytes for b in got.blocks) == pytest.approx(compiled, rel=0.02)
