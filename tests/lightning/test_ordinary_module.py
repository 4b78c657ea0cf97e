"""An ordinary LightningModule under the pipeline equals strategy="auto" (real gloo ranks).

One launch of ``tests/lightning/_run.py`` per world size (2: two stages, 4: two stages x two
replicas; micro-batch 0 in three startup slices of 2, 2 and 1 samples) runs every case in turn;
this process runs the same calls under ``strategy="auto"`` on one process over the same global
batches (``_module.run_sequence``) as the reference.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_autopipe.checkpoint import read_model_state
from lightning_autopipe.errors import UnsafeCheckpointError
from lightning_autopipe.planner.plan import Plan
from tests.lightning import _module as M
from tests.lightning import _run
from tests.lightning._run import (
    NO_HANG_S,
    SLOW_FORWARD_S,
    TELEMETRY_EVERY,
    TELEMETRY_STEPS,
    crafted_checkpoint,
    readme_inputs,
)

CASES = {2: ["ordinary", "sharded", "twice", "never", "metric", "optimizer", "crafted", "readme",
             "telemetry", "accumulate", "rankdata"],
         4: ["ordinary", "twice-replica1", "accumulate", "uneven"]}
RTOL, ATOL = 1e-5, 1e-6

pytestmark = pytest.mark.slow


MODULE = "tests.lightning._run"
WORLD_CASES = {world: [f"{MODULE}:{case}" for case in cases] for world, cases in CASES.items()}


def _auto(tmp: Path, replicas: int) -> dict:
    import lightning.pytorch as pl

    def factory(**kw):
        return pl.Trainer(strategy="auto", accelerator="cpu", devices=1, log_every_n_steps=1,
                          enable_progress_bar=False, num_sanity_val_steps=0,
                          default_root_dir=str(tmp), **kw)

    return M.run_sequence(factory, replicas, explicit_sampler=True, ckpt_dir=tmp / "ckpt") | (
        M.run_accumulate(factory, replicas, explicit_sampler=True))


def _runs(world: int, worlds, tmp_path_factory) -> SimpleNamespace:
    torch.set_num_threads(1)
    ranks = {c: worlds.results(world, MODULE, c) for c in CASES[world]}
    return SimpleNamespace(world=world, replicas=world // 2, out=worlds.folder(world, MODULE),
                           auto=_auto(tmp_path_factory.mktemp(f"auto{world}"), world // 2),
                           ranks=ranks)


@pytest.fixture(scope="module")
def runs2(worlds, tmp_path_factory):
    """2 stages x 1 replica."""
    return _runs(2, worlds, tmp_path_factory)


@pytest.fixture(scope="module")
def runs4(worlds, tmp_path_factory):
    """2 stages x 2 replicas."""
    return _runs(4, worlds, tmp_path_factory)


@pytest.fixture(params=["runs2", "runs4"], ids=["2x1", "2x2"])
def runs(request, worlds):
    """The parametrised run (``worlds`` named here, so that these tests run in the
    suite's launch lane: a lazy ``getfixturevalue`` alone hides it from the lane split)."""
    return request.getfixturevalue(request.param)


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               rtol=RTOL, atol=ATOL, msg=lambda s: f"{what}: {s}")


def _series(rows, key: str) -> list[tuple[int, float]]:
    return [(step, row[key]) for step, row in rows if key in row]


def _ordinary(runs) -> list[dict]:
    ranks = runs.ranks["ordinary"]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
    return ranks


def _same_logs(rows, expected, keys, what: str) -> None:
    for key in keys:
        got, want = _series(rows, key), _series(expected, key)
        assert [s for s, _ in got] == [s for s, _ in want], f"{what} {key}: steps"
        assert want, f"{what}: the reference logged no {key}"
        _close([v for _, v in got], [v for _, v in want], f"{what} {key}")


def _whole_state(ranks: list[dict], key: str) -> dict:
    merged: dict = {}
    for rec in ranks:
        for name, value in rec[key].items():
            if name in merged:  # replicas (and tied copies) hold the same values
                _close(value, merged[name], f"rank {rec['rank']} {name} vs another replica")
            merged[name] = value
    return merged


