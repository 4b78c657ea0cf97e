"""Checks that need no process group, run in the launching process before any rank starts.

A mistake found after the launch costs a process start and distributed initialisation per
rank (tens of seconds) and prints one traceback per rank; everything that can be judged from
the strategy's options, the Trainer and the module is judged here once, in the parent, by the
launcher before it starts a process. The same checks then run again in every rank's ``setup``
(cheap), which covers launchers this module does not wrap.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)

from lightning_autopipe.errors import PlanError
from lightning_autopipe.lightning.precision import check_precision
from lightning_autopipe.lightning.reproducible import check_reproducible
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.checks import check_stages_divide
from lightning_autopipe.runtime.failure import LAUNCHER_PID_ENV

__all__ = ["CheckedMultiProcessingLauncher", "CheckedScriptLauncher", "check_before_launch",
           "check_module", "check_trainer"]


def check_trainer(trainer: Any, precision_plugin: Any) -> None:
    """What the Trainer asks for must be something the pipeline runs."""
    check_precision(precision_plugin)
    from lightning.pytorch import callbacks as known

    for name, what, fix in _WHOLE_MODEL_CALLBACKS:
        kind = getattr(known, name, None)  # WeightAveraging: Lightning 2.5 and later
        if kind is not None and any(isinstance(c, kind) for c in getattr(trainer, "callbacks", [])):
            raise PlanError(
                f"{name} does not run under AutoPipeStrategy: {what}, and each rank holds one "
                f"stage of them; remove the callback{fix}"
            )


#: Lightning callbacks that work on the whole model's parameters: (class name, what it does,
#: the fix). Each would fail at its first update with a bare shape or type error (a copy or a
#: list of the whole model's weights made at setup, before the split, met with one stage's)
_WHOLE_MODEL_CALLBACKS = (
    ("StochasticWeightAveraging",
     "it averages a copy of the whole model with the module's parameters (Lightning refuses "
     "it for sharded strategies alike)",
     ", or average the weights of a checkpoint (it holds the whole model) after training"),
    ("WeightAveraging",  # EMAWeightAveraging is one
     "it keeps an averaged copy of the whole model and swaps it with the module's parameters",
     ", or average the weights of checkpoints (each holds the whole model) after training"),
    ("ModelPruning",
     "it prunes the whole model's weights at the end of an epoch (global pruning ranks all "
     "of them together)",
     " and prune the model with torch.nn.utils.prune before trainer.fit (its masks then train "
     "as in one process), or prune the checkpoint's model (it holds the whole model) after "
     "training"),
)


def check_module(module: Any) -> None:
    """What the LightningModule does must be something the pipeline runs."""
    if not getattr(module, "automatic_optimization", True):
        raise PlanError(
            "AutoPipeStrategy needs automatic optimization (the schedule runs forward and "
            "backward itself); remove `self.automatic_optimization = False`"
        )
    from torch.optim.swa_utils import AveragedModel

    averaged = [n for n, m in module.named_modules() if isinstance(m, AveragedModel)]
    if averaged:
        # a copy of the whole model made before the split: its update zips the copy's
        # parameters with one stage's (a shape error), and the last stage alone holds it
        raise PlanError(
            f"the module holds an AveragedModel ({', '.join(averaged)}): it averages a copy of "
            "the whole model's parameters, and each rank holds one stage of them, so its "
            "updates do not run under AutoPipeStrategy; remove it, or average the weights of "
            "checkpoints (each holds the whole model) after training"
        )


def check_before_launch(
    options: AutoPipeOptions,
    world_size: int,
    num_nodes: int,
    trainer: Any = None,
    precision_plugin: Any = None,
    module: Any = None,
) -> None:
    """Every check of the run's configuration that needs no rank: raises the first failure.

    Args:
        options: the strategy's options.
        world_size: processes the launcher is about to start (``devices x num_nodes``).
        num_nodes: launcher nodes.
        trainer, precision_plugin: the Trainer and its precision plugin (skipped when None).
        module: the LightningModule handed to ``fit`` / ``validate`` ... (skipped when None).

    Raises:
        PlanError: an unsupported precision or callback, manual optimization, an averaged
            copy of the model, ``deterministic=True`` with
            an automatic depth, a pinned ``num_stages`` that does not divide the world, or a
            given plan for another number of devices.
        ClusterError: a cluster file that cannot be read or does not fit the launched world.
    """
    if trainer is not None and precision_plugin is not None:
        check_trainer(trainer, precision_plugin)
    if module is not None:
        check_module(module)
    check_reproducible(options)  # deterministic=True: the depth must be pinned
    check_stages_divide(options.pins["num_stages"], world_size)  # devices x num_nodes
    if options.cluster is not None:
        _check_cluster(options, world_size, num_nodes)
    if options.plan is not None:
        plan = options.given_plan()
        if plan is not None and len(plan.devices) != world_size:
            raise PlanError(
                f"the given plan runs on {len(plan.devices)} devices but {world_size} processes "
                "are launched; launch as many processes as the plan has devices, or drop "
                "`plan=` to plan for this world"
            )


def _check_cluster(options: AutoPipeOptions, world_size: int, num_nodes: int) -> None:
    from lightning_autopipe.cluster import Cluster

    cluster = options.cluster
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)  # ClusterError naming the file and the bad key
    cluster.validate_world_size(world_size, exact=options.exact_cluster)
    cluster.validate_nodes(num_nodes, world_size // max(num_nodes, 1))


class _Checked:
    """Runs ``check(trainer)`` before the wrapped launcher starts any process."""

    def __init__(self, *args: Any, check: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check = check

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # the launcher's own check first: devices x num_nodes against what torchrun or SLURM
        # started names the setting to fix, where the plan's check would blame the stages
        environment = getattr(self, "cluster_environment", None)
        if hasattr(environment, "validate_settings"):
            environment.validate_settings(num_devices=self.num_processes,  # type: ignore
                                          num_nodes=self.num_nodes)  # type: ignore[attr-defined]
        if trainer is not None:
            self._check(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class CheckedScriptLauncher(_Checked, _SubprocessScriptLauncher):
    """Lightning's popen launcher, checking the configuration first; the ranks it starts
    know its pid (:func:`~lightning_autopipe.runtime.failure.ending_with_launcher`)."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:  # this one starts them
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        return super().launch(function, *args, trainer=trainer, **kwargs)


class CheckedMultiProcessingLauncher(_Checked, _MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, checking the configuration first."""
