"""Plans in the recipes: the report printed at the start of a run, and ``--plan-only``.

``--plan-only`` answers "what would this recipe get on that cluster?" without launching: it
plans exactly as the strategy would at the start of training (``search_plan``: every pipeline
depth that uses all devices with the same replica count per stage, ``data.batch_size`` samples
per replica), from one of two profiles:

* **measured** (trace + profile this model's blocks on this machine's CPU), for the ``local``
  cluster, whose devices *are* this machine's processes;
* **analytic** (FLOP and byte counts, ``planner.analytic``), for clusters of GPUs (their
  ``speed`` is relative to the analytic reference device, not to this CPU) and for models too
  large to profile here. Its blocks are layer halves, so such a plan is for reading, not for
  ``strategy.plan=`` (a real run re-profiles and re-plans on the cluster itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

__all__ = ["PLAN_BANNER", "PlanReport", "plan_only", "choose_profile"]

PLAN_BANNER = "== AutoPipe plan:"
_MEASURE_LIMIT = 300_000_000  # parameters; beyond this a CPU profile takes too long / too much
_MEASURE_BUDGET_S = 60.0  # a --plan-only profile estimated to take longer uses the FLOP model


class PlanReport(pl.Callback):
    """On rank 0 at fit start: print the strategy's plan, save it, draw its timeline."""

    def __init__(self, run_dir: Path, model_name: str) -> None:
        self.run_dir = Path(run_dir)
        self.model_name = model_name
        self.files: list[Path] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None or trainer.global_rank != 0:
            return
        strategy = trainer.strategy
        self.files = show_plan(
            plan,
            strategy.profile,
            strategy.cluster,
            self.run_dir,
            table=not _strategy_printed(),
            model_name=self.model_name,
        )


def _shape(plan: Any) -> str:
    """``"<p> stages x <r> replicas"``: the pipeline depth in ranks, and with several stage
    chunks per rank their count and schedule (``plan.num_stages`` counts the chunks)."""
    if plan.chunks_per_rank == 1:
        return f"{plan.num_ranks} stages x {plan.replicas} replicas"
    return (f"{plan.num_ranks} stages x {plan.replicas} replicas ({plan.chunks_per_rank} "
            f"chunks per rank, {plan.schedule})")


def _strategy_printed() -> bool:
    """The strategy logs its plan table through Lightning's rank-zero INFO logger; when that
    logger is on, the table is already on screen and is not printed twice."""
    import logging

    return logging.getLogger("lightning.pytorch.utilities.rank_zero").isEnabledFor(logging.INFO)


