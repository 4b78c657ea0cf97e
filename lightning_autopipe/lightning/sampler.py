"""A training order that survives a change of data-parallel width: one global batch per step.

Under DDP-style loading the dataloader's batch is one replica's, so a torchrun restart on fewer
nodes would shrink the global batch, and Lightning's ``DistributedSampler`` restarts the epoch
from its first batch on resume. :class:`ElasticDataLoader` fixes both: it is built with the
*global* batch size, every step trains global batch ``t`` of one seeded permutation per epoch,
whatever the width, and its position (epoch, global batches done) is saved with the checkpoint
(Lightning stores the state of a loader that has ``state_dict``/``load_state_dict``) and
re-striped for the new width on resume. The strategy stripes it for its layout
(:func:`stripe_for_layout`) and sizes the plan for ``global_batch_size / replicas``
(:func:`elastic_replica_batch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from lightning_autopipe.errors import InputError, PlanError

__all__ = [
    "ElasticBatchSampler",
    "ElasticDataLoader",
    "elastic_replica_batch",
    "elastic_train_loader",
    "stripe_for_layout",
]

_STATE_KEYS = ("global_batch_size", "num_samples", "shuffle", "seed")


class ElasticBatchSampler(Sampler[list[int]]):
    """This replica's share of every global batch, from a saved position.

    Global batch ``t`` of epoch ``e`` is positions ``[t*G, (t+1)*G)`` of
    ``torch.randperm(num_samples)`` seeded with ``seed + e`` (the identity order without
    ``shuffle``); an epoch has ``num_samples // G`` of them (the rest is dropped, as
    ``drop_last`` does). Replica ``r`` of ``R`` takes every ``R``-th of those positions from
    ``r``: ``DistributedSampler``'s striping, so at one width the batches are exactly those of a
    ``DistributedSampler(shuffle=shuffle, seed=seed)`` loader of batch ``G / R`` when
    ``num_samples`` is a multiple of ``G``, and at any width the union over replicas of step
    ``t``'s batches is global batch ``t``.

    Args:
        num_samples: the dataset's length.
        global_batch_size: samples per optimizer step over all replicas (``G``).
        shuffle: permute every epoch (else the dataset order).
        seed: the permutation of epoch ``e`` is seeded with ``seed + e``.

    Raises:
        InputError: a non-positive size, or fewer samples than one global batch.
    """

    def __init__(
        self, num_samples: int, global_batch_size: int, *, shuffle: bool = True, seed: int = 0
    ) -> None:
        for name, value in (("num_samples", num_samples), ("global_batch_size", global_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if num_samples < global_batch_size:
            raise InputError(
                f"the dataset has {num_samples} samples, fewer than one global batch of "
                f"{global_batch_size}; lower global_batch_size or use more data"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.replica, self.num_replicas = 0, 1
        self.start = 0  # global batches of ``epoch`` trained before this pass (a checkpoint's)
        self.position = 0  # global batches of ``epoch`` handed to training so far

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def replica_batch(self) -> int:
        """Samples of one replica per step at the current striping."""
        return self.global_batch_size // self.num_replicas

    def stripe(self, replica: int, num_replicas: int) -> None:
        """Serve replica ``replica`` of ``num_replicas`` from the next pass on."""
        check_width(self.global_batch_size, num_replicas)
        if not 0 <= replica < num_replicas:
            raise InputError(f"replica {replica} is not one of {num_replicas} replicas")
        self.replica, self.num_replicas = int(replica), int(num_replicas)

    @property
    def sampler(self) -> ElasticBatchSampler:
        """Itself: Lightning sets the epoch through ``loader.batch_sampler.sampler.set_epoch``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this at every epoch start (also the resumed one: keep its position)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.position = int(epoch), 0, 0

    def global_batch(self, t: int, epoch: int | None = None) -> list[int]:
        """The dataset indices of global batch ``t`` of ``epoch`` (default: the current one)."""
        order = self._order(self.epoch if epoch is None else epoch)
        return order[t * self.global_batch_size : (t + 1) * self.global_batch_size]

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the epoch and position are read at the first batch, after Lightning's
        # set_epoch and the checkpoint's load_state_dict, not when the iterator is created.
        order = self._order(self.epoch)
        g, r, n = self.global_batch_size, self.replica, self.num_replicas
        for t in range(self.start, self.batches_per_epoch):
            yield order[t * g + r : (t + 1) * g : n]

    def __len__(self) -> int:
        """The whole epoch: Lightning counts the batches a resumed epoch already trained."""
        return self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: epoch, global batches done in it, and what fixes the order."""
        return {
            "epoch": self.epoch,
            "batches": self.position,
            "samples": self.position * self.global_batch_size,
            "num_replicas": self.num_replicas,
            **{k: getattr(self, k) for k in _STATE_KEYS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state``'s last global batch, whatever width it was saved at.

        Raises:
            InputError: the saved global batch, dataset length, shuffle or seed differ from
                this loader's: the continued run would not be the same training.
        """
        differ = [
            f"{k} {state.get(k)!r} (now {getattr(self, k)!r})"
            for k in _STATE_KEYS if state.get(k) != getattr(self, k)
        ]
        if differ:
            raise InputError(
                "the checkpoint's data order was saved with " + ", ".join(differ) + "; resume "
                "with the same global_batch_size, dataset, shuffle and seed, or start a new run "
                "from the checkpoint's weights only"
            )
        self.epoch = int(state["epoch"])
        self.start = self.position = int(state["batches"])


