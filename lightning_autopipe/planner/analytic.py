"""Profiles computed from FLOPs and bytes, for planning models on hardware you do not have.

A measured :class:`~lightning_autopipe.profile.Profile` is always better; this module exists so a
plan for GPT-2 XL on a 16-GPU cluster can be made (and the planner benchmarked) on a laptop.

Assumptions (stated once, used everywhere below):

* Time is FLOPs / (``device_tflops`` x ``efficiency``); a matrix multiply of ``(n, k) @ (k, p)``
  costs ``2 n k p`` FLOPs; backward costs ``backward_factor`` (default 2) x forward. Element-wise
  work (softmax, layer norm, GELU, residual adds, batch norm, ReLU) is ignored for time.
* Transformers (``"gpt"``, ``"bert"``) follow Narayanan et al. (SC'21): per layer and token the
  attention half costs ``8 h^2 + 4 s h`` forward FLOPs (Q/K/V/output projections plus the two
  ``s x s`` products) and the MLP half ``16 h^2`` (``h -> 4h -> h``); the head costs ``2 h V``
  (plus ``2 h^2`` for BERT's MLM transform). A training step is therefore
  ``72 B s L h^2 (1 + s / (6 h) + V / (12 h L))`` FLOPs. The embedding lookup costs no FLOPs;
  GPT's output projection is tied to the token embedding, whose bytes are counted in both the
  embedding and the head block (the two owning stages each keep a copy).
* Activation memory held for backward follows Korthikanti et al. (2022), 16-bit activations, no
  recomputation: ``11 s b h + 5 a s^2 b`` bytes for attention (+ ``2 s b h`` for its layer norm)
  and ``19 s b h`` for the MLP (+ ``2 s b h``); the head holds the logits in 32-bit.
* ResNet-152 (``"resnet"``): torchvision's v1.5 bottlenecks at ``image_size`` (stride in the 3x3
  convolution); each convolution ``2 H W C_in C_out k^2`` FLOPs; the stored activations are each
  convolution's output three times over (conv, batch norm, ReLU) in 16-bit.
* Parameters are ``param_dtype_bytes`` (default 4, fp32 master weights) each; the values crossing a
  cut (``activation_bytes``) are ``act_dtype_bytes`` (default 2) each.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autopipe.errors import PlanError
from lightning_autopipe.profile import BlockProfile, Profile

__all__ = ["analytic_profile", "transformer_step_flops", "AnalyticBlock"]

_RESNET_DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclass(frozen=True)
class AnalyticBlock:
    """One block's forward FLOPs and bytes for ONE sample, before conversion to a Profile."""

    name: str
    forward_flops: float
    params: int
    activation_elems: int
    memory_bytes: int


def transformer_step_flops(layers: int, hidden: int, seq_len: int, vocab: int, batch: int) -> float:
    """Forward + backward FLOPs of one GPT step (Narayanan et al. 2021, no recomputation)."""
    h, s, lay = hidden, seq_len, layers
    return 72.0 * batch * s * lay * h * h * (1 + s / (6 * h) + vocab / (12 * h * lay))


def _transformer_blocks(
    kind: str, layers: int, hidden: int, heads: int, seq_len: int, vocab: int
) -> list[AnalyticBlock]:
    h, s, a = hidden, seq_len, heads
    tokens_state = s * h  # one hidden-state tensor of one sample
    prefix = "transformer" if kind == "gpt" else "bert"
    emb_params = vocab * h + s * h + (2 * h if kind == "bert" else 0) + (2 * h)  # + LN / types
    blocks = [AnalyticBlock(f"{prefix}.{'wte' if kind == 'gpt' else 'embeddings'}", 0.0,
                            emb_params, tokens_state, 3 * tokens_state)]
    for i in range(layers):
        name = f"{prefix}.h.{i}" if kind == "gpt" else f"{prefix}.encoder.layer.{i}"
        attn_params = 4 * h * h + 4 * h + 2 * h
        mlp_params = 8 * h * h + 5 * h + 2 * h
        blocks.append(AnalyticBlock(
            f"{name}.attn" if kind == "gpt" else f"{name}.attention",
            s * (8 * h * h + 4 * s * h), attn_params, tokens_state,
            13 * tokens_state + 5 * a * s * s,
        ))
        blocks.append(AnalyticBlock(
            f"{name}.mlp" if kind == "gpt" else f"{name}.output",
            s * 16 * h * h, mlp_params, tokens_state, 21 * tokens_state,
        ))
    if kind == "gpt":
        head = AnalyticBlock("lm_head", s * 2 * h * vocab, vocab * h + 2 * h, s * vocab,
                             2 * tokens_state + 4 * s * vocab)
    else:
        head = AnalyticBlock("cls", s * (2 * h * h + 2 * h * vocab), h * h + vocab * h + 3 * h,
                             s * vocab, 4 * tokens_state + 4 * s * vocab)
    blocks.append(head)
    return blocks


def _conv(hw: int, cin: int, cout: int, k: int) -> tuple[float, int]:
    """(forward FLOPs, params) of one bias-free convolution producing an ``hw x hw`` map."""
    return 2.0 * hw * hw * cin * cout * k * k, cin * cout * k * k


