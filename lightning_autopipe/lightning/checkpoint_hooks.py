"""The strategy's checkpoint hooks: the whole model under its original names, any layout.

Lightning asks the strategy for the model's and the optimizers' state, to save, to read and to
load a checkpoint. A pipeline holds one stage per rank, so these hooks gather the stages
(collectives), write one consolidated file on rank 0 or a sharded directory from every rank,
and load either format into whatever layout this run has: the work is
:mod:`lightning_autopipe.checkpoint`'s, these hooks only choose between it and Lightning's
own behaviour for a module that is not split. Kept apart from
:mod:`~lightning_autopipe.lightning.strategy` as a base class of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.strategies.parallel import ParallelStrategy
from typing_extensions import override

from lightning_autopipe import checkpoint as ckpt
from lightning_autopipe.lightning import elastic, finetuning
from lightning_autopipe.lightning.held_pipeline import HeldPipeline
from lightning_autopipe.runtime.materialize import is_deferred

__all__ = ["CheckpointHooks"]


class CheckpointHooks(ParallelStrategy):
    """Save, read and load checkpoints of a model split over the ranks.

    The concrete strategy (:class:`~lightning_autopipe.lightning.strategy.AutoPipeStrategy`)
    sets the attributes below (``_checkpoint`` when it adopts a pipeline).
    """

    _held: HeldPipeline
    _checkpoint: ckpt.PipelineCheckpoint | None
    _initial_state: Any
    _resumed: tuple[Any, Any, Any] | None
    num_nodes: int

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's torch checkpoint IO with atomic (temp file + fsync + replace) writes."""
        self._checkpoint_io = ckpt.with_atomic_writes(self._checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _gathering(self) -> ckpt.PipelineCheckpoint | None:
        """The checkpoint side of a pipeline whose parts live on several ranks, else None."""
        pipe = self._checkpoint
        return pipe if pipe is not None and pipe.pipelined else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's ``state_dict`` under the original names (collective)."""
        pipe = self._gathering()
        if pipe is None:
            return super().lightning_module_state_dict()
        assert self.lightning_module is not None
        return pipe.model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by original names, every stage merged (collective)."""
        pipe = self._gathering()
        if pipe is None:
            return super().optimizer_state(optimizer)
        assert self.lightning_module is not None
        return pipe.optimizer_state(optimizer, self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Rank 0 writes the consolidated file atomically; sharded: every rank writes its part."""
        held = self._held.pipe
        checkpoint[elastic.RECORD_KEY] = elastic.checkpoint_record(
            self.world_size, self.num_nodes, held.layout if held is not None else None,
            checkpoint.get("global_step", 0),
        )
        pipe = self._gathering()
        if pipe is not None:
            finetuning.record_whole_groups(checkpoint, getattr(self.lightning_module, "_trainer",
                                                               None))
        if pipe is not None and pipe.sharded:
            pipe.save_sharded(checkpoint, filepath, barrier=self.barrier)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Read the checkpoint (:meth:`_read_checkpoint`); a fit logs what its resume lost."""
        checkpoint = self._read_checkpoint(checkpoint_path, weights_only)
        if isinstance(checkpoint, dict) and self.global_rank == 0:
            note = elastic.ProgressNote(Path(str(checkpoint_path)).parent).read()
            self._resumed = (checkpoint_path, elastic.resume_facts(checkpoint), note)
        return checkpoint

    def _read_checkpoint(self, checkpoint_path: Any, weights_only: bool | None) -> Any:
        """Either format, tensors and plain containers only unless ``weights_only=False``.

        Runs before ``setup``: the module is whole, or (after ``fit``) still split by this
        strategy, and then only this rank's stage is read from a sharded directory.
        """
        weights_only = True if weights_only is None else weights_only
        if self._deferred():  # built on the meta device: each rank reads its stage later
            return ckpt.load_for_stage(checkpoint_path, weights_only=weights_only,
                                       no_dist=not _distributed_is_initialized())
        with ckpt.refusing_unsafe(checkpoint_path):
            if not ckpt.is_sharded(checkpoint_path):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            module = self.lightning_module
            assert module is not None
            return ckpt.load_sharded(
                checkpoint_path, module.state_dict(), no_dist=not _distributed_is_initialized(),
                partial=self._held.is_split(module), weights_only=weights_only,
            )

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A whole-model ``state_dict`` into a module this strategy split: its stage's part."""
        module = self.lightning_module
        if self._deferred():  # read by name when the local stage is materialised
            self._initial_state = checkpoint["state_dict"]
            return
        if module is None or not self._held.is_split(module):
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        if not self._held.serves(module):
            self._held.check_splittable(module)  # raises: another pipeline split it
        local = module.state_dict()
        module.load_state_dict(
            ckpt.stage_model_state(checkpoint["state_dict"], local, strict=strict), strict=strict
        )

    def _deferred(self) -> bool:
        """The module is whole but on the meta device (built in ``configure_model``)."""
        module = self.lightning_module
        return module is not None and not self._held.is_split(module) and is_deferred(module)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Re-shard the saved (whole-model, name-keyed) optimizer state onto the local stage."""
        if self._checkpoint is None:  # not set up: nothing was split
            super().load_optimizer_state_dict(checkpoint)
            return
        assert self.lightning_module is not None
        self._checkpoint.load_optimizer_states(
            checkpoint["optimizer_states"], self.optimizers, self.lightning_module,
            self.root_device,
        )