class ElasticDataLoader(DataLoader):
    """A ``DataLoader`` of *global* batches that resumes where the checkpoint stopped.

    Give it the global batch size (samples per optimizer step over all data-parallel replicas);
    ``AutoPipeStrategy`` stripes it for its layout, so each replica loads
    ``global_batch_size / replicas`` samples per step, and the order is that of
    :class:`ElasticBatchSampler` at every width. Lightning saves its :meth:`state_dict` in the
    checkpoint and restores it on ``fit(ckpt_path=...)``. Use it with
    ``Trainer(use_distributed_sampler=False)`` (it does its own striping).

    Args:
        dataset: a map-style dataset.
        global_batch_size: samples per step over all replicas.
        shuffle, seed: see :class:`ElasticBatchSampler`.
        **kwargs: other ``DataLoader`` arguments (``num_workers``, ``collate_fn``, ...); not
            ``batch_size``, ``sampler``, ``batch_sampler``, ``drop_last``.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        taken = sorted({"batch_size", "sampler", "batch_sampler", "drop_last"} & set(kwargs))
        if taken:
            raise InputError(
                f"ElasticDataLoader chooses {', '.join(taken)} itself; pass global_batch_size "
                "(samples per step over all replicas) instead"
            )
        sampler = ElasticBatchSampler(len(dataset), global_batch_size, shuffle=shuffle, seed=seed)
        super().__init__(dataset, batch_sampler=sampler, **kwargs)

    @property
    def elastic(self) -> ElasticBatchSampler:
        return self.batch_sampler  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.elastic
        sampler.position = sampler.start
        for batch in super().__iter__():
            sampler.position += 1  # handed to training: the state a checkpoint now records
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.elastic.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elastic.load_state_dict(state)


def check_width(global_batch_size: int, num_replicas: int) -> None:
    """The global batch must split evenly over the replicas (else the training would change)."""
    if num_replicas < 1 or global_batch_size % num_replicas:
        fits = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
        raise PlanError(
            f"the global batch of {global_batch_size} samples does not split evenly over "
            f"{num_replicas} data-parallel replicas; run a world whose replica count divides "
            f"it ({', '.join(map(str, fits))}) or choose another global_batch_size"
        )


def elastic_train_loader(trainer: Any) -> ElasticDataLoader | None:
    """The fit's training loader when it is an :class:`ElasticDataLoader`, else None.

    Asks the ``train_dataloader`` hook for it (once more: the example batch and the fit loop
    ask too), as only the loader itself says whether its batches are global ones.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer.state.fn != TrainerFn.FITTING:
        return None
    loader = trainer.fit_loop._data_source.dataloader()
    if isinstance(loader, list | tuple) and loader:
        loader = loader[0]
    return loader if isinstance(loader, ElasticDataLoader) else None


def elastic_replica_batch(
    trainer: Any, options: Any, world_size: int, loader_batch: int
) -> int:
    """The replica batch to plan for: ``global_batch_size / replicas`` for an elastic loader.

    The replica count must be known before planning, so the pipeline depth must be pinned
    (``num_stages``) or a plan given; any other loader keeps ``loader_batch``.

    Raises:
        InputError: the Trainer would wrap the loader in a ``DistributedSampler``.
        PlanError: the depth is not pinned, or the global batch does not split evenly.
    """
    loader = elastic_train_loader(trainer)
    if loader is None:
        return loader_batch
    if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
        raise InputError(
            "an ElasticDataLoader stripes its global batches over the replicas itself; build "
            "the Trainer with use_distributed_sampler=False (Lightning would wrap it in a "
            "DistributedSampler)"
        )
    if options.plan is not None:
        replicas = options.given_plan().replicas
    elif options.pins["num_stages"] is not None:
        replicas = world_size // options.pins["num_stages"]
    else:
        raise PlanError(
            "an ElasticDataLoader keeps the global batch fixed whatever the world size, so the "
            "number of data-parallel replicas must be known before planning: pin the pipeline "
            "depth (num_stages=...) or give a plan"
        )
    check_width(loader.elastic.global_batch_size, replicas)
    return loader.elastic.global_batch_size // replicas


def stripe_for_layout(dataloader: Any, replica: int, num_replicas: int) -> Any:
    """Stripe an :class:`ElasticDataLoader` for this rank's replica; others pass unchanged."""
    if isinstance(dataloader, ElasticDataLoader):
        dataloader.elastic.stripe(replica, num_replicas)
    return dataloader
