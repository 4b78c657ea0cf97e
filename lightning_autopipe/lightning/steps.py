"""A LightningModule's own steps under the pipeline: run per slice on the last stage, logs merged.

Under ``AutoPipeStrategy`` no rank holds the whole model, so the module's ``training_step`` cannot
run as written. :class:`StepRunner` is the executor's loss function instead: for every
micro-batch slice the last stage calls the module's own ``training_step`` / ``validation_step``
/ ``test_step`` / ``predict_step`` on that slice, with ``self(...)`` answering from the pipeline
(the slice's outputs of the last stage) and ``self.log`` recorded rather than logged. The
returned loss is what the executor back-propagates (weighted by the slice's sample count).
After the step (:meth:`StepRunner.finish`, collective) the records are combined per key over the
slices (:mod:`~lightning_autopipe.lightning.step_logs`:
sample-weighted, so a logged mean is the whole
batch's), sent to every rank of the pipeline and logged there once, so Lightning's result
collection (loggers, progress bar, ``ModelCheckpoint(monitor=...)``, ``EarlyStopping``,
``sync_dist``, ``on_epoch`` means) sees what it sees under DDP. A module with ``pipeline_loss``
keeps the strategy's own loop: the runner then only forwards to ``pipeline_loss``.

A step that fails on the last stage does not fail there alone (its peers would wait in the next
message until the timeout): the runner keeps the error, lets the schedule finish on stand-in
losses of zero, and :meth:`StepRunner.finish` raises it on every rank of every replica.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_autopipe.errors import OptionError, PipelineRuntimeError, StepContractError
from lightning_autopipe.lightning.stage_parameters import parameters_read_warned
from lightning_autopipe.lightning.step_calls import check_call, check_constants, tensors_in
from lightning_autopipe.lightning.step_logs import WAY_OUT, LoggedValue, SliceLogs, bind_log
from lightning_autopipe.lightning.step_outputs import join_slices
from lightning_autopipe.runtime.failure import describe
from lightning_autopipe.runtime.local_stage import as_call_args, model_inputs

__all__ = ["STEP_HOOKS", "StepOutcome", "StepRunner", "join_slices"]

STEP_HOOKS = ("training_step", "validation_step", "test_step", "predict_step")
#: Most bytes of an evaluation step's outputs the last stage sends to the other stages.
SHIP_MAX_BYTES = 64 * 2**20
_PIPELINE_LOSS = "pipeline_loss"


@dataclass
class StepOutcome:
    """What one step's slices produced, the same on every rank of the pipeline."""

    logs: list[LoggedValue] = field(default_factory=list)
    #: an evaluation step's return value joined over the slices (as one call returns it)
    returned: Any = None
    predictions: Any = None

    def log_to(self, module: Any, device: torch.device, sole: bool = True) -> None:
        """Log every combined key once through the module's own ``self.log`` (this rank).

        Every rank of a replica's pipeline logs its replica's value, so a ``sync_dist`` sum
        over the world would count each replica once per rank where DDP counts it once: such
        a sum is logged by the replica's first rank only (``sole``), zero by the others (a
        mean, max or min of the copies is the value itself)."""
        for name, options, value, wide in self.logs:
            dtype = torch.float64 if wide else torch.float32
            if not sole and options.get("sync_dist") and options.get("reduce_fx") == "sum":
                value = 0.0
            module.log(name, torch.tensor(value, dtype=dtype, device=device), **options)


