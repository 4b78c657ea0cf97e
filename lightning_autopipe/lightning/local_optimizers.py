"""A rank's optimizers: ``configure_optimizers`` over the local stage, agreed on by every rank.

After the split the module holds this rank's stage only, so ``configure_optimizers`` sees the
stage's parameters. Two things that work in one process then go wrong on one rank alone:

* A stage may train nothing: frozen embeddings on the first stage, the usual fine-tuning
  set-up, with the usual ``Adam(p for p in self.parameters() if p.requires_grad)``. torch
  refuses to build an optimizer over no parameter at all. Such a rank builds it with one
  empty placeholder parameter registered on the module, then takes the placeholder out of
  the module and the optimizer again: an optimizer whose groups are empty, as a live re-plan
  leaves one on a rank that no longer holds a group's parameters.
* Any other error raised by one rank's ``configure_optimizers`` would leave its peers waiting
  in their next collective until the timeout, with a message naming no one: every rank says
  how it went and all stop with the failing rank's error
  (:func:`~lightning_autopipe.runtime.failure.stop_everywhere`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_autopipe.runtime.failure import stop_everywhere
from lightning_autopipe.runtime.optim_state import unwrap

__all__ = ["make_local_optimizers"]

_PLACEHOLDER = "_autopipe_nothing_to_train"


def make_local_optimizers(
    module: nn.Module, make: Callable[[], None], optimizers: Callable[[], Sequence[Any]],
    check: Callable[[], None], *, device: torch.device, distributed: bool,
) -> None:
    """``make()`` (the strategy's ``setup_optimizers``) then ``check()`` on this rank, with a
    placeholder when its stage trains nothing; with ``distributed``, every rank stops when
    one failed (a collective)."""
    failure: BaseException | None = None
    try:
        if any(p.requires_grad for p in module.parameters()):
            make()
        else:
            _with_placeholder(module, make, optimizers, device)
        check()
    except Exception as exc:  # noqa: BLE001 - re-raised here, or named on every other rank
        failure = exc
    if distributed:
        stop_everywhere(failure, "while making its optimizers (configure_optimizers)")
    elif failure is not None:
        raise failure


def _with_placeholder(module: nn.Module, make: Callable[[], None],
                      optimizers: Callable[[], Sequence[Any]], device: torch.device) -> None:
    placeholder = nn.Parameter(torch.zeros(0, device=device))
    module.register_parameter(_PLACEHOLDER, placeholder)
    try:
        make()
    finally:
        del module._parameters[_PLACEHOLDER]
    for optimizer in optimizers():
        opt = unwrap(optimizer)
        for group in opt.param_groups:
            keep = [i for i, p in enumerate(group["params"]) if p is not placeholder]
            if "param_names" in group:  # built from named_parameters()
                group["param_names"] = [group["param_names"][i] for i in keep]
            group["params"] = [group["params"][i] for i in keep]
        opt.state.pop(placeholder, None)
