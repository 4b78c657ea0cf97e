"""The strategy's step hooks: one Lightning step runs the whole pipeline schedule.

Lightning calls ``training_step`` inside the optimizer closure and ``backward`` after it; a
pipeline runs every forward and backward of the step in ``training_step``, so the gradients are
put aside there and handed back in ``backward`` (Lightning zeroes them in between, on the first
batch of an ``accumulate_grad_batches`` window). ``backward`` adds them to what the parameters
hold, divided by ``accumulate_grad_batches`` as Lightning divides the loss it back-propagates,
so a window of ``N`` batches steps on the gradients one process accumulates over them. The
evaluation and prediction steps run the forward-only schedule; the module's own steps run per
slice on the last stage (:mod:`~lightning_autopipe.lightning.steps`). Kept apart from
:mod:`~lightning_autopipe.lightning.strategy` (setup, collectives, teardown) as a base class of
it: these hooks read only the held pipeline, its step runner and the precision plugin.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.graph.numbers import changed_numbers
from lightning_autopipe.lightning import telemetry
from lightning_autopipe.lightning.held_pipeline import HeldPipeline
from lightning_autopipe.lightning.local_optimizers import agree_on_groups, group_facts
from lightning_autopipe.lightning.reproducible import BatchNormSteps
from lightning_autopipe.lightning.steps import StepOutcome, StepRunner
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.pipeline import LocalPipeline

__all__ = ["StepHooks", "epoch_end_note"]


class StepHooks(ParallelStrategy):
    """Training, validation, test and predict steps over this rank's held pipeline.

    The concrete strategy (:class:`~lightning_autopipe.lightning.strategy.AutoPipeStrategy`)
    sets the attributes below in its ``__init__`` and ``setup``.
    """

    options: AutoPipeOptions
    _held: HeldPipeline
    _bn: BatchNormSteps | None
    _grads: list[Tensor | None] | None
    _grads_of: list[Any]
    _warned_numbers: set[str]  # attribute paths warned of (:meth:`_warn_changed_numbers`)

    @property
    def _pipe(self) -> LocalPipeline | None:
        return self._held.pipe

    @property
    def _runner(self) -> StepRunner | None:
        return self._held.runner

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the whole schedule (every forward and backward) and sync the gradients.

        Lightning zeroes gradients *between* ``training_step`` and ``backward``, so this
        batch's gradients are put aside here and handed back in :meth:`backward`; the
        gradients the parameters held before (an accumulation window's) are left in place.
        """
        assert self._pipe is not None
        assert self._runner is not None
        batch, rest, extra = _step_args(args, kwargs)
        runner = self._runner
        own = not runner.uses_pipeline_loss
        runner.begin("training_step" if own else "pipeline_loss", rest, extra)
        params = self._pipe.executor.parameters
        held = [p.grad for p in params] if _within_window(self.lightning_module, rest,
                                                          extra) else [None] * len(params)
        for p in params:
            p.grad = None
        step = self.lightning_module.trainer.global_step if self.lightning_module else None
        executor = self._pipe.executor
        trainer = self.lightning_module.trainer if self.lightning_module else None
        executor.report = lambda: (float(bool(trainer is not None and trainer.should_stop)),
                                   *group_facts(self.optimizers))
        with self.precision_plugin.train_step_context(), telemetry.training_step(self, step):
            loss = executor.train_step(batch, step=step)
        self._agree_after_step(trainer)
        self._warn_changed_numbers()
        if self._bn is not None:  # whole-batch BatchNorm statistics; replica 0's buffers
            self._bn.after_step()
        self._grads = [p.grad for p in params]
        self._grads_of = params  # the parameters they belong to, as the step found them
        for p, g in zip(params, held):
            p.grad = g
        if own:
            self._finish()
        if not bool(torch.isfinite(loss)):
            self._on_nonfinite(loss, step)
        return loss

    def _agree_after_step(self, trainer: Any) -> None:
        """What the module's step did on the last stage alone, on every rank of the job.

        The module's steps run on the last stage: a ``training_step`` that sets
        ``self.trainer.should_stop`` (stopping when the loss is low enough) would stop that rank
        alone while the others waited for its next step until the timeout. Each rank reported
        its stop request and optimizer groups with the step's loss
        (:attr:`~lightning_autopipe.runtime.executor.PipelineExecutor.notes`): a request on any
        rank stops every rank, as Lightning's loop stops a process; a group another rank added
        is added here, and a learning rate the step set is set here
        (:func:`agree_on_groups`)."""
        assert self._pipe is not None
        notes = self._pipe.executor.notes
        agree_on_groups(self.optimizers, {r: n[1:] for r, n in notes.items()},
                        self._pipe.groups.pipeline, self._pipe.layout.last_stage_rank)
        if trainer is not None and any(n[0] for n in notes.values()):
            trainer.should_stop = True

    def _warn_changed_numbers(self) -> None:
        """A Python number of the model's modules that changed since the capture is warned of
        once (:mod:`~lightning_autopipe.graph.numbers`): where forward reads it, the stages
        compute with the captured value."""
        source = self._pipe.source if self._pipe is not None else None
        numbers = getattr(getattr(source, "blocks", None), "numbers", ())
        for number, now in changed_numbers(numbers):
            if number.path in self._warned_numbers:
                continue
            self._warned_numbers.add(number.path)
            warnings.warn(
                f"{number.path} was {number.value!r} when the model's graph was captured and is "
                f"{now!r} now: where forward reads it, the pipeline's stages still compute with "
                f"{number.value!r} (a Python number is a constant of the captured graph), so the "
                "run trains another model than one process would. Hold a value that changes "
                "during training in a tensor buffer updated in place, which the stages read "
                "when they run: self.register_buffer('"
                f"{number.attribute}', torch.tensor({number.value!r})) in __init__, then "
                f"`if m.{number.attribute} is not None: m.{number.attribute}.fill_(...)` (a "
                "rank whose stage does not hold it sees None, as for another stage's weights)",
                stacklevel=2,
            )

    def _on_nonfinite(self, loss: Tensor, step: int | None) -> None:
        """Every rank holds the same global loss, so every rank takes the same branch."""
        assert self._pipe is not None
        where = self._pipe.nonfinite_origin()
        if self.options.nonfinite_loss == "skip":
            rank_zero_warn(
                f"non-finite training loss {float(loss)} at step {step} ({where}); skipping the "
                "batch: its gradients are dropped on every rank"
            )
            self._grads = [None] * len(self._grads or [])
            return
        raise PipelineRuntimeError(
            f"non-finite training loss {float(loss)} at step {step}: {where}. Lower the learning "
            "rate, clip gradients, check the data, or pass nonfinite_loss='skip' to "
            "AutoPipeStrategy to skip such steps"
        )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Add the gradients the schedule computed to the parameters' (module docstring); the
        before/after-backward hooks run."""
        assert self._pipe is not None
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._grads is not None:
            window = _window(module)
            for p, g in zip(self._grads_of, self._grads, strict=True):
                if g is None:
                    continue
                g = g / window if window > 1 else g
                p.grad = g if p.grad is None else p.grad + g
            self._grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(
            "validation_step", args, kwargs, self.options.val_loss_name,
            self.precision_plugin.val_step_context,
        )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(
            "test_step", args, kwargs, self.options.test_loss_name,
            self.precision_plugin.test_step_context,
        )

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """``predict_step`` per slice on the last stage; every rank returns its replica's.
        Nothing is shared between replicas: Lightning's predict sampler does not pad, so one
        replica may run a batch more than another."""
        assert self._pipe is not None
        assert self._runner is not None
        batch, rest, extra = _step_args(args, kwargs)
        self._runner.begin("predict_step", rest, extra)
        self._pipe.executor.report = None  # nothing to agree on
        with self.precision_plugin.predict_step_context():
            self._pipe.executor.eval_step(batch, step=_batch_idx(rest, extra), replicas=False)
        return self._finish(replicas=False).predictions

    def _eval_step(
        self, hook: str, args: Any, kwargs: Any, name: str, context: Callable
    ) -> Any:
        """Forward-only pipeline: the module's own step per slice, else ``pipeline_loss``."""
        assert self._pipe is not None
        assert self._runner is not None
        assert self.lightning_module is not None
        batch, rest, extra = _step_args(args, kwargs)
        runner = self._runner
        own = not runner.uses_pipeline_loss
        runner.begin(hook if own else "pipeline_loss", rest, extra)
        executor, trainer = self._pipe.executor, self.lightning_module.trainer
        executor.report = lambda: (float(bool(trainer.should_stop)),)
        with context():
            loss = executor.eval_step(batch, step=_batch_idx(rest, extra))
        if any(n and n[0] for n in executor.notes.values()):  # the step asked (see training)
            trainer.should_stop = True
        if own:  # what the step returned, joined over the slices (``on_*_batch_end`` gets it)
            return self._finish().returned
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

    def _finish(self, replicas: bool = True) -> StepOutcome:
        """Share the step's slice results over the pipeline (and a failure over the replicas)
        and log them on this rank."""
        assert self._pipe is not None
        assert self._runner is not None
        outcome = self._runner.finish(self._pipe.layout, self._pipe.groups, self.root_device,
                                      replicas=replicas,
                                      replica_weight=self._pipe.executor.replica_weight)
        outcome.log_to(self.lightning_module, self.root_device,
                       self._pipe.layout.pipeline_ranks[0] == self.global_rank)
        return outcome