class StepRunner:
    """The executor's per-slice loss: the module's own step, or its ``pipeline_loss``.

    Args:
        module: the LightningModule (its parameters may already be bound to one stage).
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        #: this rank holds one stage of several (the others' parameters are released here)
        self.partial = False
        self._warned_parameters: set[str] = set()  # hooks warned of (:mod:`.stage_parameters`)
        self._warned_outputs = False
        loss = getattr(module, _PIPELINE_LOSS, None)
        self._pipeline_loss: Callable[[Any, Any], Tensor] | None = loss if callable(loss) else None
        self._hook: str | None = _PIPELINE_LOSS if self.uses_pipeline_loss else None
        self._reset((), {})

    @property
    def uses_pipeline_loss(self) -> bool:
        """The module defines ``pipeline_loss``: the strategy's loop runs, not the steps."""
        return self._pipeline_loss is not None

    def begin(self, hook: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
              ) -> None:
        """Start a step: ``hook`` is called per slice with ``(slice, *args, **kwargs)``.

        ``hook`` is one of :data:`STEP_HOOKS` or ``"pipeline_loss"``; ``args`` are what
        Lightning passed after the batch (``batch_idx``, ``dataloader_idx``).
        """
        if hook != _PIPELINE_LOSS and hook not in STEP_HOOKS:
            raise OptionError(f"unknown step {hook!r}; one of {STEP_HOOKS} or 'pipeline_loss'")
        if hook == _PIPELINE_LOSS and not self.uses_pipeline_loss:
            raise OptionError(
                f"step 'pipeline_loss' asked of {type(self.module).__name__}, which has no "
                f"pipeline_loss; begin one of {STEP_HOOKS}"
            )
        self._hook = hook
        self._reset(args, kwargs or {})

    def __call__(self, outputs: Any, part: Any) -> Tensor:
        """The slice's loss (executor's ``loss_fn``): ``outputs`` of the last stage, ``part``
        the slice of the batch."""
        hook = self._hook
        if hook is None:
            raise PipelineRuntimeError("StepRunner called outside a step; call begin() first")
        if hook == _PIPELINE_LOSS:
            assert self._pipeline_loss is not None
            return self._pipeline_loss(outputs, part)
        if self._failure is None:
            try:
                return self._slice(hook, outputs, part)
            except Exception as exc:  # raised on every rank by finish(), not here alone
                self._failure = exc
        return _stand_in(outputs, training=hook == "training_step")

    def finish(self, layout: Any, groups: Any, device: torch.device, *, replicas: bool = True,
               replica_weight: float = 1.0) -> StepOutcome:
        """Combine the slices' records on the last stage and share them (collective).

        Every rank of the pipeline calls this after the executor's step, in the same order.
        The last stage sends the combined logs, returned value and predictions to its replica's
        other stages; a failure of any replica is then raised on every rank: the rank where it
        happened re-raises its own exception, the others raise it as a
        :class:`~lightning_autopipe.errors.StepContractError` (a contract error, same message)
        or a :class:`~lightning_autopipe.errors.PipelineRuntimeError` naming that rank. With
        ``replicas=False`` (prediction: Lightning's predict sampler does not pad, so replicas
        may run different numbers of batches) a failure is shared within the replica only.
        ``replica_weight``: the replica's samples over an even share (uneven replica batches,
        :class:`~.step_logs.SliceLogs`).
        """
        hook = self._hook or "step"
        payload = (self._payload(layout, replica_weight, layout.num_replicas) if layout.is_last
                   else None)
        if layout.num_stages > 1:
            box = [payload]
            dist.broadcast_object_list(box, src=layout.last_stage_rank, group=groups.pipeline)
            payload = box[0]
        failure = (_agree(payload["failure"], layout, groups, device) if replicas
                   else payload["failure"])
        if failure is not None:
            if self._failure is not None:
                raise self._failure
            contract, message, where = failure
            if contract:
                raise StepContractError(message)
            raise PipelineRuntimeError(f"{where} failed in {hook}: {message}")
        joined = self._joined if layout.is_last else payload["joined"]
        if joined is not None and not layout.is_last:
            joined = move_data_to_device(joined, device)
        if hook == "predict_step":
            return StepOutcome(payload["logs"], predictions=joined)
        return StepOutcome(payload["logs"], returned=joined)

    # ---------------------------------------------------------------------------- internals
    def _reset(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self._args, self._kwargs = tuple(args), dict(kwargs)
        self._logs = SliceLogs()
        self._predictions: list[Any] = []  # what each slice's step returned (not training's)
        self._sizes: list[int] = []
        self._joined: Any = None
        self._failure: BaseException | None = None

    def _slice(self, hook: str, outputs: Any, part: Any) -> Tensor:
        module = self.module
        expected = tensors_in(as_call_args(model_inputs(module, part)))
        n = int(expected[0].shape[0]) if expected and expected[0].dim() else 1
        if hook == "predict_step" and not is_overridden("predict_step", module, LightningModule):
            self._sizes.append(n)  # Lightning's default predict_step returns self(batch)
            self._predictions.append(outputs)
            return _stand_in(outputs, training=False)
        calls = 0
        logged: dict[str, tuple[Tensor, dict[str, Any], float]] = {}

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise StepContractError(
                    f"{hook} called self(...) twice in one step; under AutoPipeStrategy the "
                    "model runs once per micro-batch slice as a pipeline and self(...) answers "
                    "with that slice's outputs of the last stage, so a step may call it exactly "
                    f"once (compute everything else from those outputs), {WAY_OUT}"
                )
            check_call(hook, (args, kwargs), expected)
            check_constants(hook, type(module).forward, args, kwargs)
            return outputs

        def log(*args: Any, **kwargs: Any) -> None:
            name, value, options, given = bind_log(hook, args, kwargs)
            logged[name] = (value, options, given)  # a key logged twice keeps its last value

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            raise StepContractError(
                f"{hook} called self.all_gather(...); under AutoPipeStrategy the step runs on "
                "the last stage alone, once per micro-batch slice, so a collective over every "
                "rank would wait for ranks that never call it (until the timeout). Gather in "
                "an epoch-end hook (every rank runs those), or compute the term in forward "
                f"from the slice's samples, {WAY_OUT}"
            )

        patched = {"forward": forward, "log": log, "all_gather": all_gather}
        module.__dict__.update(patched)
        reading = (parameters_read_warned(module, hook, PENALTY, self._warned_parameters)
                   if self.partial and hook == "training_step" else nullcontext())
        try:
            with reading:
                out = getattr(module, hook)(part, *self._args, **self._kwargs)
        except StepContractError:
            raise
        except Exception as exc:
            # a submodule run on this rank's released weights fails on a None (linear():
            # argument 'weight' must be Tensor, not NoneType): any other error is the step's own
            if calls or "None" not in str(exc):
                raise
            raise StepContractError(
                f"{hook} raised {describe(exc)} before calling self(...); under "
                "AutoPipeStrategy each rank holds one stage of the model (the other stages' "
                "weights are released), so the step must run the model through self(...) or "
                f"self.forward(...), which answer from the pipeline, not through a submodule, "
                f"{WAY_OUT}"
            ) from exc
        finally:
            for name in patched:
                module.__dict__.pop(name, None)
        if not calls:
            raise StepContractError(
                f"{hook} returned without calling self(...); under AutoPipeStrategy the model "
                "runs as a pipeline per micro-batch slice and the step must take the slice's "
                f"outputs from self(...) (called exactly once), {WAY_OUT}"
            )
        for name, (value, options, given) in logged.items():
            self._logs.merge(name, value, options, n, given)
        if hook != "training_step":
            self._sizes.append(n)
            self._predictions.append(out)
            return _stand_in(outputs, training=False)
        loss = _loss_of(out)
        if isinstance(loss, torch.fx.Proxy):
            raise StepContractError(
                f"{hook} returned a value computed from a torch.fx Proxy: a tensor the forward "
                "stored on the module (such as self.aux_loss = ...) holds the trace's "
                "placeholder, not this slice's value, under AutoPipeStrategy; return it from "
                "forward instead (in a tuple or dict with the outputs) and read it there"
            )
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
                   else "None" if out is None else f"a {type(out).__name__}")
            raise StepContractError(
                f"training_step returned {got}; under "
                "AutoPipeStrategy every micro-batch slice must return its mean loss as a "
                "one-element tensor (or a dict with 'loss'): a step cannot be skipped by "
                f"returning None in one slice, {WAY_OUT}"
            )
        return loss.reshape(())

    def _payload(self, layout: Any, replica_weight: float = 1.0, replicas: int = 1
                 ) -> dict[str, Any]:
        """What the last stage sends: plain Python values and CPU tensors only."""
        failure = None
        if self._failure is not None:
            where = f"rank {layout.rank} (stage {layout.stage}, replica {layout.replica})"
            contract = isinstance(self._failure, StepContractError)
            failure = (contract, str(self._failure) if contract else describe(self._failure), where)
            return {"failure": failure, "logs": [], "joined": None}
        logs = self._logs.combined(replica_weight, replicas)
        joined = None
        if self._predictions:
            predicting = self._hook == "predict_step"
            try:  # any error here is the last stage's alone: shared below, never raised here
                self._joined = join_slices(self._predictions, self._sizes,
                                           evaluating=not predicting)
            except Exception as exc:  # noqa: BLE001 - e.g. torch.cat of unequal trailing sizes
                if predicting:
                    where = f"rank {layout.rank} (stage {layout.stage}, replica {layout.replica})"
                    self._failure = exc
                    contract = isinstance(exc, StepContractError)
                    failure = (contract, str(exc) if contract else describe(exc), where)
                else:  # nothing but a callback's `outputs` needs it: not worth a failed run
                    self._unjoinable(str(exc))
            else:
                if layout.num_stages > 1:
                    joined = self._for_other_stages(predicting)
        return {"failure": failure, "logs": logs, "joined": joined}

    def _for_other_stages(self, predicting: bool) -> Any:
        """The joined outputs as the other stages get them (CPU tensors). An evaluation step's
        outputs over :data:`SHIP_MAX_BYTES` (a language model's logits) stay on the last stage:
        the other stages get ``None`` rather than gigabytes every step."""
        if not predicting:
            size = sum(t.numel() * t.element_size() for t in tensors_in(self._joined))
            if size > SHIP_MAX_BYTES:
                self._unjoinable(f"{self._hook} returned {size / 2**20:.0f} MiB of tensors per "
                                 "batch, too much to send to the other stages every step; only "
                                 "the last stage's", everywhere=False)
                return None
        return apply_to_collection(self._joined, Tensor, lambda t: t.cpu())

    def _unjoinable(self, why: str, everywhere: bool = True) -> None:
        """An evaluation step's return value that cannot be joined (``everywhere``) or sent:
        warned once, ``None``."""
        if not self._warned_outputs:
            self._warned_outputs = True
            hook = "on_validation_batch_end" if self._hook == "validation_step" else (
                "on_test_batch_end")
            where = "" if everywhere else " on the other stages' ranks"
            warnings.warn(f"{why}; {hook} receives outputs=None for it{where}", UserWarning,
                          stacklevel=2)


