"""Checks of user input that run before any pipeline work, each naming the values and the fix.

They are plain functions so tests call them without processes; the strategy and the executor
call them at the earliest point the needed facts are known (construction, trace, plan, batch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_autopipe.errors import InputError, MemoryPlanError, PlanError

__all__ = [
    "batch_digest",
    "check_batch_sizes",
    "check_loss_contract",
    "check_microbatches",
    "check_num_stages",
    "check_plan_for_run",
    "check_same_batch",
    "check_stages_divide",
]

GiB = 2**30


def check_loss_contract(module: Any) -> None:
    """The LightningModule must define ``pipeline_loss(outputs, batch)``."""
    if not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"{type(module).__name__} has no pipeline_loss(outputs, batch); define it to return "
            "the mean loss of one (slice of a) batch from forward's outputs, e.g. "
            "`def pipeline_loss(self, outputs, batch): return F.cross_entropy(outputs, batch[1])`"
        )


def check_num_stages(
    num_stages: int | None, num_blocks: int, world_size: int, granularity: str = "sub-block"
) -> None:
    """A pinned pipeline depth must divide the world and not exceed the model's blocks."""
    if num_stages is None:
        return
    if num_stages > num_blocks:
        finer = (
            "granularity='sub-block' for more cut points"
            if granularity != "sub-block"
            else "a model with more layers"
        )
        raise PlanError(
            f"num_stages={num_stages} but the model splits into only {num_blocks} blocks "
            f"(granularity={granularity!r}); use at most {min(num_blocks, world_size)} stages, "
            f"or {finer}"
        )
    check_stages_divide(num_stages, world_size)


def check_stages_divide(num_stages: int | None, world_size: int) -> None:
    """A pinned pipeline depth must divide the world: every stage has as many replicas.

    Needs no model, so the launcher runs it before any process starts, and every rank again.
    """
    if num_stages is None or world_size % num_stages == 0:
        return
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    raise PlanError(
        f"num_stages={num_stages} does not divide the {world_size} launched processes; every "
        f"stage needs the same number of replicas: launch a multiple of {num_stages} "
        f"processes, pick num_stages in {divisors}, or num_stages='auto' to let the planner "
        "choose (recipes: strategy=autopipe)"
    )


def check_microbatches(
    replica_batch: int,
    num_microbatches: int | None,
    startup_slices: int | None,
    replicas: int = 1,
    drain_slices: int | None = None,
) -> None:
    """The replica batch must cut into ``num_microbatches`` even micro-batches, ``k`` and ``j``
    slices (startup and drain).

    ``None`` (auto) skips that part: the planner then only proposes sizes that fit.
    """
    m, k, r = num_microbatches, startup_slices, replicas
    if m is not None and replica_batch % m:
        ok = [d for d in range(1, replica_batch + 1) if replica_batch % d == 0]
        raise PlanError(
            f"the batch of {replica_batch} samples per replica (global batch "
            f"{replica_batch * r} over {r} replicas) is not divisible into {m} micro-batches; "
            f"use a batch size that is a multiple of {m}, or num_microbatches in {ok[:12]}"
        )
    if k is not None and k > replica_batch // (m or 1):
        micro = replica_batch // (m or 1)
        raise PlanError(
            f"a micro-batch of {micro} samples cannot be cut into {k} startup slices; use "
            f"startup_slices <= {micro}, fewer micro-batches or a larger batch"
        )
    if drain_slices is not None and m != 1 and drain_slices > replica_batch // (m or 1):
        micro = replica_batch // (m or 1)
        raise PlanError(
            f"a micro-batch of {micro} samples cannot be cut into {drain_slices} drain slices; "
            f"use drain_slices <= {micro}, fewer micro-batches or a larger batch"
        )


def check_plan_for_run(
    plan: Any, replica_batch: int, cluster: Any, *, memory_check: bool = True
) -> None:
    """A given plan must match the dataloader's batch and fit the cluster's device memory.

    Args:
        plan: the ``Plan`` about to run.
        replica_batch: the dataloader's batch size (one data-parallel replica's batch).
        cluster: the ``Cluster`` the run is on (device memory).
        memory_check: compare the plan's predicted peak memory with each device's memory.

    Raises:
        PlanError: the replica batch cannot be cut into the plan's micro-batches and slices.
        MemoryPlanError: a device's predicted peak exceeds its memory.
    """
    check_microbatches(
        replica_batch, plan.num_microbatches, plan.startup_slices, plan.replicas,
        plan.drain_slices,
    )
    if not memory_check:
        return
    for device, need in sorted(plan.peak_memory_bytes.items()):
        try:
            have = cluster.device(device).spec.memory_bytes
        except Exception:  # the device check proper happens when the layout is built
            continue
        if need > have:
            s = next((i for i, st in enumerate(plan.stages) if device in st.devices), None)
            raise MemoryPlanError(
                f"the plan needs {need / GiB:.2f} GiB on {device} (stage {s}) which has "
                f"{have / GiB:.2f} GiB; re-plan for this cluster (drop `plan=`), use more "
                "stages or smaller micro-batches"
            )