def _step_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple, dict]:
    """(batch, the step's other positional arguments, its other keyword arguments)."""
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    extra = dict(kwargs)
    return extra.pop("batch"), (), extra


def _batch_idx(rest: tuple[Any, ...], extra: dict[str, Any]) -> Any:
    return rest[0] if rest else extra.get("batch_idx")


def _within_window(module: Any, rest: tuple[Any, ...], extra: dict[str, Any]) -> bool:
    """This batch continues an ``accumulate_grad_batches`` window: the gradients the
    parameters hold are the window's so far. Not on a window's first batch, whose closure
    zeroes them (Lightning's test): they are released before the step, not held through it."""
    window = _window(module)
    batch_idx = _batch_idx(rest, extra)
    return window > 1 and not (isinstance(batch_idx, int) and batch_idx % window == 0)


def _window(module: Any) -> int:
    """The Trainer's ``accumulate_grad_batches`` (1 without a Trainer)."""
    trainer = getattr(module, "_trainer", None)
    return int(getattr(trainer, "accumulate_grad_batches", 1) or 1)


_EPOCH_ENDS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end",
               "on_predict_epoch_end")


def epoch_end_note(exc: BaseException, module: Any, layout: Any) -> str | None:
    """What to add to ``exc`` when it came from one of the module's epoch-end hooks on a rank
    whose stage (``layout``'s) runs no step, not holding the model's last chunk: outputs its
    steps collected on ``self`` (the Lightning 2 way to aggregate at epoch end) are empty
    here. None otherwise."""
    if layout.is_last:
        return None
    stage, last = layout.stage, layout.num_stages - 1
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in _EPOCH_ENDS and frame.f_locals.get("self") is module:
            return (f"{frame.f_code.co_name} raised on a rank holding stage {stage} of "
                    f"0..{last}: the module's steps run on the last stage only, so what they "
                    "collect on `self` (e.g. a list of outputs) is empty on this rank. Log "
                    "values with self.log in the step (on_epoch=True aggregates them), or "
                    "update a torchmetrics metric in the step and log metric.compute() in "
                    f"{frame.f_code.co_name} (docs/usage.md)")
        tb = tb.tb_next
    return None
