"""Shared recipe code: compose the config, build model + data + strategy, fit, report.

Usage of every recipe::

    python recipes/train_gpt.py [--plan-only] [--cfg] [group=option ...] [key=value ...]

Configs are composed with Hydra's compose API rather than ``@hydra.main``: Lightning's
subprocess launcher re-runs this exact command line in every child rank, and ``@hydra.main``
would change directory and create a fresh output folder per child. Here the run folder is
chosen once by the launching process and handed to the children through ``$AUTOPIPE_RUN_DIR``.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["build_task", "loss_summary", "model_mismatch", "parse_argv", "run_dir_for",
           "run_recipe"]

_RUN_DIR_ENV = "AUTOPIPE_RUN_DIR"
_USAGE = """usage: python {script} [--plan-only] [--cfg] [OVERRIDE ...]

  --plan-only   print the plan for the configured cluster and write the timeline picture,
                without launching any process (same as plan_only=true)
  --cfg         print the composed config and exit
  OVERRIDE      Hydra overrides: group=option (model=gpt2_xl cluster=mixed_rack strategy=auto
                trainer=gpu experiment=gpt_quick) or key=value (trainer.devices=4
                strategy.startup_slices=2 trainer.max_steps=50 data.batch_size=32)

Groups and options live in conf/ (model/, data/, task/, cluster/, strategy/, trainer/,
experiment/); a misspelt key or a wrongly typed value is an error.
"""


def parse_argv(argv: list[str]) -> tuple[dict[str, bool], list[str]]:
    """Split ``argv`` into our flags and Hydra overrides; unknown ``--flags`` are errors."""
    flags = {"plan_only": False, "cfg": False, "help": False}
    overrides = []
    for arg in argv:
        if arg in ("-h", "--help"):
            flags["help"] = True
        elif arg in ("--plan-only", "--plan_only"):
            flags["plan_only"] = True
        elif arg == "--cfg":
            flags["cfg"] = True
        elif arg.startswith("-"):
            raise SystemExit(f"unknown flag {arg!r}; flags are --plan-only, --cfg, --help")
        else:
            overrides.append(arg)
    return flags, overrides


def run_dir_for(recipe: str, configured: str | None) -> Path:
    """The run's output folder: ``run_dir`` if set, else the one the launching process chose
    (``$AUTOPIPE_RUN_DIR``), else under torchrun ``outputs/<recipe>/torchrun-<rdzv id>`` (every
    worker of every elastic attempt computes the same one, so a restart finds the checkpoints),
    else ``outputs/<recipe>/<date_time>`` (then exported so the ranks Lightning starts from this
    process agree on it)."""
    if configured:
        path = Path(configured)
    elif os.environ.get(_RUN_DIR_ENV):
        path = Path(os.environ[_RUN_DIR_ENV])
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        path = Path("outputs") / recipe / f"torchrun-{_torchrun_job()}"
    else:
        path = Path("outputs") / recipe / time.strftime("%Y-%m-%d_%H-%M-%S")
    os.environ[_RUN_DIR_ENV] = str(path)
    return path


def _torchrun_job() -> str:
    """What tells this torchrun job from another: its rendezvous id, which every worker of
    every node and elastic attempt shares. Without ``--rdzv-id`` torchrun names every job
    ``none``: one job on one node is then told apart by its agent (the workers' parent, the
    same over the job's restarts), or two jobs one after the other shared one folder, the
    second deleting the first's logs and resuming its checkpoint as its own. Jobs of several
    nodes without ``--rdzv-id`` still share ``torchrun-none`` (their agents differ): say so."""
    job = os.environ["TORCHELASTIC_RUN_ID"]
    if job != "none":
        return job
    if os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        return f"none-{os.getppid()}"
    if os.environ.get("RANK", "0") == "0":
        print("note: torchrun without --rdzv-id names every job 'none', so jobs of several "
              "nodes share outputs/<recipe>/torchrun-none (a later job resumes an earlier "
              "one's checkpoint); pass --rdzv-id=<job name> or run_dir=<folder>", flush=True)
    return job


def _local_ranks(trainer_cfg: Any) -> int:
    devices = trainer_cfg.devices
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    if isinstance(devices, list | tuple) or hasattr(devices, "__len__"):
        return max(1, len(devices))
    return 1


def _set_threads(cfg: Any) -> None:
    """One rank's share of the CPU cores (all ranks of a node share them); an explicit
    ``threads_per_rank`` wins, then a user's ``OMP_NUM_THREADS`` (torch already honours it)."""
    import torch

    if cfg.threads_per_rank:
        threads = int(cfg.threads_per_rank)
    elif os.environ.get("OMP_NUM_THREADS"):
        return
    elif cfg.trainer.accelerator == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // _local_ranks(cfg.trainer))
    else:
        return
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # keeps Lightning from choosing another count


# Which model family each recipe trains: the schema its model files name, the builder they call.
_FAMILIES = {
    "train_gpt": ("gpt_schema", "build_gpt", "GPT"),
    "train_bert": ("bert_schema", "build_bert", "BERT"),
    "train_resnet": ("resnet_schema", "build_resnet", "image"),
}


def build_task(cfg: Any) -> Any:
    """The recipe's LightningModule around its model.

    Instantiated with plain lists and dicts (``_convert_="all"``) so the task's saved
    hyper-parameters hold no OmegaConf objects and its checkpoints load with
    ``weights_only=True``; the model goes in after instantiation (Hydra would copy it).
    """
    from hydra.utils import instantiate

    return instantiate(cfg.task, _partial_=True, _convert_="all")(model=instantiate(cfg.model))


def model_mismatch(recipe: str, cfg: Any) -> str | None:
    """Why ``cfg.model`` is not a model ``recipe`` trains (with the recipe that does), or None.

    The recipe's task and data are built for one family (``train_gpt``'s task reads
    ``model.max_seq_len``), so ``train_gpt.py model=resnet18`` would fail deep in the config.
    """
    from lightning_autopipe.zoo.config import CONF_DIR

    if recipe not in _FAMILIES:
        return None
    target = str(cfg.model.get("_target_", "")).rsplit(".", 1)[-1]
    schema, builder, kind = _FAMILIES[recipe]
    if target == builder:
        return None
    fitting = sorted(
        path.stem for path in (CONF_DIR / "model").glob("*.yaml")
        if f"- {schema}" in path.read_text()
    )
    owner = next((r for r, (_, b, _) in _FAMILIES.items() if b == target), None)
    name = cfg.model.get("name", "?")
    elsewhere = f"; to train {name}, run recipes/{owner}.py model={name}" if owner else ""
    return (
        f"model={name} is not a {kind} model (its builder is {target or 'unknown'}); "
        f"recipes/{recipe}.py trains {kind} models: model={' | '.join(fitting)}{elsewhere}"
    )


def _check_vocab(cfg: Any, datamodule: Any) -> None:
    data_vocab = getattr(datamodule, "vocab_size", None)
    model_vocab = cfg.model.get("vocab_size")
    if data_vocab is not None and model_vocab is not None and model_vocab < data_vocab:
        raise SystemExit(
            f"model.vocab_size={model_vocab} is smaller than the data's vocabulary "
            f"({data_vocab} tokens); set model.vocab_size>={data_vocab}"
        )


def _loggers(run_dir: Path) -> list[Any]:
    import importlib.util

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers: list[Any] = [CSVLogger(str(run_dir), name="", version="csv")]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(str(run_dir), name="", version="tensorboard"))
    return loggers