def check_batch_sizes(batch: Any, flat_inputs: Sequence[Tensor], size: int) -> None:
    """Every model input and every other tensor of the batch must hold ``size`` samples.

    The pipeline slices the batch along dim 0; a target with another first dimension would
    reach ``pipeline_loss`` unsliced and fail (or, worse, broadcast) deep in the last stage.

    Raises:
        InputError: naming the tensor, its shape and the inputs' sample count.
    """
    for i, t in enumerate(flat_inputs):
        if t.dim() == 0 or int(t.shape[0]) != size:
            raise InputError(
                f"forward input {i} has shape {tuple(t.shape)} but input 0 holds {size} samples; "
                "every tensor handed to forward must have the batch as its first dimension"
            )
    for where, t in _tensors(batch, "batch"):
        if t.dim() > 0 and int(t.shape[0]) != size:
            raise InputError(
                f"{where} has shape {tuple(t.shape)} (first dimension {t.shape[0]}) but the "
                f"model inputs hold {size} samples; inputs and targets must hold the same "
                "samples (check the dataset / collate_fn). If this tensor is not per-sample, "
                "pass check_batch=False to AutoPipeStrategy: it then reaches pipeline_loss whole"
            )


#: A prime below 2**31: digests are exact in float64 and in the sums below.
_PRIME = 2_147_483_647


def batch_digest(batch: Any) -> Tensor:
    """An exact digest (float64 below 2**31) of a batch's integer and boolean tensors: labels,
    token ids, masks. Every stage of a replica must load the same batch (the first stage's
    inputs go with the last stage's labels); an integer digest is the same on any device.
    Floating tensors are left out: a random augmentation of the inputs may differ between a
    replica's ranks without harm where only the first stage reads them. At most 65536
    elements of a tensor are read, each weighted by its position (a reordering changes it).
    """
    total: Tensor | None = None
    for i, (_, t) in enumerate(_tensors(batch, "batch")):  # None: no check, a digest of 0
        if t.is_floating_point() or t.is_complex():
            continue
        flat = t.detach().reshape(-1)
        x = flat[:: max(1, flat.numel() // 65536)][:65536].to(torch.int64) % _PRIME
        w = (torch.arange(x.numel(), device=x.device, dtype=torch.int64) + i) % 65521 + 1
        part = (x * w).sum() % _PRIME + t.numel()
        total = part if total is None else (total + part) % _PRIME
    if total is None:
        return torch.zeros((), dtype=torch.float64)
    return total.to(torch.float64)


def check_same_batch(digests: Mapping[int, Tensor], layout: Any) -> None:
    """Every rank's batch digest (:func:`batch_digest`) of one replica's pipeline against its
    last stage's; the same verdict on every rank (``layout``: this rank's
    :class:`~lightning_autopipe.runtime.groups.RankLayout`).

    Raises:
        InputError: ranks of the replica loaded different samples (a dataset sharded by the
            global rank, a sampler or collate that differs per rank, random masking seeded
            by rank).
    """
    last = layout.last_stage_rank
    ranks = list(digests)
    values = torch.stack([digests[r] for r in ranks]).tolist()  # one host sync, not one each
    other = sorted(r for r, d in zip(ranks, values) if d != values[ranks.index(last)])
    if other:
        raise InputError(
            f"rank(s) {other} of replica {layout.replica} loaded another batch than its last "
            f"stage (rank {last}): their labels / token ids differ. Every stage of a "
            "data-parallel replica must load the same samples in the same order (the first "
            "stage's inputs meet the last stage's labels), so the data must not depend on the "
            "rank beyond the replica: shard by trainer.strategy.distributed_sampler_kwargs "
            "('rank' is the replica, 'num_replicas' their count), not by the global rank, and "
            "seed random masking or collation alike on a replica's ranks (seed_everything("
            "workers=True) seeds DataLoader workers by the global rank). check_batch=False "
            "skips this check (and the batch-size check)"
        )


def _tensors(obj: Any, where: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield where, obj
    elif isinstance(obj, Mapping):  # a Hugging Face BatchEncoding is a UserDict
        for key, value in obj.items():
            yield from _tensors(value, f"{where}[{key!r}]")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{where}[{i}]")
