"""Samples that ship on every machine: the standard library as byte tokens, synthetic images.

The recipes must train a real model on a fresh machine with no network, so the text corpus is
the interpreter's own standard library source (``sysconfig.get_paths()["stdlib"]``), read in a
fixed file order up to a byte cap and tokenised at the byte level (256 byte values plus a few
specials). Every sample is a pure function of its index and the seed, so two runs, two
launchers or two strategies see exactly the same batches. Plain torch datasets; the Lightning
data modules over them are :mod:`~lightning_autopipe.zoo.data`.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_autopipe.errors import InputError

__all__ = [
    "EOS",
    "IGNORE_INDEX",
    "MASK",
    "VOCAB_SIZE",
    "CausalLMDataset",
    "MaskedLMDataset",
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
        InputError: ``max_bytes`` is too small or the directory has no ``.py`` files.
    """
    if max_bytes < 1024:
        raise InputError(f"max_bytes={max_bytes} is too small for a corpus; use >= 1024")
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
        raise InputError(f"no .py files under {base}; pass root= pointing at Python sources")
    return torch.cat(chunks)[:max_bytes]


class CausalLMDataset(Dataset):
    """Fixed-length next-token samples ``(x, y)``: ``y`` is ``x`` shifted left by one token."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 2:
            raise InputError(f"block_size={block_size} must be >= 2")
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
            raise InputError(f"mask_prob={mask_prob} must lie in (0, 1)")
        if block_size < 2:
            raise InputError(f"block_size={block_size} must be >= 2")
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
            raise InputError(
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
