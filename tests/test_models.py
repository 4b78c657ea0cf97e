"""Model zoo: the reference models behave as documented and every builder yields a runnable
(model, example_inputs) pair without downloads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopipe.zoo.models import MODEL_NAMES, SmallCNN, TinyGPT, build_model


def test_tiny_gpt_ties_embeddings_and_is_causal() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, seq_len=12, d_model=16, n_layers=2, n_heads=2)
    assert model.lm_head.weight is model.wte.weight
    assert TinyGPT(tie_embeddings=False).lm_head.weight is not TinyGPT().wte.weight
    ids = torch.randint(0, 50, (3, 12))
    logits = model(ids)
    assert logits.shape == (3, 12, 50)
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50  # later tokens must not affect earlier logits
    out = model(changed)
    torch.testing.assert_close(out[:, :8], logits[:, :8])
    assert not torch.allclose(out[:, 8:], logits[:, 8:])


def test_tiny_gpt_traces_with_fx_for_any_batch_and_shorter_sequences() -> None:
    model = TinyGPT()
    gm = torch.fx.symbolic_trace(model)
    for shape in [(2, 16), (5, 16), (1, 7)]:
        ids = torch.randint(0, 128, shape)
        torch.testing.assert_close(gm(ids), model(ids))


def test_small_cnn_has_batch_norm_only_on_request() -> None:
    plain = SmallCNN()
    with_bn = SmallCNN(batch_norm=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in with_bn.modules())
    x = torch.randn(2, 3, 32, 32)
    assert plain(x).shape == (2, 10)
    # without batch norm a sample's output does not depend on the rest of the batch
    torch.testing.assert_close(plain(x)[:1], plain(x[:1]))
    gm = torch.fx.symbolic_trace(with_bn.eval())
    torch.testing.assert_close(gm(x), with_bn(x))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_builtin_builds_and_runs(name: str) -> None:
    model, example = build_model(name, "tiny", batch_size=3)
    with torch.no_grad():
        out = model(**example) if isinstance(example, dict) else model(*example)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    assert logits.shape[0] == 3
    assert torch.isfinite(logits).all()
    dropouts = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    assert all(p == 0.0 for p in dropouts)  # tiny / small configs compare exactly


def test_hf_sizes_follow_the_brief() -> None:
    tiny, _ = build_model("gpt2", "tiny")
    small, example = build_model("gpt2", "small")
    assert (tiny.config.n_layer, tiny.config.n_embd) == (2, 64)
    assert (small.config.n_layer, small.config.n_embd) == (4, 128)
    assert example["input_ids"].max() < small.config.vocab_size
    bert, example = build_model("bert", "tiny")
    assert set(example) == {"input_ids", "attention_mask"}
    assert bert.config.num_hidden_layers == 2


def test_factory_spec_and_bad_names() -> None:
    model, example = build_model("tests.graph.test_cli:make_cnn")
    assert isinstance(model, SmallCNN)
    assert example[0].shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match="unknown model 'resnet9'"):
        build_model("resnet9")
    with pytest.raises(ValueError, match="has no size 'huge'"):
        build_model("gpt2", "huge")
    with pytest.raises(ValueError, match="cannot import model factory"):
        build_model("no_such_module:f")