def show_plan(
    plan: Any,
    profile: Any,
    cluster: Any,
    run_dir: Path,
    source: str | None = None,
    table: bool = True,
    model_name: str | None = None,
) -> list[Path]:
    """Print the plan table; write ``plan.json`` and (with a profile) ``timeline.png``."""
    from lightning_autopipe.planner.report import plan_table

    print(
        f"{PLAN_BANNER} {_shape(plan)}, "
        f"{plan.num_microbatches} micro-batches, {plan.startup_slices} startup / "
        f"{plan.drain_slices} drain slices, predicted {plan.iteration_ms:.1f} ms/step =="
    )
    if source:
        print(f"profile: {source}")
    text = plan_table(plan, profile, cluster)
    if table:
        print(text)
    if "balance" not in text:  # the planner's table already has the summary
        print(
            f"{_shape(plan)}, {plan.num_microbatches} "
            f"micro-batches, {plan.startup_slices} startup / {plan.drain_slices} drain slices: "
            "predicted "
            f"{plan.iteration_ms:.1f} ms/step, balance {plan.balance:.2f} (slowest stage / "
            f"mean), bubble {plan.bubble_fraction:.0%}"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    files = [run_dir / "plan.json"]
    plan.save(files[0])
    if profile is not None and cluster is not None:
        from lightning_autopipe.planner.simulate import simulate
        from lightning_autopipe.planner.timeline import write_png

        files.append(run_dir / "timeline.png")
        title = (
            f"{model_name or plan.model or 'model'} on {cluster.name}: {_shape(plan)}, "
            f"m={plan.num_microbatches}, k={plan.startup_slices}, "
            f"j={plan.drain_slices}, "
            f"{plan.iteration_ms:.1f} ms/step predicted"
        )
        write_png(simulate(plan, profile, cluster), files[-1], title=title)
    for path in files:
        print(f"wrote {path}")
    return files


def _options(strategy: Any) -> Any:
    """The strategy node's options, checked as ``AutoPipeStrategy`` checks them (the cluster
    comes from the cluster group; ``strategy=auto`` has none of them: the defaults)."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from lightning_autopipe.options import AutoPipeOptions

    names = {f.name for f in fields(AutoPipeOptions)} - {"cluster"}
    given = OmegaConf.to_container(strategy, resolve=True)
    return AutoPipeOptions(**{k: v for k, v in given.items() if k in names})


def _world(cfg: Any) -> int:
    devices = cfg.trainer.devices
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < 1:
        from lightning_autopipe.errors import InputError

        raise InputError(f"trainer.devices={devices}: give the processes per node, 1 or more")
    per_node = devices if isinstance(devices, int) and devices > 0 else 1
    if isinstance(devices, str) and devices.isdigit():
        per_node = int(devices)
    return per_node * int(cfg.trainer.num_nodes)


def _analytic_args(cfg: Any) -> dict[str, Any] | None:
    """``analytic_profile`` arguments for this model, or None when it has no FLOP model."""
    model = cfg.model
    target = str(model._target_)
    if target.endswith(("build_gpt", "build_bert")):
        return {
            "kind": "gpt" if target.endswith("build_gpt") else "bert",
            "layers": model.n_layer,
            "hidden": model.n_embd,
            "heads": model.n_head,
            "seq_len": cfg.data.block_size,
            "vocab": model.vocab_size,
        }
    if target.endswith("build_resnet") and model.arch in ("resnet50", "resnet101", "resnet152"):
        depth = int(str(model.arch).removeprefix("resnet"))
        return {
            "kind": "resnet",
            "layers": depth,
            "image_size": model.image_size,
            "num_classes": model.num_classes,
        }
    return None


def _param_count(cfg: Any) -> int:
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        net = instantiate(cfg.model)
    return sum(p.numel() for p in net.parameters())


def choose_profile(cfg: Any, cluster: Any, local: bool) -> tuple[Any, str]:
    """The profile to plan from and a sentence saying which kind and why."""
    analytic = _analytic_args(cfg)
    params = _param_count(cfg)
    why = None
    if analytic is not None and not local:
        why = f"cluster {cluster.name!r} describes devices other than this machine"
    elif analytic is not None and params > _MEASURE_LIMIT:
        why = f"{params / 1e6:.0f}M parameters are too many to profile here"
    task = example = None
    if why is None and analytic is not None:
        task, example = _task_and_example(cfg)
        estimate = _profile_seconds(task, example)
        if estimate > _MEASURE_BUDGET_S:
            why = f"measuring its blocks here would take about {estimate / 60:.0f} min"
    if why is not None:
        from lightning_autopipe.planner.analytic import analytic_profile

        profile = analytic_profile(**analytic, micro_batch_size=1, model=cfg.model.name)
        return profile, f"analytic (FLOP/byte counts, {profile.device}) because {why}"
    if not local:
        print(
            f"note: no FLOP model for {cfg.model.name!r}; measuring on this CPU, so cluster "
            f"speeds are taken relative to this machine"
        )
    if task is None:
        task, example = _task_and_example(cfg)
    return _measured_profile(cfg, task, example), (
        f"measured on this machine's CPU ({params / 1e6:.2f}M params)"
    )


def _task_and_example(cfg: Any) -> tuple[Any, Any]:
    from _common import build_task

    from lightning_autopipe.runtime.local_stage import as_call_args

    task = build_task(cfg)
    return task, as_call_args(task.example_input_array)


def _profile_seconds(task: Any, example: Any) -> float:
    """Rough wall time of :func:`_measured_profile`: it runs about 50 forward passes' worth
    (11 forward-then-backward passes, backward ~2 forwards, again at half the batch for the
    fixed-cost fit), so one timed forward of the example predicts it."""
    import time

    import torch

    start = time.perf_counter()
    with torch.no_grad():
        if isinstance(example, dict):
            task(**example)
        else:
            task(*example)
    return 50 * (time.perf_counter() - start)


def _measured_profile(cfg: Any, task: Any, example: Any) -> Any:
    """Trace and profile the recipe's own LightningModule (``task``), as the strategy does."""
    from lightning_autopipe.graph import split_model
    from lightning_autopipe.runtime.profiler import profile_blocks

    print(f"measuring the blocks of {cfg.model.name} on this CPU ...", flush=True)
    granularity = cfg.strategy.get("granularity", "sub-block")
    blocks = split_model(task, example, granularity=granularity)
    # More repeats than a training run's profile: one process, and the median must survive
    # a machine that is busy with other work.
    return profile_blocks(
        blocks, example, device="cpu", warmup=2, repeats=9, model_name=cfg.model.name
    )


def plan_only(cfg: Any, run_dir: Path) -> int:
    """Print the plan ``cfg`` would get on ``cfg.cluster`` and draw it; launch nothing."""
    from lightning_autopipe.planner.search import search_plan
    from lightning_autopipe.zoo.config import build_cluster

    strategy = cfg.strategy
    options = _options(strategy)  # the checks a training run makes, before any profiling
    world = _world(cfg)
    cluster = build_cluster(cfg.cluster, world_size=world)
    local = not cfg.cluster.get("servers")
    profile, source = choose_profile(cfg, cluster, local)
    if not local and strategy.get("num_stages", "auto") != "auto":
        print(
            f"note: the strategy pins num_stages={strategy.num_stages} (the recipes' default "
            "'pipeline' does, for the local CPU demo); add strategy=autopipe to let the planner "
            f"choose the depth for {cluster.name!r}"
        )
    pins = options.pins
    names = [d.name for d in cluster.devices]
    # the schedules the strategy would consider, and (these processes being the local
    # cluster) the runtime's cost per action measured here, as a training run measures it
    schedules = options.schedules
    if local:
        from lightning_autopipe.runtime.action_overhead import measure_action_overhead
        from lightning_autopipe.runtime.measure import with_overheads

        cluster = with_overheads(cluster, [measure_action_overhead()])
    plan = search_plan(
        profile,
        cluster,
        names,
        int(cfg.data.batch_size),
        planner=str(strategy.get("planner", "autopipe")),
        schedules=schedules,
        **pins,
    )
    print(
        f"plan-only: {cfg.model.name} on cluster {cluster.name!r} ({len(names)} devices), "
        f"{cfg.data.batch_size} samples per replica; nothing is launched"
    )
    show_plan(plan, profile, cluster, run_dir, source=source, model_name=cfg.model.name)
    if local:
        print(
            "note: this plan prices the local cluster's links with default CPU figures and "
            "blocks profiled by this one process; a training run measures the links between "
            "its ranks and profiles on every rank at once (they share the cores), so it may "
            "choose another plan: the run prints its own at start. To run this one, pass "
            f"strategy.plan={run_dir / 'plan.json'}"
        )
    profile.save(run_dir / "profile.json")
    print(f"wrote {run_dir / 'profile.json'}")
    return 0
