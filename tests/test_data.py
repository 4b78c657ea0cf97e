"""Datasets and data modules: stdlib corpus, causal / masked LM samples, synthetic images."""

from __future__ import annotations

import pytest
import torch

from lightning_autopipe.errors import InputError
from lightning_autopipe.zoo.data import (
    StdlibMLMDataModule,
    StdlibTextDataModule,
    SyntheticImageDataModule,
)
from lightning_autopipe.zoo.datasets import (
    EOS,
    IGNORE_INDEX,
    MASK,
    VOCAB_SIZE,
    CausalLMDataset,
    MaskedLMDataset,
    SyntheticImages,
    decode,
    encode,
    load_stdlib_tokens,
)


def test_stdlib_tokens_follow_sorted_files_and_skip_tests(tmp_path):
    (tmp_path / "b.py").write_text("bb")
    (tmp_path / "a.py").write_text("aé")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_text("c")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("skipped")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "s.py").write_text("skipped")
    (tmp_path / "notes.txt").write_text("not python")
    tokens = load_stdlib_tokens(max_bytes=4096, root=tmp_path)
    assert decode(tokens) == "aé<eos>bb<eos>c<eos>"
    assert load_stdlib_tokens(max_bytes=1024, root=tmp_path).numel() == tokens.numel()


def test_real_stdlib_is_capped_deterministic_and_in_vocab():
    a = load_stdlib_tokens(max_bytes=50_000)
    b = load_stdlib_tokens(max_bytes=50_000)
    assert a.numel() == 50_000
    assert torch.equal(a, b)
    assert int(a.max()) < VOCAB_SIZE
    assert int(a.min()) >= 0
    assert (a == EOS).any()  # several files, separated
    assert "def " in decode(a)


def test_encode_decode_round_trip():
    text = "print('héllo')\n"
    assert decode(encode(text)) == text
    assert decode([104, EOS, MASK, 105]) == "h<eos><mask>i"


def test_causal_samples_are_shifted_contiguous_blocks():
    tokens = torch.arange(0, 101, dtype=torch.int16) % 250
    ds = CausalLMDataset(tokens, block_size=10)
    assert len(ds) == 10
    for i in range(len(ds)):
        x, y = ds[i]
        ref = tokens[i * 10 : i * 10 + 11].long()
        assert torch.equal(x, ref[:-1])
        assert torch.equal(y, ref[1:])


def test_masked_lm_masking_rates_and_labels():
    tokens = load_stdlib_tokens(max_bytes=200_000)
    ds = MaskedLMDataset(tokens, block_size=64, mask_prob=0.15, seed=3)
    chosen = masked = swapped = kept = 0
    for i in range(1000):
        inputs, labels = ds[i]
        original = tokens[i * 64 : (i + 1) * 64].long()
        sel = labels != IGNORE_INDEX
        assert sel.any()
        assert torch.equal(labels[sel], original[sel])
        assert torch.equal(inputs[~sel], original[~sel])  # unchosen positions are untouched
        chosen += int(sel.sum())
        masked += int((inputs[sel] == MASK).sum())
        kept += int((inputs[sel] == original[sel]).sum())
        swapped += int(((inputs[sel] != MASK) & (inputs[sel] != original[sel])).sum())
    total = 1000 * 64
    assert abs(chosen / total - 0.15) < 0.01
    assert abs(masked / chosen - 0.8) < 0.02
    # A random byte can equal the original, so "kept" is slightly above 10%.
    assert abs(kept / chosen - 0.1) < 0.02
    assert abs(swapped / chosen - 0.1) < 0.02
    a, b = ds[5], ds[5]
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])


def test_synthetic_images_are_learnable_by_nearest_prototype():
    ds = SyntheticImages(num_samples=300, num_classes=10, image_size=16, noise=0.5, seed=1)
    protos = ds.prototypes.flatten(1)
    protos = protos / protos.norm(dim=1, keepdim=True)
    correct = 0
    for i in range(len(ds)):
        image, label = ds[i]
        correct += int((protos @ image.flatten()).argmax() == label)
    assert correct / len(ds) > 0.9
    labels = [int(ds[i][1]) for i in range(len(ds))]
    assert len(set(labels)) == 10
    assert torch.equal(ds[7][0], SyntheticImages(300, 10, 16, noise=0.5, seed=1)[7][0])


def test_datamodules_give_fixed_size_batches_and_held_out_data():
    dm = StdlibTextDataModule(block_size=32, batch_size=4, max_bytes=20_000)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == torch.long
    assert all(b[0].shape[0] == 4 for b in dm.train_dataloader())  # drop_last
    train_end = len(dm.train_set) * 32
    assert torch.equal(dm.val_set.tokens, load_stdlib_tokens(20_000)[train_end:])
    assert len(dm.val_dataloader()) >= 1

    mlm = StdlibMLMDataModule(block_size=32, batch_size=4, max_bytes=20_000)
    mlm.setup()
    inputs, labels = next(iter(mlm.val_dataloader()))
    assert inputs.shape == labels.shape == (4, 32)

    images = SyntheticImageDataModule(num_classes=3, image_size=8, num_samples=40, batch_size=8)
    images.setup()
    img, lab = next(iter(images.train_dataloader()))
    assert img.shape == (8, 3, 8, 8)
    assert lab.shape == (8,)
    assert not torch.equal(images.val_set[0][0], images.train_set[0][0])


def test_training_order_is_what_a_one_replica_distributed_sampler_gives(monkeypatch):
    """So ``strategy="auto"`` sees the batches Lightning's DistributedSampler hands a replica."""
    from torch.utils.data import DistributedSampler

    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dm = StdlibTextDataModule(block_size=32, batch_size=4, max_bytes=20_000)
    loader = dm.train_dataloader()
    reference = DistributedSampler(dm.train_set, num_replicas=1, rank=0, shuffle=True, seed=7)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert list(loader.sampler) == list(reference)
    x, _ = next(iter(loader))
    assert torch.equal(x[1], dm.train_set[list(reference)[1]][0])


def test_bad_sizes_are_input_errors_naming_the_value(tmp_path):
    tokens = torch.arange(64) % VOCAB_SIZE
    with pytest.raises(InputError, match="block_size=1 must be >= 2"):
        CausalLMDataset(tokens, block_size=1)
    with pytest.raises(InputError, match=r"mask_prob=1\.5 must lie in \(0, 1\)"):
        MaskedLMDataset(tokens, block_size=8, mask_prob=1.5)
    with pytest.raises(InputError, match="max_bytes=10 is too small"):
        load_stdlib_tokens(max_bytes=10)
    with pytest.raises(InputError, match="no .py files under .*pass root="):
        load_stdlib_tokens(root=tmp_path)
