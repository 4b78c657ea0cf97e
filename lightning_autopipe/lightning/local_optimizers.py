"""A rank's optimizers: ``configure_optimizers`` over the local stage, agreed on by every rank.

After the split the module holds this rank's stage only, so ``configure_optimizers`` sees the
stage's parameters. Two things that work in one process then go wrong on one rank alone:

* A stage may train nothing of what an optimizer is given: frozen embeddings on the first
  stage and the usual ``Adam(p for p in self.parameters() if p.requires_grad)``, or
  ``AdamW(self.head.parameters())`` on a rank whose stage holds no part of the head. torch
  refuses to build an optimizer over no parameter at all. While ``configure_optimizers`` runs,
  an optimizer given none is built over one empty placeholder parameter instead, which is
  then taken out again: an optimizer whose groups are empty, as a live re-plan leaves one on
  a rank that no longer holds a group's parameters.
* Any other error raised by one rank's ``configure_optimizers`` would leave its peers waiting
  in their next collective until the timeout, with a message naming no one: every rank says
  how it went and all stop with the failing rank's error
  (:func:`~lightning_autopipe.runtime.failure.stop_everywhere`).

A group added during the run lands on the ranks that hold its parameters only: fine-tuning
callbacks (Lightning's ``BackboneFinetuning``) unfreeze a module and add its parameters as a new
group where there are any, so the rank of another stage skips it. The ranks' groups would then
no longer be the whole model's group by group, and a checkpoint (which merges group ``g`` of every
rank) or a re-plan's migration could not put them together. And the module's ``training_step``
runs on the last stage alone: one that sets a learning rate (a warm-up written there) would set
it on that rank only, and the other stages would train on at the old one with no error.
:func:`agree_on_groups` gives the other ranks an added group too, empty, with its
hyper-parameters, and every rank the last stage's hyper-parameters, at the step they appear.

Lightning refuses several optimizers under automatic optimization and suggests manual
optimization, which the strategy cannot offer (its schedule runs the backward): that refusal is
told with the fix that works here, one optimizer with a parameter group per part.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.failure import stop_everywhere
from lightning_autopipe.runtime.optim_state import unwrap

__all__ = ["SHARED_SETTINGS", "agree_on_groups", "group_facts", "make_local_optimizers"]


def make_local_optimizers(
    make: Callable[[], None], optimizers: Callable[[], Sequence[Any]],
    check: Callable[[], None], *, device: torch.device, distributed: bool,
) -> None:
    """``make()`` (the strategy's ``setup_optimizers``) then ``check()`` on this rank, an
    optimizer given no parameter built over a placeholder; with ``distributed``, every rank
    stops when one failed (a collective)."""
    failure: BaseException | None = None
    try:
        placeholder = nn.Parameter(torch.zeros(0, device=device))
        with _empty_lists_get(placeholder), _one_optimizer_told():
            make()
        _take_out(placeholder, optimizers())
        check()
    except Exception as exc:  # noqa: BLE001 - re-raised here, or named on every other rank
        failure = exc
    if distributed:
        stop_everywhere(failure, "while making its optimizers (configure_optimizers)")
    elif failure is not None:
        raise failure


@contextmanager
def _one_optimizer_told() -> Iterator[None]:
    """Inside: Lightning's refusal of several optimizers becomes a :class:`PlanError` whose fix
    works under the pipeline (Lightning's own, manual optimization, does not)."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if "multiple optimizers" not in text or "manual optimization" not in text:
            raise
        if "optimizer_idx" in text:  # Lightning 1.x's signature, refused with any count
            raise PlanError(
                "training_step declares an optimizer_idx argument (Lightning 1.x's several "
                "optimizers); remove it: AutoPipeStrategy steps one optimizer per step and "
                "cannot take manual optimization (return one optimizer with a parameter group "
                "per part instead)") from None
        raise PlanError(
            "configure_optimizers returned several optimizers; AutoPipeStrategy steps one "
            "optimizer per step and cannot take manual optimization (its schedule runs the "
            "backward). Return one optimizer with a parameter group per part instead, e.g. "
            "torch.optim.AdamW([{'params': self.encoder.parameters(), 'lr': 1e-4}, "
            "{'params': self.head.parameters(), 'lr': 1e-3}])") from None


@contextmanager
def _empty_lists_get(placeholder: nn.Parameter) -> Iterator[None]:
    """Inside: ``torch.optim.Optimizer(params)`` with no parameter gets ``[placeholder]``."""
    init = torch.optim.Optimizer.__init__

    def patched(self: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(params, torch.Tensor):
            params = list(params)
            if not params:
                params = [placeholder]
        init(self, params, *args, **kwargs)

    torch.optim.Optimizer.__init__ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]


def _take_out(placeholder: nn.Parameter, optimizers: Sequence[Any]) -> None:
    for optimizer in optimizers:
        opt = unwrap(optimizer)
        for group in opt.param_groups:
            keep = [i for i, p in enumerate(group["params"]) if p is not placeholder]
            if "param_names" in group:  # built from named_parameters()
                group["param_names"] = [group["param_names"][i] for i in keep]
            group["params"] = [group["params"][i] for i in keep]
        opt.state.pop(placeholder, None)


#: The settings a step may set that every stage must share (a warm-up's ``lr``). Others are
#: left to each rank: an optimizer may keep state of its own per group (Prodigy's and
#: D-Adaptation's ``d``, computed from the stage's parameters), which no rank should impose.
SHARED_SETTINGS = ("lr", "weight_decay", "momentum", "betas", "eps")


def group_facts(optimizers: Sequence[Any]) -> tuple[float, float]:
    """This rank's optimizer parameter-group count and a digest of the groups'
    :data:`SHARED_SETTINGS` (exact in a float64: what the ranks compare after each step)."""
    groups = [_hyper(g, SHARED_SETTINGS) for o in optimizers for g in unwrap(o).param_groups]
    return float(len(groups)), float(zlib.crc32(repr(groups).encode()))


def _hyper(group: Mapping[str, Any], keys: Sequence[str] | None = None) -> dict[str, Any]:
    """A group's hyper-parameters (``keys`` of them) as plain values: a tensor learning rate
    (fused or capturable optimizers) by its number, which a rank's device does not change."""
    names = [k for k in keys if k in group] if keys is not None else sorted(group)
    return {k: _plain(group[k]) for k in names if k not in ("params", "param_names")}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    return value


def _set_hyper(group: dict[str, Any], hyper: Mapping[str, Any]) -> None:
    for key, value in hyper.items():
        if isinstance(group.get(key), torch.Tensor):
            group[key].copy_(torch.as_tensor(value))  # a tensor stays on its device
        else:
            group[key] = value


def agree_on_groups(optimizers: Sequence[Any], facts: Mapping[int, Sequence[float]],
                    group: Any, source: int) -> None:
    """Every pipeline rank's optimizer given the groups another rank added and the
    :data:`SHARED_SETTINGS` of rank ``source`` (the last stage, where the module's steps ran)
    (module docstring).

    ``facts``: every rank of the replica's pipeline's :func:`group_facts`, alike on each (the
    executor's ``notes``); only where they differ do the ranks exchange their groups'
    hyper-parameters (a collective over ``group``, the pipeline's, entered by all of them
    alike). A rank with fewer groups appends the missing ones, empty, with the
    hyper-parameters of the rank that has the most: groups are added one after another, so
    group ``g`` is the same group on every rank that has it. Two ranks each adding a different
    group at the same step cannot be told apart from one group that spans both: they stay
    paired by position.
    """
    if len({tuple(f) for f in facts.values()}) < 2 or len(optimizers) != 1:
        return
    opt = unwrap(optimizers[0])
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [_hyper(g) for g in opt.param_groups], group=group)
    ruling = everyone[dist.get_group_rank(group, source)]
    longest = max(everyone, key=len)
    for g, hyper in enumerate(ruling + longest[len(ruling):]):
        if g < len(opt.param_groups):
            _set_hyper(opt.param_groups[g], _hyper(hyper, SHARED_SETTINGS))
            continue
        empty = {**hyper, "params": []}
        if "param_names" in opt.param_groups[0]:  # built from named_parameters()
            empty["param_names"] = []
        opt.add_param_group(empty)
