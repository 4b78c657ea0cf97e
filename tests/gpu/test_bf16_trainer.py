"""``precision="bf16-mixed"`` on CUDA through Lightning's Trainer trains like autocast does.

Three steps of ``Trainer(strategy=AutoPipeStrategy(...), precision="bf16-mixed")`` on one GPU
(one stage, two micro-batches, the first in two slices) run in a subprocess
(``tests/gpu/_trainer_run.py``) so the Trainer's process group stays out of this process. The
losses must be finite and fall on the batch the task overfits, track plain training of the
same model under ``torch.autocast(bfloat16)`` on the same device, and the checkpoint written
on the GPU must load strictly into the model on the CPU.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_autopipe.planner.plan import Plan
from tests._launch import launch_env
from tests.reliability import _task as T

pytestmark = pytest.mark.gpu

ACCELERATOR, DEVICE = "cuda", "cuda:0"
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "_trainer_run.py"
STEPS = 3


def _reference(device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training on the same batches: whole batch, autocast to bfloat16, Adam."""
    net = T.build_net(0.0, 16, 0).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=T.LR, eps=T.ADAM_EPS)
    losses = []
    for x, y in T.global_batches(STEPS, steps_per_epoch=1):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = T.lm_loss(net(x), (x, y))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {f"net.{k}": v.detach().cpu() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bf16")
    cmd = [sys.executable, str(SCRIPT), str(out), ACCELERATOR]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        pytest.fail(f"the Trainer run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {**torch.load(out / "run.pt"), "ckpt": out / "ckpt" / "last.ckpt"}


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return _reference(torch.device(DEVICE))


def test_bf16_mixed_trains_three_steps_on_cuda_like_autocast(run, reference):
    plan = Plan.from_json(run["plan"])
    assert (plan.num_stages, plan.num_microbatches, plan.startup_slices) == (1, 2, 2)
    assert run["param_devices"] == [ACCELERATOR]
    assert run["logits"] == ("bfloat16", ACCELERATOR)  # the stage ran under autocast
    losses = run["losses"]
    assert len(losses) == STEPS
    assert all(math.isfinite(v) for v in losses), losses
    assert all(b < a for a, b in zip(losses, losses[1:])), f"loss did not fall: {losses}"
    print(f"bf16-mixed pipeline losses {losses}, autocast reference {reference[0]}")
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference[0]), rtol=2e-2, atol=1e-3
    )


def test_the_checkpoint_written_on_cuda_loads_strictly_into_a_cpu_model(run, reference):
    saved = torch.load(run["ckpt"], map_location="cpu", weights_only=False)["state_dict"]
    model = T.Task()
    model.load_state_dict(saved, strict=True)
    for name, value in model.state_dict().items():  # the weights training ended with
        torch.testing.assert_close(value, run["state"][name], rtol=0, atol=0)
    for name, value in model.state_dict().items():  # and what autocast training reaches
        torch.testing.assert_close(value, reference[1][name], rtol=2e-2, atol=2e-3)
