"""Data that ships on every machine: the Python standard library as text, synthetic images.

The recipes must train a real model on a fresh machine with no network, so the text corpus is
the interpreter's own standard library source (``sysconfig.get_paths()["stdlib"]``), read in a
fixed file order up to a byte cap and tokenised at the byte level (256 byte values plus a few
specials). Every sample is a pure function of its index and the seed, so two runs, two
launchers or two strategies see exactly the same batches.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_autopipe.lightning.sampler import ElasticDataLoader

__all__ = [
    "EOS",
    "IGNORE_INDEX",
    "MASK",
    "VOCAB_SIZE",
    "CausalLMDataset",
    "MaskedLMDataset",
    "StdlibMLMDataModule",
    "StdlibTextDataModule",
    "SyntheticImageDataModule",
    "SyntheticImages",
    "decode",
    "encode",
    "load_stdlib_tokens",
]

EOS = 256  # separates source files
MASK = 257  # the masked-LM [MASK] token
VOCAB_SIZE = 258  # 256 byte values + EOS + MASK; models may use a larger (padded) vocabulary
IGNORE_INDEX = -100  # label of positions that carry no loss (F.cross_entropy's default)

# Directories skipped in the standard library: third-party packages (they differ between
# machines far more than the stdlib does) and test suites (huge, odd encodings).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def encode(text: str) -> torch.Tensor:
    """Byte-level tokens of ``text`` (UTF-8), as int64."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Text of byte tokens; specials print as ``<eos>`` / ``<mask>``."""
    out: list[str] = []
    raw = bytearray()
    for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens):
        if 0 <= t < 256:
            raw.append(t)
            continue
        out.append(raw.decode("utf-8", errors="replace"))
        raw.clear()
        out.append({EOS: "<eos>", MASK: "<mask>"}.get(t, f"<{t}>"))
    out.append(raw.decode("utf-8", errors="replace"))
    return "".join(out)


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_stdlib_tokens(max_bytes: int = 2_000_000, root: str | Path | None = None) -> torch.Tensor:
    """Concatenated byte tokens of the standard library's ``.py`` files, ``EOS`` between files.

    Args:
        max_bytes: stop after this many tokens (the corpus is ~30 MB; tiny runs need far less).
        root: the directory to read; default the running interpreter's stdlib.

    Returns:
        A 1-D int16 tensor of at most ``max_bytes`` tokens.

    Raises:
        ValueError: ``max_bytes`` is too small or the directory has no ``.py`` files.
    """
    if max_bytes < 1024:
        raise ValueError(f"max_bytes={max_bytes} is too small for a corpus; use >= 1024")
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    chunks: list[torch.Tensor] = []
    total = 0
    for path in _stdlib_files(base):
        data = path.read_bytes()
        if not data:
            continue
        chunk = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16)
        chunks.append(torch.cat([chunk, torch.tensor([EOS], dtype=torch.int16)]))
        total += chunk.numel() + 1
        if total >= max_bytes:
            break
    if not chunks:
        raise ValueError(f"no .py files under {base}; pass root= pointing at Python sources")
    return torch.cat(chunks)[:max_bytes]


class CausalLMDataset(Dataset):
    """Fixed-length next-token samples ``(x, y)``: ``y`` is ``x`` shifted left by one token."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size={block_size} must be >= 2")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class MaskedLMDataset(Dataset):
    """BERT-style masked-LM samples ``(input_ids, labels)`` with static, per-index masking.

    ``mask_prob`` of the positions (at least one) are chosen; of those 80% become ``MASK``, 10% a
    random byte and 10% stay. Labels are the original tokens at chosen positions and
    ``IGNORE_INDEX`` elsewhere. The choice is seeded by ``(seed, index)`` so it is identical in
    every process.
    """

    def __init__(
        self, tokens: torch.Tensor, block_size: int, mask_prob: float = 0.15, seed: int = 0
    ) -> None:
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob={mask_prob} must lie in (0, 1)")
        if block_size < 2:
            raise ValueError(f"block_size={block_size} must be >= 2")
        self.tokens = tokens
        self.block_size = block_size
        self.mask_prob = mask_prob
        self.seed = seed

    def __len__(self) -> int:
        return self.tokens.numel() // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        ids = self.tokens[start : start + self.block_size].long()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chosen = torch.rand(self.block_size, generator=g) < self.mask_prob
        if not chosen.any():
            chosen[torch.randint(self.block_size, (1,), generator=g)] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
        action = torch.rand(self.block_size, generator=g)
        random_bytes = torch.randint(0, 256, (self.block_size,), generator=g)
        inputs = ids.clone()
        inputs[chosen & (action < 0.8)] = MASK
        swap = chosen & (action >= 0.8) & (action < 0.9)
        inputs[swap] = random_bytes[swap]
        return inputs, labels


class SyntheticImages(Dataset):
    """A learnable image task: each class is a fixed smooth colour pattern, samples add noise.

    Class prototypes are random 4x4 patterns upsampled to ``image_size``; a sample is its class
    prototype times a random contrast, plus Gaussian noise. Everything is seeded by ``seed``
    and the index.
    """

    def __init__(
        self,
        num_samples: int,
        num_classes: int = 10,
        image_size: int = 32,
        channels: int = 3,
        noise: float = 0.5,
        seed: int = 0,
    ) -> None:
        if num_samples < 1 or num_classes < 2 or image_size < 4 or channels < 1:
            raise ValueError(
                f"SyntheticImages needs num_samples >= 1, num_classes >= 2, image_size >= 4, "
                f"channels >= 1; got {num_samples}, {num_classes}, {image_size}, {channels}"
            )
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.noise = noise
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
        self.prototypes = F.interpolate(
            coarse, size=(image_size, image_size), mode="bilinear", align_corners=False
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 + index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        contrast = 0.5 + torch.rand(1, generator=g)
        proto = self.prototypes[label]
        image = contrast * proto + self.noise * torch.randn(proto.shape, generator=g)
        return image, torch.tensor(label)


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
    """Masked-LM (BERT recipe) on the standard library's source; see :class:`MaskedLMDataset`."""

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 8,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.02,
        mask_prob: float = 0.15,
        num_workers: int = 0,
        seed: int = 0,
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__(block_size, batch_size, max_bytes, val_fraction, num_workers, seed,
                         global_batch_size)
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
