"""Model zoo: small reference models and builders for torchvision / Hugging Face models.

Everything here is built from configs with random initialisation (no downloads), so the CLI,
tests and benchmarks can profile and train a model on any machine.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopipe.extras import import_extra
from lightning_autopipe.zoo.hf import hf_bert, hf_gpt2

__all__ = ["MODEL_NAMES", "SmallCNN", "TinyGPT", "build_model"]


# ------------------------------------------------------------------------------------ TinyGPT
class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)
        # A buffer, not a Python-level mask, so torch.fx sees it as a get_attr and the causal
        # structure needs no data-dependent control flow.
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, seq_len, seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # torch.narrow (not slicing) so fx records the length as a traced value.
        mask = torch.narrow(torch.narrow(self.mask, 2, 0, t), 3, 0, t)
        att = att.masked_fill(~mask, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class _MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class _GPTBlock(nn.Module):
    """Pre-LN transformer layer: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_heads, seq_len, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = _MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A small decoder-only GPT in plain torch, traceable by ``torch.fx.symbolic_trace``.

    With ``tie_embeddings`` the output projection's weight *is* the token embedding's weight
    (one Parameter), which is the case the stage splitter's tie groups exist for.
    """

    def __init__(
        self,
        vocab: int = 128,
        seq_len: int = 16,
        d_model: int = 32,
        n_layers: int = 2,
        n_heads: int = 2,
        tie_embeddings: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(
            _GPTBlock(d_model, n_heads, seq_len, dropout) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("pos", torch.arange(seq_len), persistent=False)
        self.apply(self._init_weights)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.size(1)
        x = self.drop(self.wte(input_ids) + self.wpe(torch.narrow(self.pos, 0, 0, t)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------------------- SmallCNN
class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, batch_norm: bool) -> None:
        super().__init__()
        norm = nn.BatchNorm2d if batch_norm else (lambda c: nn.Identity())
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=not batch_norm)
        self.bn1 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=not batch_norm)
        self.bn2 = norm(c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=not batch_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class SmallCNN(nn.Module):
    """A ResNet-style CNN: conv stem, residual stages, global pooling, linear head.

    ``batch_norm=False`` (default) gives a model whose output for a sample does not depend on
    the rest of the batch, so micro-batched pipelines reproduce whole-batch gradients exactly.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 1,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=not batch_norm),
            nn.BatchNorm2d(widths[0]) if batch_norm else nn.Identity(),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        c_in = widths[0]
        for s, width in enumerate(widths):
            for b in range(blocks_per_stage):
                stride = 2 if (s > 0 and b == 0) else 1
                layers.append(_BasicBlock(c_in, width, stride, batch_norm))
                c_in = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(images))
        return self.fc(torch.flatten(self.pool(x), 1))


# ---------------------------------------------------------------------------------- builders
Inputs = tuple[Any, ...] | dict[str, Any]


def _tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _images(batch: int, size: int, channels: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, channels, size, size, generator=g)


def _sizes(name: str, size: str, table: dict[str, Any]) -> Any:
    if size not in table:
        raise ValueError(f"model {name!r} has no size {size!r}; choose one of {sorted(table)}")
    return table[size]


def _tiny_gpt(size: str, batch: int) -> tuple[nn.Module, Inputs]:
    vocab, seq, d, layers, heads = _sizes(
        "tiny_gpt",
        size,
        {
            "tiny": (128, 16, 32, 2, 2),
            "small": (512, 64, 128, 4, 4),
            "real": (512, 128, 256, 8, 8),
        },
    )
    model = TinyGPT(vocab=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=heads)
    return model, (_tokens(batch, seq, vocab),)


def _small_cnn(size: str, batch: int, batch_norm: bool = False) -> tuple[nn.Module, Inputs]:
    widths, per_stage, image = _sizes(
        "small_cnn",
        size,
        {"tiny": ((8, 16), 1, 16), "small": ((16, 32, 64), 1, 32), "real": ((64, 128, 256), 2, 64)},
    )
    model = SmallCNN(widths=widths, blocks_per_stage=per_stage, batch_norm=batch_norm)
    return model, (_images(batch, image),)


def _resnet(name: str, size: str, batch: int) -> tuple[nn.Module, Inputs]:
    torchvision = import_extra("torchvision", "the torchvision model zoo")

    image = _sizes(name, size, {"tiny": 32, "small": 64, "real": 224})
    classes = 10 if size != "real" else 1000
    model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
    return model, (_images(batch, image),)


