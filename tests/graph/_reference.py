"""Reference checks shared by the graph tests: a split model against the original."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_autopipe.graph import BlockGraph


def call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def main_output(out: Any) -> torch.Tensor:
    """The tensor a loss would read: the tensor itself, ``.logits``, or the first field."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def _weights(like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(like.shape, generator=g, dtype=like.dtype)


def reference(model: nn.Module, inputs: Any) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Output and parameter gradients (by parameter identity) of ``sum(out * w)``."""
    model.zero_grad(set_to_none=True)
    out = main_output(call(model, inputs))
    (out * _weights(out)).sum().backward()
    grads = {
        id(p): (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for p in model.parameters()
    }
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def pipelined(blocks: BlockGraph, inputs: Any, cuts: list[int]) -> tuple[Any, list[nn.Module]]:
    """Run ``cuts`` like separate processes would: independent stage copies, detached leaves
    at each boundary (grad only where ``boundary(k)`` says it flows), backward stage by stage.

    Returns the model-shaped output and the stage copies holding the gradients.
    """
    pairs = list(zip(cuts[:-1], cuts[1:], strict=True))
    stages = [copy.deepcopy(blocks.stage(i, j)) for i, j in pairs]
    values: tuple[Any, ...] = blocks.flatten_inputs(inputs)
    saved = []
    for stage, (i, _) in zip(stages, pairs, strict=True):
        flags = [v.requires_grad for v in blocks.boundary(i)]
        assert len(flags) == len(values), "boundary metadata and stage inputs disagree"
        ins = []
        for v, flag in zip(values, flags, strict=True):
            assert isinstance(v, torch.Tensor), f"non-tensor {type(v)} crossed a boundary"
            leaf = v.detach()
            if flag and leaf.is_floating_point():
                leaf.requires_grad_(True)
            ins.append(leaf)
        outs = stage(*ins)
        assert isinstance(outs, tuple)
        saved.append((ins, outs))
        values = outs
    out = blocks.unflatten_outputs(values)
    main = main_output(out)
    (main * _weights(main)).sum().backward()
    for s in range(len(stages) - 2, -1, -1):
        _, outs = saved[s]
        nxt_ins, _ = saved[s + 1]
        pairs_ = [
            (o, i.grad)
            for o, i in zip(outs, nxt_ins, strict=True)
            if i.requires_grad and i.grad is not None
        ]
        for o, _ in pairs_:
            assert o.requires_grad, "a gradient arrived for an output that does not need one"
        if pairs_:
            torch.autograd.backward([o for o, _ in pairs_], [g for _, g in pairs_])
    return out, stages


def check_split(blocks: BlockGraph, model: nn.Module, inputs: Any, cuts: list[int]) -> None:
    """Same outputs and same parameter gradients as the original; names map back."""
    ref_out, ref_grads = reference(model, inputs)
    out, stages = pipelined(blocks, inputs, cuts)
    torch.testing.assert_close(main_output(out), ref_out)
    assert type(out) is type(call(model, inputs))

    originals = dict(model.named_parameters(remove_duplicate=False))
    summed: dict[int, torch.Tensor] = {}
    holders: dict[int, set[int]] = {}
    for s, stage in enumerate(stages):
        for local, _ in stage.named_parameters(remove_duplicate=False):
            holders.setdefault(id(originals[stage.param_names[local]]), set()).add(s)
        for local, p in stage.named_parameters():  # tied inside a stage: one Parameter
            orig = originals[stage.param_names[local]]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            summed[id(orig)] = summed.get(id(orig), 0) + grad
    # every parameter is held by exactly one stage, or by several in a reported tie group
    assert set(holders) == {id(p) for p in model.parameters()}
    ties = {id(originals[t.name]): set(t.stages) for t in blocks.tie_groups(cuts)}
    for pid, where in holders.items():
        if len(where) > 1:
            assert ties.get(pid) == where, f"parameter in stages {where} without a tie group"
    by_name = {id(p): n for n, p in model.named_parameters()}
    for pid, grad in ref_grads.items():
        torch.testing.assert_close(summed[pid], grad, msg=lambda m, n=by_name[pid]: f"{n}: {m}")

    original_sd = model.state_dict()
    for stage in stages:
        sd = stage.state_dict()
        assert set(sd) == set(stage.param_names)
        assert all(stage.param_names[k] in original_sd for k in sd)
        with torch.no_grad():
            for t in sd.values():
                if t.is_floating_point():
                    t.add_(1.0)
        stage.load_state_dict({k: original_sd[stage.param_names[k]] for k in sd})
        for k, t in stage.state_dict().items():
            assert torch.equal(t, original_sd[stage.param_names[k]]), k


def random_cuts(n: int, stages: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    stages = min(stages, n)
    inner = torch.randperm(n - 1, generator=g)[: stages - 1] + 1
    return [0, *sorted(int(c) for c in inner), n]
