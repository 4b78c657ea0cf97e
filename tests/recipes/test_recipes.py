"""Recipes end to end: the main job (GPT, 30 steps) learns; BERT and ResNet run; plan-only."""

from __future__ import annotations

import json
import logging
import math

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.profile import Profile
from lightning_autopipe.zoo.config import CONF_DIR
from tests.recipes._run import ROOT, losses, run, run_in_process

BANNER = "== AutoPipe plan: 2 stages x "
QUIET = ["trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]


def _without_overhead(server: dict) -> dict:
    """A cluster file's server whose every device costs nothing per action: the default
    ``device`` and each device that differs from it (discovery writes one per rank whose
    speed differs, as on a host whose two cores run unlike)."""
    def free(spec: dict) -> dict:
        return spec | {"overhead_ms": 0.0}

    out = server | {"device": free(server["device"])}
    if server.get("devices"):
        out["devices"] = {i: free(spec) for i, spec in server["devices"].items()}
    return out


@pytest.mark.launch  # two ranks
def test_main_job_pipelines_gpt_on_two_ranks_and_the_loss_goes_down(
    tmp_path, monkeypatch, capsys
):
    """``make demo`` with a short max_steps: defaults = TinyGPT, autopipe, 2 local CPU ranks.

    Reference: the same recipe with plain Lightning on one process (``strategy=auto``) logs the
    same losses, step for step: the pipeline is the same training, not an approximation.
    """
    pipe_dir, ref_dir = tmp_path / "pipeline", tmp_path / "single"
    proc = run(["recipes/train_gpt.py", "trainer.max_steps=30", f"run_dir={pipe_dir}", *QUIET])
    assert BANNER in proc.stdout
    plan = Plan.load(pipe_dir / "plan.json")
    assert len(plan.devices) == 2  # the local cluster = the 2 launched ranks
    assert plan.replicas == 1  # so its global batch is the single process's batch
    assert (pipe_dir / "timeline.png").stat().st_size > 10_000
    logged = losses(pipe_dir)
    assert sorted(logged) == list(range(30))
    values = [logged[s] for s in range(30)]
    assert all(math.isfinite(v) for v in values)
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    assert last < 0.85 * first, values
    assert "train loss" in proc.stdout
    assert str(pipe_dir / "csv" / "metrics.csv") in proc.stdout
    # the plan priced the runtime's measured cost per action, which the discovered cluster's
    # file carries: the simulator on that file gives the plan's step, and more than without it
    found = pipe_dir / "csv" / "autopipe"
    cluster, profile = Cluster.load(found / "cluster.yaml"), Profile.load(found / "profile.json")
    assert cluster.devices[0].spec.overhead_ms > 0
    assert simulate(plan, profile, cluster).iteration_ms == pytest.approx(plan.iteration_ms)
    free = Cluster.from_dict(cluster.to_dict() | {"servers": [
        _without_overhead(s) for s in cluster.to_dict()["servers"]]})
    assert simulate(plan, profile, free).iteration_ms < plan.iteration_ms

    run_in_process(monkeypatch, capsys, "train_gpt",
                   ["strategy=auto", "trainer.devices=1", "trainer.max_steps=30",
                    f"run_dir={ref_dir}", *QUIET])
    reference = losses(ref_dir)
    assert [reference[s] for s in range(30)] == pytest.approx(values, rel=1e-4)


@pytest.mark.launch  # two ranks
@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("train_bert", ["model.max_seq_len=32", "data.batch_size=8", "data.max_bytes=40000"]),
        ("train_resnet", ["data.batch_size=8", "data.num_samples=64", "cluster=mixed_rack"]),
    ],
)
def test_recipe_runs_two_pipelined_steps(tmp_path, recipe, extra):
    """Each recipe trains; the ResNet run also names a cluster file on the command line
    (``cluster=mixed_rack``, the README's override): its plan uses that file's devices.
    Hydra copies instantiate()'s keyword arguments into the config, which cannot hold a
    ``Cluster``; the recipe must hand it to the strategy after instantiation."""
    proc = run([f"recipes/{recipe}.py", "trainer.max_steps=2", f"run_dir={tmp_path}", *QUIET,
                *extra])
    assert BANNER in proc.stdout
    devices = Plan.load(tmp_path / "plan.json").devices
    assert len(devices) == 2
    if "cluster=mixed_rack" in extra:
        rack = {d.name for d in Cluster.load(CONF_DIR / "cluster" / "mixed_rack.yaml").devices}
        assert set(devices) <= rack
    logged = losses(tmp_path)
    assert sorted(logged) == [0, 1]
    assert all(math.isfinite(v) and v > 0 for v in logged.values())


