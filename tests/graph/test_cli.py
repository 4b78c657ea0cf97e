"""``python -m lightning_autopipe profile``: table on stdout, Profile JSON on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_autopipe import Profile, split_model
from lightning_autopipe.__main__ import main
from lightning_autopipe.graph.cli import profile_main
from lightning_autopipe.zoo.models import SmallCNN, build_model


def make_cnn() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """A ``module:factory`` for the CLI test."""
    return SmallCNN(widths=(4, 8)), (torch.randn(2, 3, 8, 8),)


def test_profile_command_writes_a_loadable_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    argv = ["--model", "tiny_gpt", "--size", "tiny", "--micro-batch-size", "2"]
    code = profile_main([*argv, "--out", str(out), "--warmup", "0", "--repeats", "1"])
    assert code == 0
    prof = Profile.load(out)
    model, example = build_model("tiny_gpt", "tiny", batch_size=2)
    blocks = split_model(model, example)
    assert prof.names == blocks.names
    assert prof.micro_batch_size == 2
    assert prof.fingerprint == blocks.fingerprint
    text = capsys.readouterr().out
    assert "fwd ms" in text
    assert "activation" in text
    for i, name in enumerate(blocks.names):
        assert any(line.split()[:2] == [str(i), name] for line in text.splitlines()), name
    # labelled as what was built: a toy size is never taken for the published model
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert prof.model == f"tiny_gpt toy-tiny ({millions:.2f}M params)"
    assert prof.model in text


def test_help_says_what_each_size_builds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        profile_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "small: 4 layers, d 128" in text
    assert "real: the published size (gpt2: GPT-2 124M" in text
    assert "xl (GPT-2 XL, 1.5B)" in text


def test_module_factory_and_layer_granularity_through_main(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    code = main(
        [
            "profile",
            "--model",
            f"{__name__}:make_cnn",
            "--granularity",
            "layer",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    prof = Profile.load(out)
    assert prof.names == split_model(*make_cnn(), granularity="layer").names
    assert prof.model == f"{__name__}:make_cnn"
    assert "layer" in capsys.readouterr().out


def test_unknown_model_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_main(["--model", "gpt5"]) == 1
    err = capsys.readouterr().err
    assert "unknown model 'gpt5'" in err
    assert "module:factory" in err


def test_module_entry_point_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "profile, plan" in capsys.readouterr().out
    assert main(["plna"]) == 2
    assert "unknown command 'plna'" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--device", "tpu"], "--device tpu:"),
    (["--device", "mps"], "the profiler times cpu and cuda devices only"),
    (["--out", "/nonexistent/folder/p.json"], "cannot write in /nonexistent/folder"),
])
def test_an_unusable_device_or_output_is_refused_before_measuring(args, says, capsys):
    assert profile_main(["--model", "gpt2", "--size", "tiny", *args]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_a_cuda_device_on_a_machine_without_one_is_refused(capsys):
    assert profile_main(["--model", "gpt2", "--size", "tiny", "--device", "cuda"]) == 2
    assert "no usable CUDA device" in capsys.readouterr().err
