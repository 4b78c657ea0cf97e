"""Checkpoints across layouts, NaN handling, determinism and a soak, with real Lightning ranks.

One launch of ``tests/reliability/_run.py`` on 4 gloo ranks runs every pipeline case in turn;
this process runs the ``strategy="auto"`` single-device reference (and the resume of a pipeline
checkpoint under ``"auto"``) with the same batches. Every global step sees the same samples in
every layout (see ``_task.py``), so per-step losses must agree across layouts and strategies.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_autopipe.checkpoint import read_model_state
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.speeds import check_due
from tests.reliability import _task as T
from tests.reliability._run import SOAK, auto_fit

CASES = [
    "ckpt_2x2",
    "resume_4x1",
    "resume_auto_2x2",
    "sharded_2x2",
    "resume_sharded_4x1",
    "nan_raise",
    "nan_skip",
    "soak",
    "det_a",
    "det_b",
]
RTOL, ATOL = 1e-5, 1e-6
RESUMED = slice(2 * T.STEPS_PER_EPOCH, None)  # steps after the epoch-1 checkpoint
# A leak of one activation of the soak's smallest unit is 32 KiB/step (see _run.SOAK); torch and
# gloo add ~10 KiB/step of bookkeeping here whatever the model size (measured: the same for
# d_model 64 and 256) while a process is young, settling to 0.3-2.5 KiB/step from about its
# 400th step on (measured over 800 soak steps), so growth above 24 KiB/step means the runtime
# keeps something per step.
LEAK_KIB_PER_STEP = 24.0

pytestmark = pytest.mark.slow


MODULE = "tests.reliability._run"
WORLD_CASES = {4: [f"{MODULE}:{case}" for case in CASES]}


@pytest.fixture(scope="module")
def runs(worlds):
    out = worlds.folder(4, MODULE)
    records = {c: worlds.results(4, MODULE, c) for c in CASES}
    auto_resumed = auto_fit(out, ckpt_path=out / "ckpt" / "2x2" / "epoch=1.ckpt")
    return SimpleNamespace(out=out, auto=torch.load(out / "auto_losses.pt"), records=records,
                           auto_resumed=auto_resumed)


def _losses(runs, case: str) -> torch.Tensor:
    """The case's per-step losses, after checking every rank saw the same and none failed."""
    ranks = runs.records[case]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
    losses = [torch.tensor(rec["losses"], dtype=torch.float64) for rec in ranks]
    for rank, mine in enumerate(losses):  # every rank returns the same global loss
        torch.testing.assert_close(mine, losses[0], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda s, r=rank: f"{case}: rank {r} vs rank 0: {s}")
    return losses[0]


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               rtol=RTOL, atol=ATOL, msg=lambda s: f"{what}: {s}")


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


# -------------------------------------------------------------------------------- checkpoints
def test_uninterrupted_pipeline_matches_auto(runs):
    assert len(runs.auto) == 4 * T.STEPS_PER_EPOCH
    _close(_losses(runs, "ckpt_2x2"), runs.auto, "2x2 vs strategy=auto")