def _resnet_blocks(depth: int, image_size: int, num_classes: int) -> list[AnalyticBlock]:
    if depth not in _RESNET_DEPTHS:
        raise PlanError(f"resnet depth {depth} unknown; use one of {sorted(_RESNET_DEPTHS)}")
    hw = image_size // 2
    flops, params = _conv(hw, 3, 64, 7)
    blocks = [AnalyticBlock("stem", flops, params + 2 * 64, 64 * (hw // 2) ** 2,
                            3 * 2 * 64 * hw * hw)]
    hw //= 2  # max pool
    cin = 64
    for stage, count in enumerate(_RESNET_DEPTHS[depth]):
        width = 64 * 2**stage
        for i in range(count):
            stride = 2 if (i == 0 and stage > 0) else 1
            out_hw = hw // stride
            f1, p1 = _conv(hw, cin, width, 1)
            f2, p2 = _conv(out_hw, width, width, 3)
            f3, p3 = _conv(out_hw, width, 4 * width, 1)
            f, p = f1 + f2 + f3, p1 + p2 + p3 + 2 * (2 * width + 4 * width)
            mem = 3 * 2 * (width * hw * hw + width * out_hw**2 + 4 * width * out_hw**2)
            if i == 0:
                fd, pd = _conv(out_hw, cin, 4 * width, 1)
                f, p, mem = f + fd, p + pd + 2 * 4 * width, mem + 2 * 2 * 4 * width * out_hw**2
            blocks.append(AnalyticBlock(f"layer{stage + 1}.{i}", f, p, 4 * width * out_hw**2,
                                        mem))
            cin, hw = 4 * width, out_hw
    blocks.append(AnalyticBlock("fc", 2.0 * cin * num_classes, cin * num_classes + num_classes,
                                num_classes, 2 * cin * hw * hw + 4 * num_classes))
    return blocks


def analytic_profile(
    kind: str,
    *,
    layers: int = 48,
    hidden: int = 1600,
    heads: int = 25,
    seq_len: int = 1024,
    vocab: int = 50257,
    micro_batch_size: int = 1,
    image_size: int = 224,
    num_classes: int = 1000,
    device_tflops: float = 312.0,
    efficiency: float = 0.45,
    backward_factor: float = 2.0,
    param_dtype_bytes: int = 4,
    act_dtype_bytes: int = 2,
    model: str | None = None,
) -> Profile:
    """A Profile whose costs come from FLOP and byte counts (see the module docstring).

    Args:
        kind: ``"gpt"`` (decoder, tied head), ``"bert"`` (encoder + MLM head) or ``"resnet"``
            (``layers`` = 50, 101 or 152; the transformer arguments are ignored).
        layers, hidden, heads, seq_len, vocab: transformer shape (defaults: GPT-2 XL).
        micro_batch_size: samples the block costs are for (costs are linear in it).
        device_tflops, efficiency: the reference device (speed 1.0 in a cluster file) reaches
            ``device_tflops * efficiency`` TFLOP/s on every block (default: A100 bf16 at 45%).
        backward_factor: backward time over forward time.

    Returns:
        A Profile with ``device = "analytic:<tflops>TFx<eff>"`` so it is never mistaken for a
        measurement.

    Raises:
        PlanError: an unknown kind or ResNet depth, heads not dividing hidden, or a
            non-positive micro-batch, device speed or efficiency.
    """
    if kind in ("gpt", "bert"):
        if hidden % heads:
            raise PlanError(f"hidden {hidden} is not divisible by heads {heads}; pick a head "
                            "count that divides the hidden size")
        raw = _transformer_blocks(kind, layers, hidden, heads, seq_len, vocab)
    elif kind == "resnet":
        raw = _resnet_blocks(layers, image_size, num_classes)
    else:
        raise PlanError(f"unknown analytic model kind {kind!r}; use 'gpt', 'bert' or 'resnet'")
    if micro_batch_size < 1 or device_tflops <= 0 or not 0 < efficiency <= 1:
        raise PlanError(
            f"need micro_batch_size >= 1, device_tflops > 0 and 0 < efficiency <= 1; got "
            f"{micro_batch_size}, {device_tflops}, {efficiency}"
        )
    ms_per_flop = 1e3 / (device_tflops * 1e12 * efficiency)
    b = micro_batch_size
    blocks = [
        BlockProfile(
            name=x.name,
            forward_ms=x.forward_flops * b * ms_per_flop,
            backward_ms=x.forward_flops * b * ms_per_flop * backward_factor,
            param_bytes=x.params * param_dtype_bytes,
            activation_bytes=x.activation_elems * b * act_dtype_bytes,
            memory_bytes=x.memory_bytes * b,
        )
        for x in raw
    ]
    name = model or (f"resnet{layers}" if kind == "resnet" else f"{kind}-{layers}x{hidden}")
    return Profile(model=name, micro_batch_size=b,
                   device=f"analytic:{device_tflops:g}TFx{efficiency:g}", blocks=blocks)
