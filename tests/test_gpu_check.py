"""``benchmarks/gpu_check.sh``: its syntax, and its CPU fallback end to end.

``--cpu`` runs what the GPU check runs (the ``gpu`` tests, which skip here; profiles of the
recipe models in fp32 and bf16; a timed step next to the 1-stage prediction) at tiny sizes.
Its outputs must parse: every profile loads as a :class:`Profile` naming the device and the
precision, and each row's prediction is what the simulator gives for the profile written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
MODELS, PRECISIONS = ("gpt2", "bert_base", "resnet50"), ("fp32", "bf16")

# bash, and the script's steps one after another, each one process (tests/_machine.py)
pytestmark = pytest.mark.one_child


def test_the_gpu_check_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_gpu_check_refuses_an_unknown_argument(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--gpu"], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 2
    assert "unknown argument '--gpu'" in proc.stderr


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "PYTEST_ADDOPTS"):
        env.pop(key, None)
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out


@pytest.mark.slow
def test_the_cpu_fallback_writes_profiles_steps_and_a_test_summary(cpu_run):
    out = cpu_run
    log = (out / "gpu_check.log").read_text()
    assert log.startswith("Reproduce: bash benchmarks/gpu_check.sh --cpu")
    status = (out / "status.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in status] == ["tests", "profiles"]
    assert all(" exit 0 " in line for line in status), status
    # the gpu tests were collected and skipped cleanly (no CUDA here)
    tests = json.loads((out / "tests.json").read_text())
    assert tests["counts"]["skipped"] == len(tests["cases"]) >= 8
    assert {c["test"].split("::")[0] for c in tests["cases"]} >= {
        "tests.gpu.test_cuda", "tests.gpu.test_profile_cuda", "tests.gpu.test_shared_gpu",
        "tests.gpu.test_bf16_trainer",
    }
    env = json.loads((out / "env.json").read_text())
    steps = json.loads((out / "steps.json").read_text())
    assert steps["env"] == env
    rows = {(r["model"], r["precision"]): r for r in steps["rows"]}
    assert sorted(rows) == sorted((m, p) for m in MODELS for p in PRECISIONS)
    for (model, precision), row in rows.items():
        assert "skipped" not in row, row
        prof = Profile.load(out / row["profile"])
        assert prof.model == model
        assert prof.device == row["device"] == f"{env['device']} (cpu, {precision})"
        assert prof.micro_batch_size == row["micro_batch"] == 2
        assert len(prof) == row["blocks"]
        assert row["forward_backward_ms"] > 0
        assert row["optimizer_ms"] > 0
        cluster = Cluster.local(1, device_name="measured", memory_gb=64)
        plan = make_plan(prof, cluster, 2, num_stages=1, replicas=1, num_microbatches=1,
                         startup_slices=1, drain_slices=1, memory_check=False)
        assert row["predicted_ms"] == pytest.approx(plan.iteration_ms, rel=1e-9)
    table = (out / "steps.md").read_text()
    assert "Reproduce: `bash benchmarks/gpu_check.sh`" in table
    assert sum(line.startswith(("| gpt2 ", "| bert_base ", "| resnet50 "))
               for line in table.splitlines()) == len(rows)