# ------------------------------------------------------------------------- training and logs
def test_logged_losses_accuracies_and_parameters_equal_auto(runs):
    ranks = _ordinary(runs)
    plan = Plan.from_json(ranks[0]["plan"])
    # the depth in ranks: auto may give each rank several chunks (num_stages counts those)
    assert (plan.num_ranks, plan.replicas, plan.startup_slices) == (2, runs.replicas,
                                                                    M.STARTUP_SLICES)
    assert sorted(rec["replica"] for rec in ranks) == sorted(list(range(runs.replicas)) * 2)
    for rec in ranks:  # logged once, on every rank, as under DDP
        _same_logs(rec["fit_logged"], runs.auto["fit_logged"],
                   ["train_loss", "train_acc", "val_loss", "val_acc", "train_samples",
                    "val_samples"], f"rank {rec['rank']}")
    assert len(_series(ranks[0]["fit_logged"], "train_loss")) == M.EPOCHS * M.TRAIN_STEPS
    assert len(_series(ranks[0]["fit_logged"], "val_loss")) == M.EPOCHS
    state = _whole_state(ranks, "fit_state")
    assert set(state) == set(runs.auto["fit_state"])
    for name, value in runs.auto["fit_state"].items():
        _close(state[name], value, f"parameter {name} after fit")