def test_pipeline_checkpoint_loads_into_the_plain_model(runs):
    """(a) whole model + optimizer under the original names, as strategy="auto" writes them."""
    ck = runs.out / "ckpt"
    for ours, theirs in (("2x2/epoch=1.ckpt", "auto/epoch=1.ckpt"),
                         ("2x2/final.ckpt", "auto/epoch=3.ckpt")):  # final: saved after fit
        mine, ref = _load(ck / ours), _load(ck / theirs)
        plain = T.Task(1, init_seed=3)
        plain.load_state_dict(mine["state_dict"], strict=True)
        assert list(mine["state_dict"]) == list(ref["state_dict"])
        for key, value in ref["state_dict"].items():
            _close(plain.state_dict()[key], value, f"{ours} {key}")
        got, want = mine["optimizer_states"][0], ref["optimizer_states"][0]
        assert got["param_groups"][0]["params"] == want["param_groups"][0]["params"]
        assert got["param_names"] == [[n for n, _ in plain.named_parameters()]]
        for pid, state in want["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                _close(got["state"][pid][key], state[key], f"{ours} optimizer {pid} {key}")
    sharded = ck / "sharded"
    assert sorted(p.name for p in sharded.iterdir()) == ["epoch=1.ckpt"]  # epoch=0 removed
    plain = T.Task(1, init_seed=3)
    plain.load_state_dict(read_model_state(sharded / "epoch=1.ckpt"), strict=True)
    for key, value in _load(ck / "auto" / "epoch=1.ckpt")["state_dict"].items():
        _close(plain.state_dict()[key], value, f"sharded {key}")


def test_resume_in_another_layout_continues_the_run(runs):
    """(b) 2 stages x 2 replicas -> 4 stages x 1, Adam moments included, both formats."""
    uninterrupted = _losses(runs, "ckpt_2x2")[RESUMED]
    resumed = _losses(runs, "resume_4x1")
    assert len(resumed) == len(uninterrupted) == 2 * T.STEPS_PER_EPOCH
    _close(resumed, uninterrupted, "consolidated 2x2 -> 4x1")
    _close(_losses(runs, "sharded_2x2"), runs.auto[: 2 * T.STEPS_PER_EPOCH], "sharded 2x2")
    _close(_losses(runs, "resume_sharded_4x1"), uninterrupted, "sharded 2x2 -> 4x1")


def test_checkpoints_move_between_auto_and_autopipe(runs):
    """(c) strategy="auto" -> AutoPipe 2x2 and AutoPipe 2x2 -> strategy="auto"."""
    _close(_losses(runs, "resume_auto_2x2"), runs.auto[RESUMED], "auto -> autopipe")
    assert len(runs.auto_resumed) == 2 * T.STEPS_PER_EPOCH
    _close(runs.auto_resumed, runs.auto[RESUMED], "autopipe -> auto")


# ------------------------------------------------------------------------------ NaN, seeds
def test_nonfinite_loss_raises_on_every_rank_naming_step_and_stage(runs):
    for rec in runs.records["nan_raise"]:
        kind, message = rec["error"]
        assert kind == "PipelineRuntimeError"
        assert "non-finite training loss nan at step 1" in message
        assert "outputs of stage 0 (blocks [0, " in message
        assert "ranks [0]" in message
        assert "nonfinite_loss='skip'" in message
        _close(rec["losses"], runs.auto[:1], "the step before the NaN")


def test_nonfinite_loss_skip_drops_that_step_everywhere(runs):
    losses = _losses(runs, "nan_skip")
    expected = T.reference_losses(len(losses), skip_steps=(1,))
    assert torch.isnan(losses[1])
    keep = [0, *range(2, len(losses))]
    _close(losses[keep], torch.tensor(expected)[keep], "skip step 1")


def test_same_seed_and_plan_give_identical_losses(runs):
    a = [row["train_loss"] for _, row in runs.records["det_a"][0]["logged"] if "train_loss" in row]
    b = [row["train_loss"] for _, row in runs.records["det_b"][0]["logged"] if "train_loss" in row]
    assert len(a) == 3
    assert a == b  # bit for bit, dropout on


# ------------------------------------------------------------------------------------ soak
def test_soak_memory_is_flat_and_loss_matches_single_process(runs):
    expected = T.reference_losses(
        200, optimizer="sgd", d_model=SOAK["d_model"], steps_per_epoch=SOAK["steps_per_epoch"],
        global_batch=SOAK["global_batch"],
    )
    losses = _losses(runs, "soak")
    assert len(losses) == 200
    _close(losses, expected, "soak vs single process")
    for rec in runs.records["soak"]:
        rss = np.asarray(rec["rss"], dtype=np.float64) / 1024
        assert len(rss) == 200
        # re-plan checks ran at every boundary the rule names (from 50 steps after the start
        # or the last switch, every 10), however many switches the machine's load caused
        assert rec["replan_checks"] == _boundaries(200, rec["switch_steps"]) >= 4, rec
        slope, jumps = _growth(rss, 100, 200, rec["switch_steps"])  # KiB per step, warm
        assert slope < LEAK_KIB_PER_STEP, (
            f"rank {rec['rank']}: RSS grows {slope:.1f} KiB/step (median) over steps 100-199 "
            f"between "
            f"switches ({rss[100] / 1024:.1f} -> {rss[-1] / 1024:.1f} MiB; switches after "
            f"steps {rec['switch_steps']}, each a one-off step of {jumps} KiB)"
        )


def _boundaries(steps: int, switches: list[int]) -> int:
    """Re-plan checks in ``steps`` steps by the default options (window 10, the first 51 steps
    after the start or a switch), given the steps after which it switched."""
    options = AutoPipeOptions()
    last, count = 0, 0
    for step in range(1, steps + 1):
        if check_due(step - last, options):
            count += 1
            if step in switches:
                last = step
    return count


#: Samples after a switch left out of the slope: a new layout's stage, groups and executor
#: settle their allocations over its first steps (measured on the soak: 19-63 KiB/step in the
#: 20 steps after a switch, 0-4 from 60 steps on), which is no per-step growth either.
SETTLE_STEPS = 30


def _growth(rss: np.ndarray, start: int, end: int, switches: list[int]) -> tuple[float, list]:
    """KiB per step of ``rss[start:end]``: the median of its 10-step increments (divided by
    10) inside the stretches between switches (a switch builds a new stage, groups and
    executor once, which is no per-step growth), from :data:`SETTLE_STEPS` after each switch;
    and each switch's one-off step (KiB).

    The median, not a fitted slope: the allocator grows the heap now and then by ~0.8 MiB at
    once (seen 30-80 steps after a switch), which moved a least-squares slope over 50 samples
    by ~16 KiB/step (a fresh clone's soak failed at 28.4 with a median of 10.4); a leak adds to
    every step, so every increment, and the median, shows it."""
    # the sample of step s (0-based) is taken after it; a switch after step k is made in
    # step k - 1, so samples k - 1 and on belong to the next stretch
    made = sorted(k - 1 for k in switches)
    edges = sorted({start, end, *(k for k in made if start < k < end)})
    increments, jumps = [], []
    for a, b in zip(edges, edges[1:]):
        settled = max([a, *(k + SETTLE_STEPS for k in made if k <= a)])
        increments += [(rss[i + 10] - rss[i]) / 10 for i in range(settled, b - 10)]
        if b < end:
            jumps.append(round(float(rss[b] - rss[b - 1])))
    assert increments, f"no 10 settled steps between the switches {switches} in {start}-{end}"
    return float(np.median(increments)), jumps


def test_the_soak_growth_sees_a_leak_and_not_a_one_off_heap_growth():
    """The soak's measure: 10 KiB/step of a young process with a 0.8 MiB heap growth 40 steps
    after a switch stays under the bound; a 32 KiB/step leak (one activation of the soak's
    smallest unit) on top of it does not; a switch's own step is reported apart."""
    steps = np.arange(200, dtype=np.float64)
    young = 500_000 + 10 * steps
    young[111:] += 3_000  # the switch after step 112 (made in step 111): a one-off step
    young[151:] += 800  # the heap grows once
    slope, jumps = _growth(young, 100, 200, [51, 112])
    assert slope == pytest.approx(10)
    assert slope < LEAK_KIB_PER_STEP
    assert jumps == [3_010]
    leaking = young + 32 * steps
    leak = _growth(leaking, 100, 200, [51, 112])[0]
    assert leak == pytest.approx(42)
    assert leak > LEAK_KIB_PER_STEP
