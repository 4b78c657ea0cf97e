"""On a CUDA device, a stage, the profiler and a one-rank pipeline step match the CPU.

Each test runs the same seeded model on the CPU and on ``cuda:0`` and compares within float32
tolerance (TF32 off, ``tests/gpu/conftest.py``: matrix products round as float32 does).
Without CUDA they are skipped (``tests/conftest.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_autopipe.graph import split_model
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from lightning_autopipe.runtime.profiler import profile_blocks
from tests.gpu._common import Model
from tests.gpu._common import batch as _batch
from tests.gpu._common import close as _close

pytestmark = pytest.mark.gpu

CPU = torch.device("cpu")


def test_a_stage_forward_and_backward_on_cuda_equal_the_cpu():
    x, _ = _batch()
    blocks = split_model(Model(), (x,))
    cut = len(blocks) // 2
    for i, j in ((0, cut), (cut, len(blocks))):
        inputs = tuple(t.detach() for t in blocks.flatten_inputs((x,)))
        if i:
            with torch.no_grad():
                inputs = tuple(t.detach() for t in blocks.stage(0, i)(*inputs))
        results = []
        for device in (CPU, torch.device("cuda", 0)):
            stage = copy.deepcopy(blocks.stage(i, j)).to(device)
            vals = [t.to(device) for t in inputs]
            for v in vals:
                if v.is_floating_point():
                    v.requires_grad_(True)
            outs = stage(*vals)
            sum(o.float().pow(2).sum() for o in outs if o.is_floating_point()).backward()
            grads = {n: p.grad for n, p in stage.named_parameters()}
            results.append((outs, grads))
        (cpu_outs, cpu_grads), (gpu_outs, gpu_grads) = results
        for k, (a, b) in enumerate(zip(gpu_outs, cpu_outs)):
            _close(a, b, f"stage [{i}, {j}) output {k}")
        assert gpu_grads.keys() == cpu_grads.keys()
        for name, g in gpu_grads.items():
            _close(g, cpu_grads[name], f"stage [{i}, {j}) grad of {name}")


def test_profiling_on_cuda_measures_the_same_blocks_and_leaves_the_model_on_the_cpu():
    x, y = _batch(4)
    model = Model()
    blocks = split_model(model, (x,))
    on_cpu = profile_blocks(blocks, (x,), device="cpu", repeats=1)
    on_gpu = profile_blocks(blocks, (x,), device="cuda:0", repeats=2)
    assert on_gpu.device == "cuda:0"
    assert on_gpu.fingerprint == on_cpu.fingerprint
    assert on_gpu.names == on_cpu.names
    for g, c in zip(on_gpu.blocks, on_cpu.blocks):
        assert (g.param_bytes, g.activation_bytes) == (c.param_bytes, c.activation_bytes), g.name
        assert g.forward_ms > 0
        assert g.backward_ms > 0
    assert all(p.device == CPU for p in model.parameters())


def _one_rank_step(device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module = Model()
    x, y = _batch()
    plan = Plan("manual", 8, 2, 2, [StagePlan((0, len(split_model(Model(), (x[:2],)))),
                                              ["local:0"])])
    pipe = build_local_pipeline(
        module,
        (x[:2],),
        8,
        AutoPipeOptions(plan=plan),
        rank=0,
        world_size=1,
        device=device,
        broadcast=lambda obj, src: obj,
    )
    loss = pipe.executor.train_step((x.to(device), y.to(device)))
    grads = {n: p.grad.cpu() for n, p in module.named_parameters() if p.grad is not None}
    return loss.cpu(), grads


def test_a_one_rank_pipeline_step_on_cuda_equals_the_cpu():
    """Two micro-batches, the first in two slices, forward, loss and backward on the device."""
    cpu_loss, cpu_grads = _one_rank_step(CPU)
    gpu_loss, gpu_grads = _one_rank_step(torch.device("cuda", 0))
    _close(gpu_loss, cpu_loss, "loss")
    assert gpu_grads.keys() == cpu_grads.keys()
    assert cpu_grads  # the step computed gradients
    for name, g in gpu_grads.items():
        _close(g, cpu_grads[name], f"grad of {name}")