def _vit(size: str, batch: int) -> tuple[nn.Module, Inputs]:
    VisionTransformer = import_extra(
        "torchvision.models.vision_transformer", "the torchvision model zoo"
    ).VisionTransformer

    # (image, patch, layers, heads, hidden, mlp); "real" is ViT-B/16 itself.
    image, patch, layers, heads, hidden, mlp = _sizes(
        "vit_b_16",
        size,
        {
            "tiny": (32, 16, 2, 2, 32, 64),
            "small": (64, 16, 4, 4, 128, 256),
            "real": (224, 16, 12, 12, 768, 3072),
        },
    )
    model = VisionTransformer(
        image_size=image,
        patch_size=patch,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        mlp_dim=mlp,
        num_classes=10 if size != "real" else 1000,
    )
    return model, (_images(batch, image),)


def _gpt2(size: str, batch: int) -> tuple[nn.Module, Inputs]:
    # (vocab, positions, layers, d, heads, example seq); xl is 1.5B: built only on request.
    vocab, positions, layers, d, heads, seq = _sizes(
        "gpt2",
        size,
        {
            "tiny": (256, 16, 2, 64, 2, 16),
            "small": (1024, 64, 4, 128, 4, 64),
            "real": (50257, 1024, 12, 768, 12, 128),
            "xl": (50257, 1024, 48, 1600, 25, 128),
        },
    )
    drop = 0.0 if size in ("tiny", "small") else 0.1
    model = hf_gpt2(vocab, positions, d, layers, heads, drop,
                    bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    return model, {"input_ids": _tokens(batch, seq, vocab)}


def _bert(size: str, batch: int) -> tuple[nn.Module, Inputs]:
    vocab, layers, d, heads, seq = _sizes(
        "bert",
        size,
        {
            "tiny": (256, 2, 64, 2, 16),
            "small": (1024, 4, 128, 4, 64),
            "base": (30522, 12, 768, 12, 128),
            "real": (30522, 12, 768, 12, 128),
            "large": (30522, 24, 1024, 16, 128),
        },
    )
    drop = 0.0 if size in ("tiny", "small") else 0.1
    model = hf_bert(vocab, max(seq, 64), d, layers, heads, 4 * d, drop)
    ids = _tokens(batch, seq, vocab)
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0  # some padding, so the attention mask path is exercised
    return model, {"input_ids": ids, "attention_mask": mask}


_BUILDERS: dict[str, Callable[[str, int], tuple[nn.Module, Inputs]]] = {
    "tiny_gpt": _tiny_gpt,
    "small_cnn": _small_cnn,
    "small_cnn_bn": lambda size, batch: _small_cnn(size, batch, batch_norm=True),
    "resnet18": lambda size, batch: _resnet("resnet18", size, batch),
    "resnet50": lambda size, batch: _resnet("resnet50", size, batch),
    "resnet152": lambda size, batch: _resnet("resnet152", size, batch),
    "vit_b_16": _vit,
    "gpt2": _gpt2,
    "bert": _bert,
}
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def _from_factory(spec: str, size: str, batch: int) -> tuple[nn.Module, Inputs]:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import model factory {spec!r}: {exc}") from exc
    made = factory()
    if isinstance(made, nn.Module):
        example = getattr(made, "example_inputs", None)
        if example is None:
            raise ValueError(
                f"factory {spec!r} returned a model without example inputs; return "
                "(model, example_inputs) or set model.example_inputs"
            )
        return made, example
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return made[0], made[1]
    raise ValueError(
        f"factory {spec!r} returned {type(made).__name__}; expected (model, example_inputs)"
    )


def build_model(name: str, size: str = "tiny", batch_size: int = 2) -> tuple[nn.Module, Inputs]:
    """Build a randomly initialised model and example inputs of ``batch_size`` samples.

    Args:
        name: one of :data:`MODEL_NAMES`, or ``"package.module:factory"`` naming a callable that
            returns ``(model, example_inputs)`` (or a model with an ``example_inputs`` attribute).
        size: ``tiny`` / ``small`` for tests and demos (dropout off), ``real`` for the published
            sizes (``gpt2`` also has ``xl``; ``bert`` has ``base`` / ``large`` instead of real).
        batch_size: number of samples in the example inputs.

    Returns:
        ``(model, example_inputs)``; example inputs are a tuple of positional tensors or a dict
        of keyword tensors, the form ``split_model`` takes.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if ":" in name:
        return _from_factory(name, size, batch_size)
    if name not in _BUILDERS:
        raise ValueError(
            f"unknown model {name!r}; choose one of {list(MODEL_NAMES)} or pass 'module:factory'"
        )
    torch.manual_seed(0)
    return _BUILDERS[name](size, batch_size)
