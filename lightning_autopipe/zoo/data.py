"""Lightning data modules for the recipes over :mod:`~lightning_autopipe.zoo.datasets`.

Each module hands the strategy fixed-size batches (``drop_last``) in the order a one-replica
``DistributedSampler`` would draw, so one replica sees the same batches under
``strategy="auto"``, DDP or the pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_autopipe.lightning.sampler import ElasticDataLoader
from lightning_autopipe.zoo.datasets import (
    VOCAB_SIZE,
    CausalLMDataset,
    MaskedLMDataset,
    SyntheticImages,
    load_stdlib_tokens,
)

__all__ = ["StdlibMLMDataModule", "StdlibTextDataModule", "SyntheticImageDataModule"]


class _ReplicaOrder(RandomSampler):
    """A random order: the one Lightning's ``DistributedSampler`` gives a single replica.

    Under a distributed strategy Lightning replaces a ``RandomSampler`` with
    ``DistributedSampler(dataset, shuffle=True, seed=$PL_GLOBAL_SEED)``, re-seeded every epoch,
    while a single-device run keeps the loader's own sampler. Drawing exactly that order here
    makes one replica see the same batches under ``strategy="auto"`` as under DDP or the
    pipeline. (Being a ``RandomSampler`` is what lets Lightning replace it cleanly; any other
    sampler would be wrapped, and sharded after this shuffle.)
    """

    def __init__(self, data_source: Dataset) -> None:
        super().__init__(data_source)  # type: ignore[arg-type]
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(int(os.getenv("PL_GLOBAL_SEED", "0")) + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=g).tolist())  # type: ignore[arg-type]


class _FixedDataModule(pl.LightningDataModule):
    """Train/val loaders over two datasets; fixed batch size (``drop_last``) for pipelining;
    training order as a one-replica ``DistributedSampler`` (see :class:`_ReplicaOrder`).

    With ``global_batch_size`` the training loader is an
    :class:`~lightning_autopipe.lightning.sampler.ElasticDataLoader` of that many samples per
    step over all replicas (the same order, resumable, whatever the world size; the Trainer
    then needs ``use_distributed_sampler=False``) and ``batch_size`` only sizes validation.
    """

    def __init__(
        self, batch_size: int, num_workers: int = 0, seed: int = 0,
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _datasets(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._datasets()
            if len(self.train_set) < self.batch_size:  # type: ignore[arg-type]
                raise ValueError(
                    f"{type(self).__name__}: {len(self.train_set)} training samples cannot fill "  # type: ignore[arg-type]
                    f"one batch of {self.batch_size}; raise the corpus size or lower batch_size"
                )

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if train and self.global_batch_size:
            return ElasticDataLoader(
                dataset, self.global_batch_size, shuffle=True,
                seed=int(os.getenv("PL_GLOBAL_SEED", "0")),  # _ReplicaOrder's order
                num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
            )
        return DataLoader(
            dataset,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            sampler=_ReplicaOrder(dataset) if train else None,  # type: ignore[arg-type]
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.val_set, train=False)


def _split(n: int, val_fraction: float, min_val: int) -> int:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1)")
    return min(n - 1, max(min_val, int(n * val_fraction)))


class StdlibTextDataModule(_FixedDataModule):
    """Next-byte prediction on the standard library's source (GPT recipes).

    Args:
        block_size: tokens per sample (the model's context length).
        batch_size: samples per batch handed to the strategy (per data-parallel replica).
        global_batch_size: if set, training batches are global ones, resumable at any world
            size (see :class:`_FixedDataModule`).
        max_bytes: corpus cap in bytes (= tokens).
        val_fraction: share of blocks, taken from the end of the corpus, held out.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 8,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.02,
        num_workers: int = 0,
        seed: int = 0,
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, global_batch_size)
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction

    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = load_stdlib_tokens(self.max_bytes)
        blocks = tokens.numel() // self.block_size
        n_val = _split(blocks, self.val_fraction, min_val=self.batch_size + 1)
        cut = (blocks - n_val) * self.block_size
        return tokens[: cut + 1], tokens[cut:]

    def _datasets(self) -> tuple[Dataset, Dataset]:
        train, val = self._tokens()
        return CausalLMDataset(train, self.block_size), CausalLMDataset(val, self.block_size)


class StdlibMLMDataModule(StdlibTextDataModule):
    """Masked-LM (BERT recipe) on the standard library's source; see :class:`MaskedLMDataset`.

    Args:
        mask_prob: share of each sample's positions chosen for the loss.
        **text: :class:`StdlibTextDataModule`'s arguments, by name (the corpus and the
            batches are the same; only the samples differ).
    """

    def __init__(self, *, mask_prob: float = 0.15, **text: Any) -> None:
        super().__init__(**text)
        self.mask_prob = mask_prob

    def _datasets(self) -> tuple[Dataset, Dataset]:
        train, val = self._tokens()
        return (
            MaskedLMDataset(train, self.block_size, self.mask_prob, self.seed),
            MaskedLMDataset(val, self.block_size, self.mask_prob, self.seed + 1),
        )


class SyntheticImageDataModule(_FixedDataModule):
    """Image classification on :class:`SyntheticImages` (ResNet recipe)."""

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        channels: int = 3,
        num_samples: int = 4096,
        val_samples: int = 256,
        noise: float = 0.5,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, seed, global_batch_size)
        self.num_classes = num_classes
        self.image_size = image_size
        self.channels = channels
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.noise = noise

    def _datasets(self) -> tuple[Dataset, Dataset]:
        args = (self.num_classes, self.image_size, self.channels, self.noise)
        train = SyntheticImages(self.num_samples, *args, seed=self.seed)
        val = SyntheticImages(self.val_samples, *args, seed=self.seed)
        # Same prototypes (same seed), different samples: shift val indices past the train set.
        return train, _Offset(val, self.num_samples)


class _Offset(Dataset):
    """``dataset`` read at ``index + offset`` (the seeded generators make any index valid)."""

    def __init__(self, dataset: SyntheticImages, offset: int) -> None:
        self.dataset = dataset
        self.offset = offset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset[index + self.offset]
