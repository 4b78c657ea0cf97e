"""LightningModules for the recipes: causal LM (GPT), masked LM (BERT), image classification.

Every task follows the pipeline contract: ``forward`` is the part that is traced and split into
stages; ``pipeline_loss(outputs, batch)`` is the *mean* loss of one (slice of a) batch, so a
pipeline strategy that weights each slice's loss by its sample count reproduces whole-batch
training exactly; ``training_step`` is ``pipeline_loss(self(batch[0]), batch)``, so the same
task trains unchanged with ``strategy="auto"``.

The ``build_*`` functions are the ``_target_`` of the ``model/`` configs: they build the bare
network (random init, no downloads) from explicit architecture numbers, so every number can be
overridden from the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopipe.extras import import_extra
from lightning_autopipe.zoo.datasets import IGNORE_INDEX
from lightning_autopipe.zoo.hf import hf_bert, hf_gpt2
from lightning_autopipe.zoo.models import SmallCNN, TinyGPT

__all__ = [
    "CausalLMTask",
    "ImageClassificationTask",
    "MaskedLMTask",
    "build_bert",
    "build_gpt",
    "build_resnet",
]


# ---------------------------------------------------------------------------------- networks
class _LogitsOnly(nn.Module):
    """A Hugging Face model called with ``input_ids`` only, returning just the logits tensor.

    The pipeline contract wants tensors across stage boundaries; HF models return a
    ``ModelOutput`` with optional extras (caches, hidden states) that only get in the way.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits


def build_gpt(
    name: str,
    arch: str = "tiny",
    vocab_size: int = 264,
    max_seq_len: int = 128,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    dropout: float = 0.0,
    tie_embeddings: bool = True,
) -> nn.Module:
    """A decoder-only GPT: ``arch="tiny"`` is :class:`TinyGPT` (plain torch, torch.fx),
    ``arch="hf"`` is Hugging Face ``GPT2LMHeadModel`` built from a ``GPT2Config``.

    ``name`` only labels the model (plans and profiles carry it).
    """
    if arch == "tiny":
        return TinyGPT(
            vocab=vocab_size,
            seq_len=max_seq_len,
            d_model=n_embd,
            n_layers=n_layer,
            n_heads=n_head,
            tie_embeddings=tie_embeddings,
            dropout=dropout,
        )
    if arch == "hf":
        return _LogitsOnly(hf_gpt2(vocab_size, max_seq_len, n_embd, n_layer, n_head, dropout,
                                   tie_word_embeddings=tie_embeddings))
    raise ValueError(f"model {name!r}: unknown GPT arch {arch!r}; use 'tiny' or 'hf'")


def build_bert(
    name: str,
    vocab_size: int = 264,
    max_seq_len: int = 128,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    intermediate_size: int | None = None,
    dropout: float = 0.0,
) -> nn.Module:
    """Hugging Face ``BertForMaskedLM`` from a ``BertConfig`` (``intermediate_size`` default
    ``4 * n_embd``), called with ``input_ids`` only."""
    return _LogitsOnly(hf_bert(vocab_size, max_seq_len, n_embd, n_layer, n_head,
                               intermediate_size or 4 * n_embd, dropout))


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(min(32, channels), channels)


def build_resnet(
    name: str,
    arch: str = "small_cnn",
    num_classes: int = 10,
    in_channels: int = 3,
    widths: Sequence[int] = (16, 32, 64),
    blocks_per_stage: int = 1,
    norm: str = "batch",
    image_size: int | None = None,
) -> nn.Module:
    """A residual image classifier (``image_size`` is accepted for the config's sake: the
    networks pool globally and take any resolution).

    ``arch="small_cnn"`` is :class:`SmallCNN` (``widths``, ``blocks_per_stage``; ``norm`` is
    ``"batch"`` or ``"none"``); any other ``arch`` names a torchvision ResNet (``resnet18``,
    ``resnet50``, ``resnet152``…) whose ``norm`` is ``"batch"`` (torchvision's) or ``"group"``.
    Batch norm makes a sample's output depend on the rest of its micro-batch, so a pipeline's
    micro-batches train slightly differently from the whole batch; ``group`` / ``none`` do not.
    """
    if arch == "small_cnn":
        if norm not in ("batch", "none"):
            raise ValueError(
                f"model {name!r}: small_cnn norm must be 'batch' or 'none', not {norm!r}"
            )
        return SmallCNN(
            in_channels=in_channels,
            num_classes=num_classes,
            widths=tuple(widths),
            blocks_per_stage=blocks_per_stage,
            batch_norm=norm == "batch",
        )
    torchvision = import_extra("torchvision", "the torchvision model zoo")

    factory = getattr(torchvision.models, arch, None)
    if factory is None or not arch.startswith(("resnet", "resnext", "wide_resnet")):
        raise ValueError(
            f"model {name!r}: arch {arch!r} is neither 'small_cnn' nor a torchvision ResNet "
            "(resnet18, resnet34, resnet50, resnet101, resnet152, ...)"
        )
    if in_channels != 3:
        raise ValueError(
            f"model {name!r}: torchvision ResNets take 3 input channels, not {in_channels}"
        )
    if norm not in ("batch", "group"):
        raise ValueError(
            f"model {name!r}: torchvision norm must be 'batch' or 'group', not {norm!r}"
        )
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if norm == "group":
        kwargs["norm_layer"] = _group_norm
    return factory(**kwargs)


