"""Hugging Face GPT-2 and BERT of given sizes, built once for the zoo, the recipes and tests.

The zoo's named models (:func:`~lightning_autopipe.zoo.models.build_model`) and the recipes'
model configs (:mod:`~lightning_autopipe.zoo.tasks`) size the same two networks from
different tables; the configuration of each is written here only. Random initialisation, no
downloads; ``transformers`` comes with the ``recipes`` extra.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_autopipe.extras import import_extra

__all__ = ["hf_bert", "hf_gpt2"]


def hf_gpt2(
    vocab_size: int, n_positions: int, n_embd: int, n_layer: int, n_head: int, dropout: float,
    **config: Any,
) -> nn.Module:
    """Hugging Face ``GPT2LMHeadModel`` of these sizes (random init, no key/value cache),
    ``dropout`` on the residual, embedding and attention paths alike.

    The zoo's ``gpt2`` and the recipes' ``arch: hf`` GPT both build it here; ``config`` holds
    the further ``GPT2Config`` fields either one sets.
    """
    hf = import_extra("transformers", "Hugging Face models")
    return hf.GPT2LMHeadModel(hf.GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        **config,
    ))


def hf_bert(
    vocab_size: int, max_positions: int, n_embd: int, n_layer: int, n_head: int,
    intermediate_size: int, dropout: float,
) -> nn.Module:
    """Hugging Face ``BertForMaskedLM`` of these sizes (random init), ``dropout`` on the
    hidden and attention paths alike: the zoo's ``bert``, the recipes' BERT and the tests'."""
    hf = import_extra("transformers", "Hugging Face models")
    return hf.BertForMaskedLM(hf.BertConfig(
        vocab_size=vocab_size,
        hidden_size=n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    ))
