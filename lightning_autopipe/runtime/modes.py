"""Train/eval modes of a rank's stages, module by module as the user's model has them.

A stage holds copies of the model's modules, not the modules themselves, so ``train()`` /
``eval()`` on a part of the user's model (a frozen backbone's BatchNorm put in evaluation mode
in ``on_train_epoch_start``, as fine-tuning code does) would not reach it: the stage trained
the whole model in training mode (the BatchNorm statistics kept updating, the normalisation
used the batch's) and the run silently left one process. (A torch.fx stage calls the model's
own module objects, and its ``train()`` put them back in training mode at every step.) At each
training step :class:`ModeFollower` gives every module the stage *calls* (a torch.fx graph's
``call_module``, and what it contains) the mode its user's module had before the step.

A torch.export graph holds operations, not calls: its modes are constants chosen by the
stage's own ``training`` flag (:mod:`lightning_autopipe.graph.stage`), which follows the whole
model. Where a user's BatchNorm or dropout in evaluation mode has its operations in such a
stage on this rank (its tensors, or the module stack export records on each operation), the
follower warns once that the stage trains it in the model's mode instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from torch import fx, nn

__all__ = ["ModeFollower"]

#: Modules whose computation depends on their mode (beside any that reads ``self.training``).
_MODAL = (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)


class ModeFollower:
    """Keeps the user's modules' modes on this rank's stage parts through a training step's
    ``train()``.

    Args:
        module: the user's traced root (the module the stages were cut from).
        parts: this rank's stage modules (chunk -> :class:`~lightning_autopipe.graph.stage.
            StageModule`); their ``param_names`` map local state-dict keys to the model's.
    """

    def __init__(self, module: nn.Module, parts: Mapping[int, nn.Module]) -> None:
        user = dict(module.named_modules())
        self._user = user
        self._pairs: list[tuple[nn.Module, nn.Module]] = []
        inlined: set[str] = set()  # the model's modules whose operations an export stage runs
        for part in parts.values():
            renamed = _module_names(part)
            called = _called(part)
            if not called:
                inlined.update(renamed.values())
                inlined.update(_module_stack(part))
            for path in called:
                for sub_path, sub in part.get_submodule(path).named_modules(prefix=path):
                    source = user.get(renamed.get(sub_path, sub_path))
                    if source is not None and source is not module:
                        self._pairs.append((sub, source))
        self._unfollowed = sorted(name for name in inlined
                                  if isinstance(user.get(name), _MODAL))
        self._warned = False

    def __call__(self, train: Callable[[], None]) -> None:
        """Run ``train`` (the stage's ``train()``), then give the stages' called modules the
        modes the user's modules had before it: a torch.fx stage calls the model's own module
        objects, which ``train()`` reaches too."""
        wanted = [source.training for _, source in self._pairs]
        train()
        for (copy, source), mode in zip(self._pairs, wanted, strict=True):
            copy.training = source.training = mode
        self._warn_unfollowed()

    @contextmanager
    def evaluating(self, evaluate: Callable[[], None]) -> Iterator[None]:
        """An evaluation step: ``evaluate`` (the stage's ``eval()``) for the block, then the
        modes the user's modules had before it (a torch.fx stage's ``eval()`` reaches the
        model's own modules, and a training step would read them back as the user's)."""
        wanted = [source.training for _, source in self._pairs]
        evaluate()
        try:
            yield
        finally:
            for (copy, source), mode in zip(self._pairs, wanted, strict=True):
                copy.training = source.training = mode

    def _warn_unfollowed(self) -> None:
        if self._warned:
            return
        evaluating = [n for n in self._unfollowed if not self._user[n].training]
        if evaluating:
            self._warned = True
            shown = ", ".join(evaluating[:4]) + (" ..." if len(evaluating) > 4 else "")
            warnings.warn(
                f"{shown} {'is' if len(evaluating) == 1 else 'are'} in evaluation mode while "
                "the model trains, but this rank's stage was captured by torch.export, whose "
                "graph follows the whole model's train()/eval() only: it trains them in "
                "training mode (BatchNorm statistics update, dropout on). Make the model "
                "traceable by torch.fx (its stages call the modules and follow their modes), "
                "or freeze them in a way that needs no mode (BatchNorm: torchvision.ops."
                "FrozenBatchNorm2d; dropout: p=0)", UserWarning, stacklevel=4)


def _module_names(part: nn.Module) -> dict[str, str]:
    """The stage's module paths -> the model's, from its tensors' names (a module called at
    several depths is held under other paths than the model's)."""
    names: dict[str, str] = {}
    for local, original in getattr(part, "param_names", {}).items():
        names.setdefault(local.rpartition(".")[0], original.rpartition(".")[0])
    return names


def _module_stack(part: nn.Module) -> set[str]:
    """The model's module paths whose operations an exported stage's graph holds (the
    ``nn_module_stack`` torch.export records on each node)."""
    if not isinstance(part, fx.GraphModule):
        return set()
    return {str(path) for n in part.graph.nodes
            for path, _ in n.meta.get("nn_module_stack", {}).values()}


def _called(part: nn.Module) -> list[str]:
    """The modules the stage's graph calls (torch.fx ``call_module``), by path."""
    if not isinstance(part, fx.GraphModule):
        return []
    return sorted({str(n.target) for n in part.graph.nodes if n.op == "call_module"})