def test_accumulate_grad_batches_steps_on_the_windows_gradients_like_auto(runs):
    """Windows of 2 batches and, at each epoch's end, 1: the same optimizer steps, logged
    losses and weights as one process accumulating over the same batches (a batch's
    gradients lost, or not divided by the window, would move the weights elsewhere)."""
    ranks = runs.ranks["accumulate"]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
        assert rec["acc_steps"] == runs.auto["acc_steps"] == M.EPOCHS * -(
            -M.TRAIN_STEPS // M.ACCUMULATE)
        _same_logs(rec["acc_logged"], runs.auto["acc_logged"], ["train_loss", "train_acc"],
                   f"accumulating, rank {rec['rank']}")
    state = _whole_state(ranks, "acc_state")
    assert set(state) == set(runs.auto["acc_state"])
    for name, value in runs.auto["acc_state"].items():
        _close(state[name], value, f"parameter {name} after accumulating")
    one_step = runs.auto["fit_state"]  # not trivially equal: accumulation changed the training
    assert any(not torch.equal(v, one_step[k]) for k, v in runs.auto["acc_state"].items())


def test_uneven_replica_batches_train_and_log_like_auto(runs4):
    """Replicas dealt 13 and 7 of their 2 x 10 loaded samples per step: each rank trains its
    share, yet the weights, the optimizer steps and the synced logs (means over the global
    batch) are one process's on the same global batches."""
    ranks = runs4.ranks["uneven"]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
        replica = 0 if rec["rank"] in (0, 2) else 1  # fixed_plan: local:0/2 are replica 0
        assert set(rec["samples"]) == {_run.UNEVEN[replica]}, rec["samples"]
        assert rec["acc_steps"] == runs4.auto["acc_steps"]
        _same_logs(rec["acc_logged"], runs4.auto["acc_logged"],
                   ["train_loss", "train_acc", "train_samples"], f"uneven, rank {rec['rank']}")
    state = _whole_state(ranks, "acc_state")
    for name, value in runs4.auto["acc_state"].items():
        _close(state[name], value, f"parameter {name} after uneven replica batches")


def test_model_checkpoint_monitoring_val_loss_picks_the_same_best_epoch(runs):
    for rec in _ordinary(runs):
        name, score = rec["best"]
        assert name == runs.auto["best"][0]
        _close(score, runs.auto["best"][1], "best val_loss")


def test_summary_counts_every_stage(runs):
    ranks = _ordinary(runs)
    whole = runs.auto["summary"]
    seen = ranks[0]["summary"]
    assert (seen["total"], seen["trainable"]) == (whole["total"], whole["trainable"])
    assert seen["layers"] == whole["layers"]
    assert "Params per Device" in seen["columns"]


# ----------------------------------------------------------------------- re-entry after fit
def test_validate_test_and_predict_after_fit_return_what_auto_returns(runs):
    auto = runs.auto
    for rec in _ordinary(runs):
        for call in ("validate", "test"):
            assert [sorted(d) for d in rec[call]] == [sorted(d) for d in auto[call]]
            for got, want in zip(rec[call], auto[call]):
                for key, value in want.items():
                    _close(got[key], value, f"rank {rec['rank']} {call} {key}")
        replica = rec["replica"]
        for key in ("probs", "label"):
            got = torch.cat([p[key] for p in rec["predict"]])
            want = torch.cat([p[key] for p in auto["predict"]])[replica :: runs.replicas]
            _close(got, want, f"rank {rec['rank']} predictions {key}")
            written = torch.cat([p[key] for p in rec["written"]])
            _close(written, got, f"rank {rec['rank']} prediction writer {key}")
        # on_validation_batch_end gets validation_step's dict joined over the slices (its
        # logits in batch order), on_test_batch_end test_step's loss: the batch's mean
        seen, want = rec["batch_outputs"], auto["batch_outputs"]
        assert [sorted(o) for o in seen["validate"]] == [["logits", "loss"]] * len(
            seen["validate"])
        got = torch.cat([o["logits"] for o in seen["validate"]])
        _close(got, torch.cat([o["logits"] for o in want["validate"]])[replica :: runs.replicas],
               f"rank {rec['rank']} on_validation_batch_end logits")
        assert all(o.dim() == 0 for o in seen["test"])
        if runs.replicas == 1:  # the same batches as the reference: the same batch means
            for call, pick in (("validate", lambda o: o["loss"]), ("test", lambda o: o)):
                _close([pick(o) for o in seen[call]], [pick(o) for o in want[call]],
                       f"rank {rec['rank']} {call} batch outputs")


def test_fit_again_continues_like_auto_and_best_and_last_checkpoints_load(runs):
    auto = runs.auto
    ranks = _ordinary(runs)
    for rec in ranks:
        _same_logs(rec["refit_logged"], auto["refit_logged"], ["train_loss", "train_acc",
                   "val_loss"], f"fit again, rank {rec['rank']}")
        for call in ("test_best", "validate_last"):
            for got, want in zip(rec[call], auto[call], strict=True):
                for key, value in want.items():
                    _close(got[key], value, f"rank {rec['rank']} {call} {key}")
    assert len(_series(ranks[0]["refit_logged"], "train_loss")) == M.TRAIN_STEPS
    state = _whole_state(ranks, "refit_state")
    for name, value in auto["refit_state"].items():
        _close(state[name], value, f"parameter {name} after fitting again")


def test_sharded_checkpoints_load_as_best_and_last_after_fit(runs2):
    """``ckpt_path="best"`` / ``"last"`` of DCP directories: each rank reads its stage only."""
    auto = runs2.auto
    for rec in runs2.ranks["sharded"]:
        assert "error" not in rec, rec.get("error")
        assert rec["best"][0] == auto["best"][0]
        for call in ("test_best", "validate_last"):
            for got, want in zip(rec[call], auto[call], strict=True):
                for key, value in want.items():
                    _close(got[key], value, f"sharded, rank {rec['rank']} {call} {key}")
    assert (runs2.out / "ckpt-sharded" / "last.ckpt" / ".metadata").is_file()


# --------------------------------------------------------------------------------- errors
def test_stages_of_a_replica_loading_different_samples_stop_every_rank_at_once(runs2):
    """A dataset built from the global rank (a stream sharded by rank) gave the first stage's
    inputs the last stage's labels of other samples: trained silently. Every rank now raises
    the same error at the end of the first step, naming the fix."""
    for rec in runs2.ranks["rankdata"]:
        assert "error" in rec, f"rank {rec['rank']} trained on mismatched batches"
        kind, message = rec["error"]
        assert kind == "InputError", rec["error"]
        assert "rank(s) [0] of replica 0 loaded another batch than its last stage (rank 1)" in (
            message)
        assert "distributed_sampler_kwargs" in message
        assert rec["elapsed"] < NO_HANG_S, (rec["rank"], rec["elapsed"])


MISTAKES = {"twice": "called self(...) twice", "never": "returned without calling self(...)",
            "metric": "logs a torchmetrics Metric", "twice-replica1": "called self(...) twice"}


def test_contract_mistakes_raise_their_message_on_every_rank_without_a_hang(runs):
    cases = [c for c in MISTAKES if c in runs.ranks]
    assert cases == [c for c in CASES[runs.world] if c in MISTAKES]
    for case in cases:
        phrase = MISTAKES[case]
        for rec in runs.ranks[case]:
            assert "error" in rec, f"{case}: rank {rec['rank']} raised nothing"
            kind, message = rec["error"]
            assert kind == "StepContractError", (case, rec["rank"], rec["error"])
            assert phrase in message, message
            assert "pipeline_loss" in message, message
            # a rank left waiting for its peer would only stop at the strategy's timeout (120 s)
            assert rec["elapsed"] < NO_HANG_S, (case, rec["rank"], rec["elapsed"])


def test_configure_optimizers_failing_on_one_rank_stops_every_rank_with_its_error(runs2):
    got = {rec["rank"]: rec for rec in runs2.ranks["optimizer"]}
    assert got[1]["error"] == ("ValueError", "rank one's optimizer breaks on purpose")
    kind, message = got[0]["error"]
    assert kind == "PipelineRuntimeError"
    assert ("rank 1 failed while making its optimizers (configure_optimizers): ValueError: "
            "rank one's optimizer breaks on purpose") in message
    for rec in got.values():  # not the strategy's timeout (120 s) in a collective
        assert rec["elapsed"] < NO_HANG_S, rec


def test_crafted_checkpoint_is_refused_by_fit_and_read_model_state_and_runs_no_code(runs2):
    runs = runs2
    path, marker = runs.out / "crafted.ckpt", runs.out / "code_ran"
    for rec in runs.ranks["crafted"]:
        kind, message = rec["error"]
        assert kind == "UnsafeCheckpointError"
        assert str(path) in message, message
        assert "Unsupported global" in message, message
        assert "open" in message, message
    with pytest.raises(UnsafeCheckpointError, match=r"crafted\.ckpt.*Unsupported global.*open"):
        read_model_state(path)
    assert not marker.exists(), "unpickling the crafted checkpoint ran its code"
    live = runs.out / "live_payload_ran"  # the same payload, unpickled unsafely, does run code
    crafted_checkpoint(runs.out / "live.ckpt", live)
    torch.load(runs.out / "live.ckpt", weights_only=False)
    assert live.exists()


# --------------------------------------------------------------------------------- README
def test_readme_contract_example_runs_on_two_ranks_and_learns(runs2):
    from torch.nn import functional as F

    ranks = runs2.ranks["readme"]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
        assert rec["steps"] == 50
        assert rec["metrics"] == ranks[0]["metrics"]  # logged on every rank, synced
    inputs = readme_inputs()  # the untrained net on the same batches
    with torch.no_grad():
        before = torch.stack([F.cross_entropy(inputs["net"](x).flatten(0, 1), y.flatten())
                              for x, y in inputs["loader"]]).mean()
    after = ranks[0]["metrics"]["val_loss"]
    assert after < 0.8 * float(before), (after, float(before))


# ------------------------------------------------------------------------------ telemetry
def test_step_telemetry_reaches_the_csv_logger_and_finds_the_slowed_rank(runs2):
    """Rank 1's forwards were made ``SLOW_FORWARD_S`` slower on purpose: its measured speed
    must be what that slowdown gives when rank 1 otherwise runs as fast (relative to its
    prediction) as rank 0 does, and rank 0's CSV must hold every rank's gathered figures."""
    import csv
    import io

    ranks = runs2.ranks["telemetry"]
    for rec in ranks:
        assert "error" not in rec, rec.get("error")
    rows = [r for r in csv.DictReader(io.StringIO(ranks[0]["csv"])) if r["autopipe/step_ms"]]
    assert [int(r["step"]) for r in rows] == [
        n - 1 for n in range(TELEMETRY_EVERY, TELEMETRY_STEPS + 1, TELEMETRY_EVERY)]
    keys = {"autopipe/step_ms", "autopipe/step_ms_predicted", "autopipe/bubble"} | {
        f"autopipe/{k}/rank{r}" for k in ("speed", "peak_mem_mb") for r in (0, 1)}
    assert keys <= set(rows[-1])
    last = {k: float(v) for k, v in rows[-1].items() if v}
    s0, s1 = (rec["summary"] for rec in sorted(ranks, key=lambda r: r["rank"]))
    for r, summ in enumerate((s0, s1)):  # what rank 0 logged is what each rank measured
        assert last[f"autopipe/speed/rank{r}"] == pytest.approx(summ["speed"], rel=1e-9)
        assert last[f"autopipe/peak_mem_mb/rank{r}"] == pytest.approx(
            summ["peak_memory_bytes"] / 2**20)
        assert summ["peak_memory_bytes"] > 0
    assert last["autopipe/step_ms"] == pytest.approx(max(s0["step_ms"], s1["step_ms"]))
    assert last["autopipe/step_ms_predicted"] == pytest.approx(s0["predicted_step_ms"])
    plan = Plan.from_json(ranks[0]["plan"])
    m, k, j = plan.num_microbatches, plan.startup_slices, plan.drain_slices
    forwards = m + (k - 1) + ((j - 1) if m > 1 else 0)
    slow_ms = forwards * SLOW_FORWARD_S * 1e3
    assert s1["forward_ms"] >= slow_ms
    fast_ratio = s0["speed"] / s0["speed_planned"]
    base = s1["predicted_compute_ms"] / fast_ratio  # rank 1 at rank 0's pace
    want = s1["predicted_compute_ms"] / (base + slow_ms)
    assert s1["speed"] / s1["speed_planned"] == pytest.approx(want, rel=0.25)
    assert s1["speed"] < 0.5 * s0["speed"]
