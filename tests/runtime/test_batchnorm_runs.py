"""BatchNorm models on two real ranks (one launch of ``_batchnorm_run.py``, three cases).

* Reproducible: ``deterministic=True``, the same seed, two fresh folders, discovery on and no
  plan: the same plan counts, the same logged losses, the same final state.
* Whole-batch statistics: both runs' running statistics equal one process's, which runs the
  same units (per-slice normalisation) and updates the statistics once per step from the
  whole mini-batch with torch's own ``F.batch_norm``.
* Replicas: 1 stage x 2 replicas, slices smaller than the batch: after training both replicas
  hold the same buffers, the first replica's (DDP's ``broadcast_buffers``), equal to the
  one-process reference over that replica's batches.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_autopipe.planner.plan import Plan
from tests._launch import launch_env
from tests.runtime import _cases as C

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runtime" / "_batchnorm_run.py"
CASES = ["det-a", "det-b", "replicas"]
WORLD = 2

# Its runs plan from the profiles their ranks take, but no assertion depends on the plan: the
# counts are fixed by deterministic=True's rule, and two runs whose cuts and schedules differ
# still train the same (beside a busy core, det-a ran ZB-H1 at cuts [0, 2, 6] and det-b 1F1B
# with the same losses). So it runs beside the launch lane like any other ranks test.
pytestmark = [pytest.mark.slow, pytest.mark.ranks]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bn")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), str(WORLD), *CASES],
                          cwd=out, env=launch_env(), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        pytest.fail(f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    records = {c: [torch.load(out / f"{c}.rank{r}.pt", weights_only=False)
                   for r in range(WORLD)] for c in CASES}
    return records, proc.stdout + proc.stderr


def _reference(replicas: int, m: int, k: int, j: int) -> dict[str, torch.Tensor]:
    """One process: SGD on the global batch's units; statistics once per step from replica
    0's whole batch (every replica holds replica 0's after the step)."""
    net = C.build_net("cnn_bn").train()
    bns = [mod for mod in net.modules() if isinstance(mod, _BatchNorm)]
    opt = torch.optim.SGD(net.parameters(), lr=C.LR)
    b = C.REPLICA_BATCH
    num = b * C.STEPS * replicas
    data = C.dataset("cnn_bn", num, seed=1)
    idx = [C.replica_indices(num, replicas, r, shuffle=True) for r in range(replicas)]
    for t in range(C.STEPS):
        seen: dict[int, list[torch.Tensor]] = {id(mod): [] for mod in bns}
        for mod in bns:
            mod.track_running_stats = False
        for r in range(replicas):
            part = tuple(d[idx[r][t * b:(t + 1) * b]] for d in data)
            hooks = [mod.register_forward_pre_hook(
                lambda mod, a, seen=seen: seen[id(mod)].append(a[0].detach()))
                for mod in bns] if r == 0 else []
            for lo, hi in C.unit_slices(b, m, k, j):
                unit = tuple(d[lo:hi] for d in part)
                loss = C.loss_fn(net(unit[0]), unit) * ((hi - lo) / b) / replicas
                loss.backward()
            for h in hooks:
                h.remove()
        for mod in bns:
            mod.track_running_stats = True
            with torch.no_grad():
                mod.num_batches_tracked += 1
                F.batch_norm(torch.cat(seen[id(mod)]), mod.running_mean, mod.running_var,
                             training=True, momentum=mod.momentum, eps=mod.eps)
        opt.step()
        opt.zero_grad()
    return {f"net.{k_}": v.detach().clone() for k_, v in net.state_dict().items()}


def _merged(ranks: list[dict]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for rec in ranks:
        for key, value in rec["state"].items():
            if key in state:
                assert torch.equal(value, state[key]), f"replicas differ on {key}"
            state[key] = value
    return state


def _close_states(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), rtol=1e-5, atol=1e-6,
                                   msg=lambda s, key=key: f"{what} {key}: {s}")


def test_deterministic_runs_of_one_seed_plan_and_log_the_same(runs):
    records, _ = runs
    a, b = records["det-a"], records["det-b"]
    plans = [Plan.from_json(r[0]["plan"]) for r in (a, b)]
    # the depth in ranks: the planner may still give a rank several chunks (num_stages counts
    # those), which moves work between ranks but not the arithmetic of the step
    counts = [(p.num_ranks, p.num_microbatches, p.startup_slices, p.drain_slices)
              for p in plans]
    assert counts[0] == counts[1] == (2, 4, 1, 1), counts  # the rule: 4 = 2 x depth
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"], (ra["losses"], rb["losses"])
    logged = [[row["train_loss"] for _, row in r[0]["logged"] if "train_loss" in row]
              for r in (a, b)]
    assert logged[0] == logged[1], logged
    assert len(logged[0]) == C.STEPS, logged
    _close_states(_merged(a), _merged(b), "det-a vs det-b")


def test_running_statistics_equal_one_process_over_the_whole_batch(runs):
    records, _ = runs
    plan = Plan.from_json(records["det-a"][0]["plan"])
    want = _reference(1, plan.num_microbatches, plan.startup_slices, plan.drain_slices)
    _close_states(_merged(records["det-a"]), want, "2 stages")


def test_replicas_hold_the_first_replicas_buffers_after_every_step(runs):
    records, text = runs
    ranks = records["replicas"]
    plan = Plan.from_json(ranks[0]["plan"])
    assert (plan.num_stages, plan.replicas, plan.startup_slices) == (1, 2, 2)
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key
    want = _reference(2, plan.num_microbatches, plan.startup_slices, plan.drain_slices)
    _close_states(ranks[0]["state"], want, "1 stage x 2 replicas")
    assert text.count("BatchNorm: in training each layer normalises over") == 3  # once a fit
