"""``python -m lightning_autopipe profile``: split a model, profile its blocks, print and save."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from lightning_autopipe.errors import AutoPipeError

if TYPE_CHECKING:
    from lightning_autopipe.profile import Profile

__all__ = ["format_profile", "profile_main"]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - loop always returns


def format_profile(profile: Profile) -> str:
    """A per-block table of a :class:`~lightning_autopipe.profile.Profile`."""
    width = max(4, *(len(b.name) for b in profile.blocks))
    head = (
        f"{'#':>3}  {'block':<{width}}  {'fwd ms':>9}  {'bwd ms':>9}  {'params':>10}  "
        f"{'activation':>10}  {'memory':>10}"
    )
    lines = [head, "-" * len(head)]
    for i, b in enumerate(profile.blocks):
        lines.append(
            f"{i:>3}  {b.name:<{width}}  {b.forward_ms:>9.3f}  {b.backward_ms:>9.3f}  "
            f"{_bytes(b.param_bytes):>10}  {_bytes(b.activation_bytes):>10}  "
            f"{_bytes(b.memory_bytes):>10}"
        )
    lines.append("-" * len(head))
    total_fwd = sum(b.forward_ms for b in profile.blocks)
    total_bwd = sum(b.backward_ms for b in profile.blocks)
    params = sum(b.param_bytes for b in profile.blocks)
    memory = sum(b.memory_bytes for b in profile.blocks)
    lines.append(
        f"{'':>3}  {'total':<{width}}  {total_fwd:>9.3f}  {total_bwd:>9.3f}  "
        f"{_bytes(params):>10}  {'':>10}  {_bytes(memory):>10}"
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from lightning_autopipe.zoo.models import MODEL_NAMES

    p = argparse.ArgumentParser(
        prog="python -m lightning_autopipe profile",
        description="Split a model into blocks and measure each block's costs.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"one of {', '.join(MODEL_NAMES)}, or 'package.module:factory' returning "
        "(model, example_inputs)",
    )
    p.add_argument(
        "--size",
        default="small",
        help="tiny | small: toy sizes for tests and demos (gpt2 small: 4 layers, d 128); real: "
        "the published size (gpt2: GPT-2 124M, bert: BERT-base, torchvision models: 224x224 "
        "images, 1000 classes); gpt2 also has xl (GPT-2 XL, 1.5B), bert base and large",
    )
    p.add_argument("--granularity", default="sub-block", choices=["sub-block", "layer"])
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tracer", default="auto", choices=["auto", "fx", "export"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the profile JSON here")
    return p


_TOY_SIZES = ("tiny", "small")


def _label(name: str, size: str, model: Any) -> str:
    """The profile's model name: what was built, so a toy is never taken for the real model
    (``gpt2`` at ``--size small`` is a 4-layer toy, not GPT-2 small)."""
    if ":" in name:  # the user's own factory: its name says what it builds
        return name
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    kind = f"toy-{size}" if size in _TOY_SIZES else size
    return f"{name} {kind} ({millions:.2f}M params)"


def _unusable(args: argparse.Namespace) -> str | None:
    """What makes ``--device`` or ``--out`` unusable, or None."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        return f"--device {args.device}: {exc}; use cpu or cuda[:N]"
    if device.type == "cuda" and not torch.cuda.is_available():
        return (f"--device {args.device}: this machine has no usable CUDA device; profile "
                "on the GPU machine the plan is for, or pass --device cpu")
    if device.type not in ("cpu", "cuda"):
        return f"--device {args.device}: the profiler times cpu and cuda devices only"
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return (f"--out {args.out}: cannot write in {folder}; pass a path in a writable "
                    "folder")
    return None


def profile_main(argv: list[str]) -> int:
    """Entry point of ``python -m lightning_autopipe profile``; returns the exit status."""
    args = _parser().parse_args(argv)
    from lightning_autopipe.graph.blocks import split_model
    from lightning_autopipe.runtime.profiler import profile_blocks
    from lightning_autopipe.zoo.models import build_model

    problem = _unusable(args)
    if problem is not None:  # before minutes of measuring, not after
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        start = time.perf_counter()
        model, example = build_model(args.model, args.size, batch_size=args.micro_batch_size)
        blocks = split_model(model, example, granularity=args.granularity, tracer=args.tracer)
        split_s = time.perf_counter() - start
        profile = profile_blocks(
            blocks,
            example,
            device=args.device,
            warmup=args.warmup,
            repeats=args.repeats,
            model_name=_label(args.model, args.size, model),
        )
    except (AutoPipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"model {profile.model}: {len(blocks)} blocks ({args.granularity}, traced by "
        f"{blocks.tracer} in {split_s:.1f} s), micro-batch {profile.micro_batch_size}, "
        f"device {profile.device}, fingerprint {profile.fingerprint}"
    )
    print(format_profile(profile))
    if args.out:
        profile.save(args.out)
        print(f"wrote {args.out}")
    return 0
