"""Build this rank's part of a pipeline: trace, then measure -> agree -> build.

The phases are separate modules, each a function of what it needs:
:mod:`~lightning_autopipe.runtime.measure` (every rank: the cluster, the blocks' profile),
:mod:`~lightning_autopipe.runtime.agree` (rank 0 plans; every rank receives a
:class:`~lightning_autopipe.runtime.agree.PlanMessage`) and
:mod:`~lightning_autopipe.runtime.build` (the local stage, groups and executor; callable
again for a new plan over the same blocks: :func:`rebuild_pipeline`).
Kept apart from the Lightning strategy so the benchmark and tests can build a pipeline from any
``nn.Module`` with a ``pipeline_loss`` under a plain ``torch.distributed`` launch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_autopipe.errors import InputError
from lightning_autopipe.graph.trace import has_meta
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime import log
from lightning_autopipe.runtime.agree import agree
from lightning_autopipe.runtime.build import (
    LocalPipeline,
    StageSource,
    build_pipeline,
    rebuild_pipeline,
)
from lightning_autopipe.runtime.checks import check_loss_contract, check_num_stages
from lightning_autopipe.runtime.measure import measure, resolve_cluster

__all__ = ["LocalPipeline", "build_local_pipeline", "rebuild_pipeline", "resolve_cluster"]


def build_local_pipeline(
    module: nn.Module,
    example: tuple[Any, ...] | dict[str, Any],
    replica_batch: int,
    options: AutoPipeOptions,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    broadcast: Callable[[Any, int], Any],
    backend: str | None = None,
    example_batch: Any = None,
    num_nodes: int = 1,
    run_dir: str | Path | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    initial_state: Any = None,
    measure_memory: bool = True,
) -> LocalPipeline:
    """Trace on every rank, profile on every rank, plan on rank 0, keep only the local stage.

    Every rank traces (so an untraceable model raises the graph layer's ``TraceError`` on every
    rank before any collective, never a hang), then runs the three phases: ``measure``,
    ``agree`` and ``build``. Without a given plan every rank profiles on its
    own ``device`` at the same time (in training all ranks compute at once and contend for
    shared cores and memory bandwidth, so a profile taken while the others idle would be
    optimistic), and a rank whose profiling fails stops every rank with its error.

    Without a cluster file the cluster is discovered from the ranks
    (:func:`~lightning_autopipe.runtime.discover.discover`: hosts, devices, each rank's own
    profile, measured links) and, when ``run_dir`` is given, written there as
    ``cluster.yaml`` with a profile per device type; rank 0 plans from the fastest type's
    profile, pricing every other type from its own. With a cluster file rank 0 plans from its
    own profile on that cluster and warns where the file contradicts what the ranks measured.
    Without ``torch.distributed`` (a single process) the launched world is ``Cluster.local``.
    Rank 0's plan (or its error) is broadcast. The module's parameters are then rebound to the
    local stage (:func:`bind_local_stage`). User input is checked first (``pipeline_loss``,
    cluster size, pinned depth vs. blocks, a given plan's fingerprint, batch and memory) so a
    bad configuration fails on every rank before any profiling or training.

    ``options`` are the strategy's: the cluster, the given plan (or the planner and its pins),
    the granularity, profiling repeats and the runtime's settings. ``backend`` overrides
    ``options.process_group_backend`` with the one the default group was started with.

    ``example_batch``, when given, is the batch the ``example`` inputs came from, holding the
    same samples (its per-sample tensors have the example's first dimension). The last block is
    then profiled with ``module.pipeline_loss`` on it, as the last stage runs in training;
    without it the loss is left out of the profile.

    ``loss_fn``, when given, is the last stage's loss per slice instead of
    ``module.pipeline_loss`` (the strategy passes its runner of the module's own steps).

    A module whose parameters are on the meta device (built under
    :func:`~lightning_autopipe.runtime.materialize.deferred_init`, e.g. in ``configure_model``)
    is traced on shapes, profiled block by block (one block's parameters materialised at a
    time; none with a given plan) and only the local stage is materialised, on ``device``:
    read by original name from ``initial_state`` (a mapping such as a memory-mapped
    checkpoint's ``state_dict``, or a sharded checkpoint's reader: only this stage's keys are
    read), else initialised by the model's own initialisers from rank 0's
    ``torch.initial_seed()`` (the same weights under any layout, see
    :mod:`~lightning_autopipe.runtime.materialize`). ``initial_state`` is refused for a
    module built for real (it already holds its weights).

    With ``measure_memory`` the executor measures this rank's peak memory in the second
    training step and rank 0 logs every rank's beside the plan's prediction
    (:mod:`~lightning_autopipe.runtime.memory`). A stage the plan recomputes runs its forward
    under activation checkpointing (its backward recomputes it).

    With ``options.compile`` the executor runs the local stage compiled once
    (:mod:`~lightning_autopipe.runtime.compiled_stage`; under a schedule that splits the
    backward, its compiled backward is cut into input- and weight-gradient graphs) and each
    rank's profile is corrected to the compiled speed.
    """
    from lightning_autopipe.graph import split_model

    if loss_fn is None:
        check_loss_contract(module)
        loss_fn = module.pipeline_loss
    deferred = has_meta(module)
    if initial_state is not None and not deferred:
        raise InputError(
            "initial_state is for a model built on the meta device (its stage is read from "
            "it); this module already holds its weights: load them into it before the "
            "pipeline is built, or build it under deferred_init() / trainer.init_module()"
        )
    # Every rank traces before any collective: an untraceable model fails everywhere alike.
    blocks = split_model(module, example, granularity=options.granularity)
    for note in blocks.notes:  # what the capture chose on its way, said once
        log.rank_zero_info(f"capture ({blocks.tracer}): {note}")
    check_num_stages(options.pins["num_stages"], len(blocks), world_size, options.granularity)
    measured = measure(blocks, example, options, rank=rank, world_size=world_size,
                       device=device, loss_fn=loss_fn, example_batch=example_batch,
                       num_nodes=num_nodes, run_dir=run_dir)
    agreed = agree(blocks, measured, options, replica_batch, rank=rank, broadcast=broadcast)
    source = StageSource(
        module=module,
        blocks=blocks,
        options=options,
        rank=rank,
        device=device,
        names=measured.names,
        loss_fn=loss_fn,
        seed=agreed.seed,
        backend=backend,
        initial_state=initial_state,
        measure_memory=measure_memory,
        deferred=deferred,
    )
    return build_pipeline(source, agreed.plan, agreed.profile, measured.cluster)
