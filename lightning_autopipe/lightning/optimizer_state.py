"""The optimizer state a plan counts, measured from the module's own optimizers.

A stage's memory is its parameters times (weights + gradients + optimizer state) plus the
activations in flight. The planner needs the optimizer's share before the pipeline exists, but
Lightning makes the optimizers only after the strategy's setup built the stage (they train the
stage's parameters). So, once per build for a ``fit``, ``configure_optimizers`` is called on the
whole module and its optimizers are measured on a probe
(:func:`~lightning_autopipe.runtime.optim_state.state_bytes_per_param_byte`), then dropped.
Assuming Adam's 2 bytes per parameter byte for a plain SGD run over-predicted a stage's peak
by 14-25% on a GPT whose activations are five times its weights (benchmarks/adaptive.py), and
by far more where the weights dominate.

That early call must leave nothing behind: a ``configure_optimizers`` that sizes a schedule by
``self.trainer.estimated_stepping_batches`` (``OneCycleLR``'s ``total_steps``) makes Lightning
load the training data there, sampled for a world of data-parallel replicas that does not exist
yet (one per rank, before the plan says how many replicas the pipeline has): the stages of a
replica were then given different batches, and the schedule the wrong length. The data loaded
by the probe is dropped, so the real call loads it for the pipeline's replicas.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.optim_state import state_bytes_per_param_byte

__all__ = ["with_measured_optimizer_state"]


def with_measured_optimizer_state(options: AutoPipeOptions, module: Any, fitting: bool
                                  ) -> AutoPipeOptions:
    """``options`` with ``optimizer_state`` measured when it is ``"auto"``, a plan is to be
    made and the Trainer is fitting (validate, test and predict make no optimizer); unchanged
    (the planner then counts 2, Adam's) when ``configure_optimizers`` or the probe fails."""
    if options.optimizer_state != "auto" or options.plan is not None or not fitting:
        return options
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    loop = getattr(getattr(module, "_trainer", None), "fit_loop", None)
    loaded = getattr(loop, "_combined_loader", None)
    try:
        with warnings.catch_warnings():  # Lightning warns again when it makes them for real
            warnings.simplefilter("ignore")
            optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    except Exception:  # noqa: BLE001 - its own call, after the build, raises for the user
        return options
    finally:
        if loop is not None and loaded is None:  # data loaded for the probe (docstring)
            loop._combined_loader = None
    factor = state_bytes_per_param_byte(optimizers)
    return options if factor is None else replace(options, optimizer_state=factor)