def _agree(failure: Any, layout: Any, groups: Any, device: torch.device) -> Any:
    """The first failure of any replica, known to every rank (collective over the replicas)."""
    if layout.num_replicas < 2:
        return failure
    flag = torch.tensor([0.0 if failure is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.dp)
    if not flag.item():
        return None
    everyone: list[Any] = [None] * layout.num_replicas
    dist.all_gather_object(everyone, failure, group=groups.dp)
    return failure if failure is not None else next(f for f in everyone if f is not None)


#: What a step's loss term over ``self.parameters()`` covers here, and what works instead.
PENALTY = ("a loss term over them (an L2 penalty) covers that stage only; use the optimizer's "
           "weight_decay, or compute the term in forward and return it with the outputs")


def _stand_in(outputs: Any, training: bool) -> Tensor:
    """A zero loss for a slice that has no loss of its own (evaluation, or after a failure).

    In training it is tied to the outputs, so the schedule's backward still runs (and sends
    zero gradients upstream); the step is raised before the optimizer sees them.
    """
    found = [t for t in tensors_in(outputs) if t.is_floating_point()]
    device = found[0].device if found else None
    zero = torch.zeros((), device=device)
    if not training:
        return zero
    tied = [t for t in found if t.requires_grad]
    if not tied:
        return zero.requires_grad_()
    return sum((t.sum() * 0.0 for t in tied), zero)


def _loss_of(out: Any) -> Any:
    if isinstance(out, Mapping):
        return out.get("loss")
    return out