# ------------------------------------------------------------------------------------- tasks
class _PipelineTask(pl.LightningModule):
    """Shared plumbing: AdamW with linear warm-up, loss logging that works under any strategy.

    The train loss is logged from ``on_train_batch_end`` (the value the strategy's training step
    returned), not from ``training_step``: a pipeline strategy runs the schedule itself and never
    calls ``training_step``, but both strategies hand their loss to this hook.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float,
        warmup_steps: int,
        betas: Sequence[float],
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr={lr} must be > 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.betas = (float(betas[0]), float(betas[1]))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def pipeline_loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.log("train_loss", loss.detach().float(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        if not self.warmup_steps:
            return optimizer
        warmup = self.warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _TokenTask(_PipelineTask):
    """A task on ``[batch, seq_len]`` token ids; ``betas`` None means the task's own
    :attr:`default_betas`."""

    default_betas: tuple[float, float] = (0.9, 0.999)

    def __init__(
        self,
        model: nn.Module,
        seq_len: int,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        betas: Sequence[float] | None = None,
    ) -> None:
        # Resolved before save_hyperparameters, which reads this frame's locals: the hparams
        # (and so a checkpoint's) hold the betas in use, never None.
        if betas is None:
            betas = self.default_betas
        super().__init__(model, lr, weight_decay, warmup_steps, betas)
        self.save_hyperparameters(ignore=["model"])
        self.example_input_array = torch.zeros(2, seq_len, dtype=torch.long)


class CausalLMTask(_TokenTask):
    """Next-token prediction. Batches are ``(input_ids, targets)``, both ``[batch, seq_len]``."""

    default_betas = (0.9, 0.95)

    def pipeline_loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        """Mean cross-entropy over every token; all samples have the same length, so this is
        also the mean over samples of the per-sample mean."""
        targets = batch[1]
        return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


class MaskedLMTask(_TokenTask):
    """Masked-LM. Batches are ``(input_ids, labels)``, labels ``IGNORE_INDEX`` where unmasked."""

    default_betas = (0.9, 0.999)

    def pipeline_loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        """Mean over samples of each sample's mean loss on its masked positions.

        Averaging per sample first (rather than over all masked tokens of the batch) keeps the
        loss a plain mean over samples, which is what makes sliced micro-batches exact.
        """
        labels = batch[1]
        per_token = F.cross_entropy(
            outputs.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
        )
        counts = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        return (per_token.sum(dim=1) / counts).mean()


class ImageClassificationTask(_PipelineTask):
    """Classification. Batches are ``(images [batch, channels, size, size], labels [batch])``."""

    def __init__(
        self,
        model: nn.Module,
        image_size: int,
        channels: int = 3,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        betas: Sequence[float] = (0.9, 0.999),
    ) -> None:
        super().__init__(model, lr, weight_decay, warmup_steps, betas)
        self.save_hyperparameters(ignore=["model"])
        self.example_input_array = torch.zeros(2, channels, image_size, image_size)

    def pipeline_loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        accuracy = (logits.argmax(dim=-1) == batch[1]).float().mean()
        self.log("val_acc", accuracy, prog_bar=True, sync_dist=True)
        loss = self.pipeline_loss(logits, batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss
