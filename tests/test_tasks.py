"""Tasks: the pipeline loss contract (sliced = whole batch), training_step, model builders."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lightning_autopipe.zoo.datasets import IGNORE_INDEX, MaskedLMDataset, load_stdlib_tokens
from lightning_autopipe.zoo.tasks import (
    CausalLMTask,
    ImageClassificationTask,
    MaskedLMTask,
    build_bert,
    build_gpt,
    build_resnet,
)


def _gpt_task():
    torch.manual_seed(0)
    net = build_gpt("t", arch="tiny", vocab_size=264, max_seq_len=16, n_layer=2, n_embd=32)
    tokens = torch.randint(0, 256, (6, 17))
    return CausalLMTask(net, seq_len=16), (tokens[:, :-1], tokens[:, 1:])


def _bert_task():
    torch.manual_seed(0)
    net = build_bert("b", vocab_size=264, max_seq_len=16, n_layer=1, n_embd=32, n_head=2)
    ds = MaskedLMDataset(load_stdlib_tokens(20_000), block_size=16, mask_prob=0.15)
    samples = [ds[i] for i in range(6)]
    batch = (torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))
    return MaskedLMTask(net, seq_len=16), batch


def _image_task():
    torch.manual_seed(0)
    net = build_resnet("r", arch="small_cnn", num_classes=5, widths=[8, 16], norm="none")
    return ImageClassificationTask(net, image_size=8), (
        torch.randn(6, 3, 8, 8),
        torch.randint(0, 5, (6,)),
    )


@pytest.mark.parametrize("make", [_gpt_task, _bert_task, _image_task])
def test_sliced_losses_weighted_by_samples_equal_the_whole_batch(make):
    """What a pipeline does (slices of 1, 2, 3 samples, each loss x its share) reproduces the
    whole-batch loss and gradients: the contract that keeps strategies interchangeable."""
    task, batch = make()
    task.eval()  # dropout is off in these configs anyway; keep it deterministic
    whole = task.training_step(batch, 0)
    whole.backward()
    ref = {n: p.grad.clone() for n, p in task.named_parameters() if p.grad is not None}
    task.zero_grad()
    total = torch.zeros(())
    for lo, hi in ((0, 1), (1, 3), (3, 6)):
        part = tuple(t[lo:hi] for t in batch)
        loss = task.pipeline_loss(task(part[0]), part) * (hi - lo) / 6
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-5, atol=1e-6)
    for name, p in task.named_parameters():
        if name in ref:
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-6)


def test_losses_match_their_definitions():
    task, (x, y) = _gpt_task()
    logits = task(x)
    ref = torch.stack([F.cross_entropy(logits[i], y[i]) for i in range(len(x))]).mean()
    torch.testing.assert_close(task.pipeline_loss(logits, (x, y)), ref)

    task, (inputs, labels) = _bert_task()
    logits = task(inputs)
    per_sample = []
    for i in range(len(inputs)):
        sel = labels[i] != IGNORE_INDEX
        per_sample.append(F.cross_entropy(logits[i][sel], labels[i][sel]))
    ref = torch.stack(per_sample).mean()
    torch.testing.assert_close(task.pipeline_loss(logits, (inputs, labels)), ref)


def test_training_step_is_pipeline_loss_of_forward():
    task, batch = _image_task()
    torch.testing.assert_close(
        task.training_step(batch, 0), F.cross_entropy(task.model(batch[0]), batch[1])
    )
    assert task.example_input_array.shape == (2, 3, 8, 8)


def test_hf_gpt_matches_the_published_gpt2_size_on_meta():
    with torch.device("meta"):
        net = build_gpt("gpt2", arch="hf", vocab_size=50257, max_seq_len=1024, n_layer=12,
                        n_embd=768, n_head=12)
    # GPT-2 small: 124,439,808 parameters (tied embedding counted once).
    assert sum(p.numel() for p in net.parameters()) == 124_439_808


def test_builders_shapes_and_errors():
    gpt = build_gpt("g", arch="hf", vocab_size=264, max_seq_len=16, n_layer=1, n_embd=32)
    assert gpt(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 264)
    bert = build_bert("b", vocab_size=264, max_seq_len=16, n_layer=1, n_embd=32)
    assert bert(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 264)
    resnet = build_resnet("r18", arch="resnet18", num_classes=7, norm="group")
    assert resnet(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules())
    with pytest.raises(ValueError, match="unknown GPT arch 'llama'"):
        build_gpt("g", arch="llama")
    with pytest.raises(ValueError, match="'vgg16' is neither"):
        build_resnet("v", arch="vgg16")
    with pytest.raises(ValueError, match="lr=0"):
        CausalLMTask(gpt, seq_len=16, lr=0)


@pytest.mark.parametrize(("make", "betas"), [(_gpt_task, (0.9, 0.95)), (_bert_task, (0.9, 0.999))])
def test_each_token_task_keeps_its_default_betas_through_a_checkpoint(make, betas, tmp_path):
    """The default betas are the task's own (GPT 0.95, BERT 0.999), in ``hparams`` as used,
    so a checkpoint's hyperparameters rebuild the same optimizer; given betas stay as given."""
    import lightning.pytorch as pl

    task, _ = make()
    assert task.betas == betas
    assert task.hparams["betas"] == betas
    assert task.configure_optimizers().defaults["betas"] == betas
    path = tmp_path / "task.ckpt"
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                "pytorch-lightning_version": pl.__version__}, path)
    loaded = type(task).load_from_checkpoint(path, model=task.model, weights_only=True)
    assert loaded.betas == betas
    assert dict(loaded.hparams) == dict(task.hparams)
    assert type(task)(task.model, seq_len=16, betas=[0.8, 0.9]).hparams["betas"] == [0.8, 0.9]
