"""Tiny models, data and losses shared by the Lightning launch script and its reference.

No Lightning import here: the pytest process computes the single-process reference with plain
torch from the same seeds and the same per-replica batches the DistributedSampler hands out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopipe.zoo.hf import hf_bert
from lightning_autopipe.zoo.models import SmallCNN, TinyGPT

REPLICA_BATCH = 8  # the dataloader batch: one data-parallel replica's batch
STEPS = 3
VAL_BATCHES = 2
LR = 0.1
VOCAB, SEQ = 32, 8
#: ``gptvocab``: the test GPT with a vocabulary wide beside its width, whose last stage's
#: activations are mostly the loss's log-probabilities (the size of the logits)
WIDE_VOCAB = 512


def build_net(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model in ("gpt", "gptvocab"):
        vocab = WIDE_VOCAB if model == "gptvocab" else VOCAB
        return TinyGPT(vocab=vocab, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2)
    if model == "hfgpt":  # Hugging Face GPT-2 (tied embeddings), traced with torch.export
        from lightning_autopipe.zoo.tasks import build_gpt

        return build_gpt("hfgpt", arch="hf", vocab_size=VOCAB, max_seq_len=SEQ, n_embd=16)
    if model in ("cnn", "cnn_bn"):
        return SmallCNN(widths=(4, 8), blocks_per_stage=1, batch_norm=model == "cnn_bn")
    if model == "hfllama":  # rotary positions, grouped-query attention; its attention makes
        # an empty tensor per call, which torch.export lifts out of the forward as a constant
        from transformers import LlamaConfig, LlamaForCausalLM

        return _Logits(LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=SEQ)))
    if model == "cnnaux":
        return _AuxCNN()
    if model == "hfresnet":  # Hugging Face ResNet: BatchNorm, image inputs, traced by export
        from transformers import ResNetConfig, ResNetForImageClassification

        return _Pixels(ResNetForImageClassification(ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
            num_labels=10)))
    if model == "hfbert":  # Hugging Face BERT called with a padding mask: two inputs
        return _MaskedBert(hf_bert(VOCAB, SEQ, 16, 2, 2, intermediate_size=32, dropout=0.0))
    if model == "hfalbert":  # one layer's weights applied at every depth: the calls are blocks
        from transformers import AlbertConfig, AlbertForMaskedLM

        return _Logits(AlbertForMaskedLM(AlbertConfig(
            vocab_size=VOCAB, embedding_size=8, hidden_size=16, num_hidden_layers=4,
            num_attention_heads=2, intermediate_size=32, max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0)))
    raise ValueError(model)


class _Logits(nn.Module):
    """A Hugging Face language model as ``input_ids -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class _Pixels(_Logits):
    """A Hugging Face image classifier as ``pixel_values -> logits``."""

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


class Heads(NamedTuple):
    logits: torch.Tensor
    aux: torch.Tensor


class _AuxCNN(nn.Module):
    """A CNN returning a named tuple with an auxiliary head that the loss leaves out, as
    torchvision's GoogLeNet and Inception do in training: torch.fx traces the tuple's
    construction, so the last stage returns the tuple itself, not its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = SmallCNN(widths=(4, 8), blocks_per_stage=1)
        self.aux = nn.Linear(8, 3)

    def forward(self, images: torch.Tensor) -> Heads:
        c = self.cnn
        pooled = torch.flatten(c.pool(c.layers(c.stem(images))), 1)
        return Heads(c.fc(pooled), self.aux(pooled))


class _MaskedBert(nn.Module):
    """``BertForMaskedLM`` as ``(input_ids, attention_mask) -> logits``."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).logits


def dataset(model: str, num: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The model's inputs, then its targets (last)."""
    g = torch.Generator().manual_seed(seed)
    if model in ("gpt", "hfgpt", "gptvocab", "hfalbert", "hfllama"):
        vocab = WIDE_VOCAB if model == "gptvocab" else VOCAB
        tokens = torch.randint(0, vocab, (num, SEQ + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if model == "hfbert":  # 0-3 padded positions per sample: the mask differs between samples
        ids = torch.randint(0, VOCAB, (num, SEQ), generator=g)
        pad = torch.randint(0, 4, (num, 1), generator=g)
        mask = (torch.arange(SEQ) < SEQ - pad).long()
        return ids, mask, torch.randint(0, VOCAB, (num, SEQ), generator=g)
    return torch.randn(num, 3, 8, 8, generator=g), torch.randint(0, 10, (num,), generator=g)


def loss_fn(outputs: torch.Tensor | Heads, batch) -> torch.Tensor:
    targets = batch[-1]
    if isinstance(outputs, Heads):
        outputs = outputs.logits
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


class PipelineNet(nn.Module):
    """``build_net(model)`` with :func:`loss_fn` as its ``pipeline_loss``: what the runtime
    builds a pipeline of, without Lightning."""

    def __init__(self, model: str = "gpt") -> None:
        super().__init__()
        self.net = build_net(model)

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, outputs, batch):
        return loss_fn(outputs, batch)


def replica_indices(num: int, replicas: int, replica: int, shuffle: bool) -> list[int]:
    """What Lightning's DistributedSampler gives ``replica`` in epoch 0.

    Lightning shuffles every training loader it wraps (seed ``PL_GLOBAL_SEED``, unset: 0) and
    keeps validation loaders in order.
    """
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(
        range(num), num_replicas=replicas, rank=replica, shuffle=shuffle, seed=0
    )
    return list(sampler)


def unit_slices(batch: int, m: int, k: int, j: int = 1) -> list[tuple[int, int]]:
    """Contiguous even micro-batches, micro-batch 0 cut into k even slices and, with two or more
    micro-batches, the last into j (the contract)."""
    sizes = [batch // m + (1 if i < batch % m else 0) for i in range(m)]
    out, start = [], 0
    for mb, size in enumerate(sizes):
        n = k if mb == 0 else (j if mb == m - 1 else 1)
        parts = [size // n + (1 if i < size % n else 0) for i in range(n)]
        for p in parts:
            out.append((start, start + p))
            start += p
    return out
