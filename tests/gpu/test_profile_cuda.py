"""On a CUDA device the profiler's per-block times add up to the whole model's.

The reference is the unsplit model's forward and backward timed with CUDA events (device time
between two points of the stream, no host synchronisation inside); the profiler times each block
alone between host synchronisations. The model is large enough (8 layers of width 1024 over 8 x
512 tokens, tens of milliseconds) that kernels, not launches and synchronisations, fill both.
"""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch

from lightning_autopipe.graph import split_model
from lightning_autopipe.runtime.profiler import profile_blocks
from lightning_autopipe.zoo.models import TinyGPT

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"
VOCAB, SEQ, WIDTH, LAYERS, HEADS, BATCH = 4096, 512, 1024, 8, 16, 8
WARMUP, REPEATS = 2, 5
#: the profiler's floor for a block below the clock's resolution (profiler._MIN_MS)
FLOOR_MS = 1e-3


def _model() -> tuple[TinyGPT, torch.Tensor]:
    torch.manual_seed(0)
    net = TinyGPT(vocab=VOCAB, seq_len=SEQ, d_model=WIDTH, n_layers=LAYERS, n_heads=HEADS)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return net, x


def _stamp(device: torch.device):
    """A point in time on ``device``'s stream (a recorded CUDA event; the host clock on a CPU)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _whole_model_ms(net: TinyGPT, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Median forward and backward ms of the unsplit model (backward from ones, as the profiler
    back-propagates a block's outputs when no loss is given)."""
    model = copy.deepcopy(net).to(device)
    x = x.to(device)
    fwd, bwd = [], []
    for r in range(WARMUP + REPEATS):
        start = _stamp(device)
        out = model(x)
        mid = _stamp(device)
        out.backward(torch.ones_like(out))
        end = _stamp(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r >= WARMUP:
            fwd.append(_elapsed_ms(start, mid))
            bwd.append(_elapsed_ms(mid, end))
        model.zero_grad(set_to_none=True)
        del out
    return statistics.median(fwd), statistics.median(bwd)


def test_block_times_on_cuda_are_measured_and_sum_to_the_whole_model():
    device = torch.device(DEVICE)
    net, x = _model()
    blocks = split_model(net, (x[:2],))
    profile = profile_blocks(blocks, (x,), device=DEVICE, warmup=WARMUP, repeats=REPEATS)
    whole_f, whole_b = _whole_model_ms(net, x, device)
    assert profile.micro_batch_size == BATCH
    for b in profile.blocks:  # measured, not the floor a sub-resolution block gets
        assert b.forward_ms > FLOOR_MS, b
        assert b.backward_ms > FLOOR_MS, b
    sum_f = sum(b.forward_ms for b in profile.blocks)
    sum_b = sum(b.backward_ms for b in profile.blocks)
    report = (
        f"blocks sum to forward {sum_f:.2f} ms, backward {sum_b:.2f} ms; whole model "
        f"forward {whole_f:.2f} ms, backward {whole_b:.2f} ms ({len(profile)} blocks)"
    )
    print(report)
    assert 0.8 <= (sum_f + sum_b) / (whole_f + whole_b) <= 1.25, report
    assert 0.7 <= sum_f / whole_f <= 1.4, report
    assert 0.7 <= sum_b / whole_b <= 1.4, report