def _progress_bars(trainer_cfg: Any) -> list[Any]:
    """Lightning's bar without ``v_num``: the loggers' version is the folder name ``csv``,
    which reads as a metric in the bar."""
    if not trainer_cfg.get("enable_progress_bar", True):
        return []
    from lightning.pytorch.callbacks import TQDMProgressBar

    class _Bar(TQDMProgressBar):
        def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            return items

    return [_Bar()]


def loss_summary(metrics_csv: Path, key: str = "train_loss") -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` logged in a CSVLogger ``metrics.csv``."""
    steps, values = [], []
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key):
                steps.append(int(row["step"]))
                values.append(float(row[key]))
    return steps, values


def _report(run_dir: Path, plan_files: list[Path]) -> None:
    metrics = run_dir / "csv" / "metrics.csv"
    steps, losses = loss_summary(metrics) if metrics.exists() else ([], [])
    print("\n== done ==")
    if not losses:
        print("no train loss logged (fewer steps than trainer.log_every_n_steps)")
    elif len(losses) == 1:
        print(f"train loss {losses[0]:.4f} at step {steps[0]} (the only logged step)")
    else:
        trend = "down" if losses[-1] < losses[0] else "NOT down"
        print(
            f"train loss {losses[0]:.4f} (step {steps[0]}) -> {losses[-1]:.4f} "
            f"(step {steps[-1]}): {trend} over {len(losses)} logged steps"
        )
    if not all(math.isfinite(v) for v in losses):
        print("warning: a logged loss is not finite")
    if metrics.exists():
        print(f"logs:     {metrics}")
    for path in plan_files:
        if path.exists():
            print(f"{path.stem + ':':9} {path}")
    print(f"run dir:  {run_dir}")


def _checkpointing(cfg: Any, run_dir: Path) -> Any:
    """``last.ckpt`` every ``checkpoint_every_n_steps`` steps (None: no interval checkpoints).

    Only the newest is kept (``save_top_k=0``): the strategy writes it atomically, so a kill
    during a save leaves the previous one, and ``ckpt_path=last`` resumes whichever is whole.
    """
    every = cfg.checkpoint_every_n_steps
    if every is None:
        return None
    if every < 1:
        raise SystemExit(f"checkpoint_every_n_steps={every} must be a positive step count")
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / "checkpoints"
    return ModelCheckpoint(
        dirpath=str(folder), every_n_train_steps=int(every), save_top_k=0, save_last=True
    )


def train(cfg: Any) -> int:
    """Fit the configured task; rank 0 ends by printing the loss trend and where files are."""
    import lightning.pytorch as pl
    from _plan import PlanReport
    from hydra.utils import instantiate

    import lightning_autopipe  # noqa: F401  (registers the "autopipe" strategy)
    from lightning_autopipe.zoo.config import build_cluster

    run_dir = run_dir_for(cfg.recipe, cfg.run_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    _check_vocab(cfg, datamodule)
    task = build_task(cfg)
    if "_target_" in cfg.strategy:
        # the Cluster goes in after instantiation: Hydra would copy a keyword argument into
        # the config, and OmegaConf cannot hold a Cluster object
        strategy = instantiate(cfg.strategy, _partial_=True)(cluster=build_cluster(cfg.cluster))
    else:
        strategy = cfg.strategy.name
    report = PlanReport(run_dir, model_name=cfg.model.name)
    trainer_kw = dict(cfg.trainer)
    callbacks: list[Any] = [report]
    checkpoints = _checkpointing(cfg, run_dir)
    if checkpoints is not None:
        callbacks.append(checkpoints)
        trainer_kw["enable_checkpointing"] = True
    if cfg.data.get("global_batch_size"):  # an ElasticDataLoader stripes itself
        trainer_kw["use_distributed_sampler"] = False
    trainer = pl.Trainer(
        **trainer_kw,
        strategy=strategy,
        logger=_loggers(run_dir),
        callbacks=[*callbacks, *_progress_bars(cfg.trainer)],
        default_root_dir=str(run_dir),
    )
    trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if trainer.global_rank == 0:
        _report(run_dir, report.files)
    return 0


def run_recipe(config_name: str, argv: list[str] | None = None) -> int:
    """Entry point of ``recipes/<config_name>.py``: ``--plan-only``, ``--cfg`` or train."""
    from omegaconf import OmegaConf

    from lightning_autopipe.zoo.config import compose

    argv = list(sys.argv[1:] if argv is None else argv)
    flags, overrides = parse_argv(argv)
    if flags["help"]:
        print(_USAGE.format(script=f"recipes/{config_name}.py"))
        return 0
    try:
        cfg = compose(config_name, overrides)
        mismatch = model_mismatch(config_name, cfg)
        if mismatch is None:
            OmegaConf.to_container(cfg, resolve=True)  # an interpolation error surfaces here
    except Exception as exc:  # Hydra's override / composition errors: the message is the fix
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(exc, HydraException | OmegaConfBaseException):
            raise
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        print(f"error: {exc}{cause}\n(see recipes/{config_name}.py --help and --cfg)",
              file=sys.stderr)
        return 2
    if flags["cfg"]:
        print(OmegaConf.to_yaml(cfg))
        return 0
    if mismatch is not None:
        print(f"error: {mismatch}", file=sys.stderr)
        return 2
    if cfg.strategy.get("cluster") is not None:
        print(
            "error: the recipes take the cluster from the cluster group: use "
            f"cluster=<name or file> instead of strategy.cluster={cfg.strategy.cluster}",
            file=sys.stderr,
        )
        return 2
    _set_threads(cfg)  # plan-only too: a measured profile should see a rank's share of cores
    try:
        if flags["plan_only"] or cfg.plan_only:
            from _plan import plan_only

            return plan_only(cfg, run_dir_for(cfg.recipe, cfg.run_dir))
        return train(cfg)
    except Exception as exc:  # a value the run refused: its message names it and the fix
        message = _refusal(exc)
        if message is None:
            raise
        print(f"error: {message}\n(see recipes/{config_name}.py --help and --cfg)",
              file=sys.stderr)
        return 2


def _refusal(exc: BaseException) -> str | None:
    """The message of an error that refuses the run's configuration (an option, a cluster, a
    plan, a file that is not there), also when Hydra's ``instantiate`` wrapped it; None for
    anything else (a failure while training keeps its traceback)."""
    from hydra.errors import InstantiationException

    from lightning_autopipe.errors import AutoPipeError, PipelineRuntimeError

    if isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        inner = _refusal(exc.__cause__)
        return inner if inner is not None else str(exc)
    if isinstance(exc, AutoPipeError) and not isinstance(exc, PipelineRuntimeError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return str(exc)
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(exc, MisconfigurationException):  # Lightning refusing the trainer's settings
        return str(exc)
    return None