def test_plan_only_for_gpt2_xl_on_the_mixed_rack(tmp_path, monkeypatch, capsys):
    out = run_in_process(monkeypatch, capsys, "train_gpt",
                         ["--plan-only", "cluster=mixed_rack", "model=gpt2_xl",
                          "strategy=autopipe", f"run_dir={tmp_path}"]).out
    assert "== AutoPipe plan:" in out
    assert "analytic" in out
    cluster = Cluster.load(CONF_DIR / "cluster" / "mixed_rack.yaml")
    plan = Plan.load(tmp_path / "plan.json")
    assert sorted(plan.devices) == sorted(d.name for d in cluster.devices)  # all 24 used
    assert plan.model == "gpt2_xl"
    assert plan.iteration_ms > 0
    assert len({s.replicas for s in plan.stages}) == 1  # what the runtime can execute
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["device"].startswith("analytic")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_plan_only_measures_a_small_model_for_the_local_cluster(tmp_path, monkeypatch, capsys):
    out = run_in_process(monkeypatch, capsys, "train_gpt",
                         ["--plan-only", "trainer.devices=4", "strategy.num_stages=2",
                          f"run_dir={tmp_path}"]).out
    assert "measured" in out
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.num_ranks == 2  # pipeline depth (each rank may hold several chunks)
    assert sorted(plan.devices) == [f"local:{i}" for i in range(4)]
    assert plan.global_batch_size == 2 * 16  # data.batch_size per replica x 2 replicas


def test_plan_only_does_not_measure_what_would_take_minutes(tmp_path, monkeypatch, capsys):
    """A model that would take too long to profile here (GPT-2 124M: ~8 min on 2 cores) is
    planned from the FLOP model instead, and says so; the budget is shrunk to make a tiny model
    stand in for it."""
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import _plan

    monkeypatch.setattr(_plan, "_MEASURE_BUDGET_S", 0.0)
    out = run_in_process(monkeypatch, capsys, "train_gpt",
                         ["--plan-only", f"run_dir={tmp_path}"]).out
    assert "analytic" in out
    assert "measuring its blocks here would take about" in out
    assert json.loads((tmp_path / "profile.json").read_text())["device"].startswith("analytic")


def test_help_and_unknown_flags(monkeypatch, capsys):
    out = run_in_process(monkeypatch, capsys, "train_resnet", ["--help"]).out
    assert "--plan-only" in out
    with pytest.raises(SystemExit, match="--plan-onyl"):
        run_in_process(monkeypatch, capsys, "train_resnet", ["--plan-onyl"])


@pytest.mark.parametrize("extra", [[], ["+model.max_seq_len=64"]])
def test_a_model_of_another_recipe_names_the_recipe_that_trains_it(monkeypatch, capsys, extra):
    err = run_in_process(monkeypatch, capsys, "train_gpt",
                         ["model=resnet18", *extra, "--plan-only"], status=2).err
    assert "model=resnet18 is not a GPT model" in err
    assert "model=gpt2 | gpt2_medium | gpt2_xl | gpt_small | gpt_tiny" in err
    assert "run recipes/train_resnet.py model=resnet18" in err
    assert "Traceback" not in err


def test_the_recipe_tasks_hyperparameters_load_weights_only(monkeypatch, tmp_path):
    """What a recipe's checkpoint holds besides tensors is plain data (no OmegaConf objects)."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from _common import build_task

    from lightning_autopipe.zoo.config import compose

    task = build_task(compose("train_gpt", []))
    torch.save({"hyper_parameters": dict(task.hparams)}, tmp_path / "h.ckpt")
    loaded = torch.load(tmp_path / "h.ckpt", weights_only=True)["hyper_parameters"]
    assert loaded["betas"] == [0.9, 0.95]


def test_plan_only_on_the_local_cluster_says_why_a_run_may_plan_otherwise(
    tmp_path, monkeypatch, capsys
):
    out = run_in_process(monkeypatch, capsys, "train_gpt",
                         ["--plan-only", f"run_dir={tmp_path}"]).out
    assert "a training run measures the links between its ranks" in out
    assert f"strategy.plan={tmp_path / 'plan.json'}" in out


def test_a_misspelt_override_is_one_line_with_the_fix(monkeypatch, capsys):
    err = run_in_process(monkeypatch, capsys, "train_gpt", ["trainer.max_stepz=3"], status=2).err
    assert "Could not override 'trainer.max_stepz'" in err
    assert "Traceback" not in err
    err = run_in_process(monkeypatch, capsys, "train_gpt", ["trainer.max_steps=abc"],
                         status=2).err  # the reason a value is refused is kept
    assert "'abc' of type 'str' could not be converted to Integer" in err


@pytest.mark.parametrize(("overrides", "says"), [
    (["strategy.schedule=1fb1"], "schedule must be 'auto' or one of"),
    (["strategy.plan=nope.json"], "plan='nope.json': no such file"),
    # plan-only makes the run's checks before it profiles anything
    (["--plan-only", "strategy.num_stages=0"], "num_stages must be 'auto' or a positive int"),
    (["--plan-only", "trainer.devices=0"], "trainer.devices=0: give the processes per node"),
    (["trainer.devices=0"], "`Trainer(devices=0)` value is not a valid input"),  # Lightning's
])
def test_a_refused_value_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path, overrides,
                                                       says):
    # Lightning's own log handler holds an earlier test's captured stream: not this output
    monkeypatch.setattr(logging, "raiseExceptions", False)
    err = run_in_process(monkeypatch, capsys, "train_gpt",
                         [*overrides, "trainer.max_steps=1", f"run_dir={tmp_path}"], status=2).err
    assert says in err
    assert "Traceback" not in err
