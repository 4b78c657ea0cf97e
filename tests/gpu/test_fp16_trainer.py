"""``16-mixed`` through Lightning's Trainer on one device equals fp16 autocast with the same
scaler: the overflow of ``tests/lightning/_fp16``'s net at step 2 is skipped and the scale
backs off as ``torch.amp.GradScaler`` does; losses and weights agree within fp16 rounding.

The CUDA case carries the ``gpu`` marker (skipped without CUDA); the CPU case is the same test
with the explicit CPU plugin, so the code path the GPU runs is exercised here too. On CUDA the
plain ``precision="16-mixed"`` flag must also end up with the pipeline's scaler.
Tolerances: those of ``tests/lightning/test_fp16.py`` (slices are rounded to fp16 on their own).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._launch import launch_env
from tests.lightning import _fp16 as F16

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "_fp16_trainer_run.py"
LOSS_RTOL, WEIGHT_ATOL = 2 * 2.0**-11, 2e-4


@pytest.mark.parametrize(
    "accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
@pytest.mark.one_child  # one device: one process
def test_16_mixed_on_one_device_skips_the_overflow_like_grad_scaler(tmp_path, accelerator):
    env = launch_env()
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), accelerator]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        pytest.fail(f"the Trainer run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    run = torch.load(tmp_path / "run.pt", weights_only=False)
    rows = run["rows"]
    batches = [tuple(r["batch"]) for r in rows]
    ref = F16.reference(batches, device="cuda:0" if accelerator == "cuda" else "cpu")
    assert run["scaler_class"] == "PipelineGradScaler"
    if accelerator == "cuda":
        assert run["flag_scaler_class"] == "PipelineGradScaler"
    want = [step == F16.OVERFLOW_STEP for step in range(F16.STEPS)]
    assert ref["skipped"] == want
    assert [r["found_inf"] for r in rows] == want
    assert [r["scale"] for r in rows] == pytest.approx(ref["scales"], rel=1e-6)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]),
                               torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    for name, value in rows[-1]["state"].items():
        torch.testing.assert_close(value, ref["states"][-1][name], rtol=0, atol=WEIGHT_ATOL)
