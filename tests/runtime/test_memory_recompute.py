"""The memory meter counts what a recomputing stage re-creates in its backward, in one process.

References: the same stage run without recomputation (a unit's recomputed saves are the
storages its plain forward saved), and gradients taken with no meter at all (counting must
not change what the backward computes).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe.runtime.memory import MemoryMeter
from lightning_autopipe.runtime.recompute import Recomputed

WIDTH, ROWS = 32, 8


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(2 * WIDTH, WIDTH), nn.Tanh())


def _inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, WIDTH, generator=g).requires_grad_() for _ in range(n)]


def _meter(stage: nn.Module, measure_step: int = 1) -> MemoryMeter:
    return MemoryMeter(list(stage.parameters()), torch.device("cpu"), predicted=1, rank=0,
                       stage=0, measure_step=measure_step, report=lambda text: None)


def _step(stage: nn.Module, meter: MemoryMeter | None, inputs: list[torch.Tensor]) -> list:
    """Every unit's forward, then their backwards in reverse (as a stage holds them in
    flight); the parameter and input gradients."""
    torch.manual_seed(2)  # dropout masks
    if meter is not None:
        meter.begin_step()
    outs = []
    for x in inputs:
        if meter is not None:
            with meter.saving():
                outs.append(stage(x))
        else:
            outs.append(stage(x))
    for o in reversed(outs):
        o.square().sum().backward()
    grads = [p.grad.clone() for p in stage.parameters()] + [x.grad.clone() for x in inputs]
    if meter is not None:
        meter.end_step()
    return grads


def _activations(meter: MemoryMeter) -> int:
    assert meter.readings is not None
    return meter.readings[0].activations


@pytest.mark.parametrize("units", [1, 2, 3])
def test_a_recomputed_unit_counts_as_its_plain_forward_on_top_of_the_inputs_in_flight(units):
    plain = _stage()
    one = _meter(plain)
    _step(plain, one, _inputs(1))
    saved_once = _activations(one)  # a unit's saves, its input among them
    stage = _stage()
    meter = _meter(stage)
    inputs = _inputs(units)
    _step(Recomputed(stage, meter), meter, inputs)
    input_bytes = inputs[0].untyped_storage().nbytes()
    # the first backward runs with every unit's input held and its own unit re-created
    assert _activations(meter) == saved_once + (units - 1) * input_bytes
    assert meter._current == 0  # every recomputed storage let go when its backward ended


def test_counting_the_recomputation_changes_no_gradient():
    stage = _stage()
    meter = _meter(stage)
    counted = _step(Recomputed(stage, meter), meter, _inputs(2))
    assert _activations(meter) > 0
    bare = _stage()
    reference = _step(Recomputed(bare), None, _inputs(2))
    kept = _stage()
    plain = _step(kept, None, _inputs(2))
    for a, b, c in zip(counted, reference, plain, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)


def test_checkpoint_gets_the_recompute_context_in_the_measured_step_only():
    stage = _stage()
    meter = _meter(stage, measure_step=2)
    calls: list[int] = []
    real = meter.recompute_contexts
    meter.recompute_contexts = lambda: calls.append(meter._step) or real()
    run = Recomputed(stage, meter)
    _step(run, meter, _inputs(2))  # step 1: not measured, checkpoint as without a meter
    assert meter.readings is None
    assert calls == []
    _step(run, meter, _inputs(2))
    assert calls == [2, 2]  # one context per unit's forward
    assert _activations(meter) > 0
