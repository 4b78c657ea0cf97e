"""A run the same seed reproduces: the plan's counts under ``deterministic=True``, BatchNorm.

The plan's depth, micro-batches and slices change the arithmetic of a step: the depth sets the
number of replicas (the global batch is the loader's batch times the replicas) and, with
BatchNorm, the micro-batches and slices are what each layer normalises over in training. An
automatic plan chooses them from timings, which are noisy, so two runs of one seed could train
different models. Under ``Trainer(deterministic=True)`` (which turns on
``torch.use_deterministic_algorithms``) and without a given plan:

* ``num_stages="auto"`` is refused (before any process starts): pin the depth;
* ``num_microbatches="auto"`` becomes the smallest divisor of the replica batch that is at
  least twice the depth (the batch itself when none is), a rule of the batch and depth alone;
* ``startup_slices`` / ``drain_slices`` ``"auto"`` become 1;
* replicas train even shares of the global batch (``balance_replicas=False``): uneven shares
  come from timings and set the samples each replica's BatchNorm normalises over.

The planner still chooses the cuts and the schedule from the measurements: they move work
between ranks, not the arithmetic of the step. Pinned counts are kept as given.

:class:`BatchNormSteps` wires :mod:`~lightning_autopipe.runtime.batchnorm` into the
strategy's training step (whole-batch running statistics, the first replica's buffers
broadcast) and words the note logged once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from lightning_autopipe.errors import PlanError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.batchnorm import (
    WholeBatchStats,
    batch_norm_note,
    broadcast_buffers,
)

__all__ = ["BatchNormSteps", "check_reproducible", "deterministic", "note",
           "reproducible_options"]


def deterministic() -> bool:
    """Whether the run asked for determinism (``Trainer(deterministic=True)`` sets this)."""
    return bool(torch.are_deterministic_algorithms_enabled())


def check_reproducible(options: AutoPipeOptions) -> None:
    """Under ``deterministic=True`` an automatic depth is refused (it sets the global batch).

    Raises:
        PlanError: ``num_stages="auto"`` with no given plan, naming the fix.
    """
    if not deterministic() or options.plan is not None:
        return
    if options.pins["num_stages"] is None:
        raise PlanError(
            "Trainer(deterministic=True) with num_stages='auto': the planner would choose the "
            "depth, hence the number of replicas and the global batch, from noisy timings, so "
            "two runs of one seed could differ; pin num_stages (e.g. AutoPipeStrategy("
            "num_stages=2)), or give a saved plan with plan=..."
        )


def reproducible_options(options: AutoPipeOptions, replica_batch: int) -> AutoPipeOptions:
    """``options`` with the counts left ``"auto"`` fixed by the noise-free rule (see module)."""
    if not deterministic() or options.plan is not None:
        return options
    check_reproducible(options)
    pins = options.pins
    stages = int(pins["num_stages"] or 1)
    changes: dict[str, Any] = {}
    if pins["num_microbatches"] is None:
        want = 2 * stages
        changes["num_microbatches"] = next(
            (d for d in range(want, replica_batch + 1) if replica_batch % d == 0), replica_batch)
    if pins["startup_slices"] is None:
        changes["startup_slices"] = 1
    if pins["drain_slices"] is None:
        changes["drain_slices"] = 1
    if options.balance_replicas:
        changes["balance_replicas"] = False
    return replace(options, **changes) if changes else options


class BatchNormSteps:
    """What a training step does for BatchNorm: hooks on the local stage, commit, broadcast.

    Built per pipeline (the strategy keeps one for the pipeline it holds). ``track=False``
    (a compiled stage, whose modules are inlined into the compiled graph) leaves the running
    statistics to the per-slice updates and only broadcasts the buffers.
    """

    def __init__(self, pipe: Any, track: bool = True) -> None:
        self.pipe = pipe
        self.stats = WholeBatchStats(pipe.stage) if track else None

    def after_step(self) -> None:
        """Commit the step's whole-batch statistics; copy the first replica's buffers."""
        if self.stats is not None:
            self.stats.commit()
        layout, groups = self.pipe.layout, self.pipe.groups
        if groups is not None and layout.num_replicas > 1:
            broadcast_buffers(self.pipe.stage, groups.dp, src=layout.grid[layout.stage][0])

    def close(self) -> None:
        if self.stats is not None:
            self.stats.remove()


def note(plan: Any, module_had_batch_norm: bool) -> str | None:
    """The BatchNorm note for ``plan``, or None when the model has none."""
    if not module_had_batch_norm:
        return None
    replica_batch = plan.global_batch_size // max(plan.replicas, 1)
    return batch_norm_note(replica_batch, plan.num_microbatches, plan.startup_slices,
                           plan.drain_slices, plan.replicas)
