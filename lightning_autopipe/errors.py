"""Exceptions raised at the public boundary; each message names the bad value and the fix."""

from __future__ import annotations

import pickle

__all__ = [
    "AutoPipeError",
    "TraceError",
    "BlockRangeError",
    "GraphRunError",
    "InputError",
    "OptionError",
    "ClusterError",
    "ScheduleError",
    "PlanError",
    "MemoryPlanError",
    "PipelineRuntimeError",
    "StepContractError",
    "UnsafeCheckpointError",
    "CheckpointReadError",
    "MissingExtraError",
]


class AutoPipeError(Exception):
    """Base class of every error this package raises on purpose."""


class TraceError(AutoPipeError, RuntimeError):
    """The model could not be captured as a graph (neither torch.fx nor torch.export)."""


class InputError(AutoPipeError, ValueError):
    """Inputs handed to the graph layer do not match what the model was traced with (or a
    loss handed to the profiler is not the scalar a pipeline's last stage needs)."""


class GraphRunError(InputError):
    """The traced graph failed on the example inputs at one node: the inputs do not fit the
    model, or (torch.fx) the graph does not compute what the model does. ``node`` names the
    node and ``reason`` the failure, so a caller can tell the two apart and say which."""

    def __init__(self, message: str, node: str, reason: str) -> None:
        super().__init__(message)
        self.node, self.reason = node, reason


class OptionError(AutoPipeError, ValueError):
    """A strategy option (or the argument of a public function that carries one, such as
    ``granularity`` or ``repeats``) has a value outside the ones it accepts."""


class BlockRangeError(AutoPipeError, IndexError):
    """A block range ``[i, j)`` or a list of cuts lies outside ``[0, len(blocks)]``."""


class ClusterError(AutoPipeError, ValueError):
    """A cluster description is malformed or contradicts the launched world."""


class ScheduleError(AutoPipeError, ValueError):
    """A pipeline schedule is inconsistent (order, send/receive matching, deadlock)."""


class PlanError(AutoPipeError, ValueError):
    """A plan cannot be made or used with the given model, batch and cluster."""


class MemoryPlanError(PlanError):
    """No plan (or the requested one) fits the devices' memory."""


class PipelineRuntimeError(AutoPipeError, RuntimeError):
    """A rank failed while running the pipeline; the message names the rank and the cause."""


class StepContractError(AutoPipeError, RuntimeError):
    """A LightningModule step does something the pipeline cannot run per micro-batch slice
    (calls ``self(...)`` twice or not at all, logs a value that cannot be combined)."""


class UnsafeCheckpointError(AutoPipeError, pickle.UnpicklingError):
    """A checkpoint holds a pickled object other than tensors and plain containers: loading it
    would run code from the file, so it is refused."""


class CheckpointReadError(AutoPipeError, ValueError):
    """A checkpoint cannot be read: the file is empty, truncated, not a checkpoint, or a
    shard of a sharded checkpoint is missing or damaged."""


class MissingExtraError(AutoPipeError, ImportError):
    """A feature needs a package of an optional extra that is not installed."""
