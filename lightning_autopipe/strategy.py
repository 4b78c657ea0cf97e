"""``AutoPipeStrategy``: Lightning's Trainer runs the model as a data-parallel pipeline.

The LightningModule contract
----------------------------
* ``forward`` is what gets traced (``lightning_autopipe.graph.split_model``) and cut into
  pipeline stages; only tensors may cross stage boundaries.
* ``pipeline_loss(self, outputs, batch) -> Tensor`` returns the *mean* loss of one micro-batch
  slice; it runs on the last stage with ``outputs`` shaped like ``forward``'s and ``batch``
  sliced along dim 0 consistently with the inputs (every tensor whose first dimension is the
  batch size is sliced; other values pass unchanged; a tensor with another first dimension is
  refused as a likely data bug unless ``check_batch=False``). Each slice's loss is weighted by
  its sample count, so gradients equal whole-batch training on one process.
* Forward inputs come from ``pipeline_inputs(self, batch)`` when defined, else ``batch[0]`` for
  a tuple/list batch, else the batch itself (a tensor, tuple of positional tensors, or dict of
  keyword tensors).
* ``training_step`` / ``validation_step`` are not called under this strategy (the schedule runs
  the forward, loss and backward itself), so the same module still trains with
  ``strategy="auto"`` unchanged. The strategy's training step returns the global-batch mean
  loss, which Lightning hands to ``on_train_batch_end(outputs=...)`` (log the train loss there);
  validation / test run a forward-only pipeline and log ``val_loss`` / ``test_loss``.
* Before ``configure_optimizers`` runs, the module's parameters are rebound to the local stage's
  (``self.parameters()`` yields exactly this rank's stage, under the original names; other
  stages' parameters are released), so ``torch.optim.X(self.parameters())`` is stage-local.
  Build optimizers only from ``self.parameters()`` / ``named_parameters()`` inside
  ``configure_optimizers``. The module is consumed by ``fit``: build a new one to fit again.
* The dataloader's batch size is the batch of one data-parallel replica (as with DDP, the
  global batch is ``batch_size x replicas``); every stage of a replica loads the same batches.
* Batch norm normalises over each micro-batch slice (statistics per slice, as a single process
  running those slices one after another would).
* ``accumulate_grad_batches`` must be 1: micro-batching is the plan's ``num_microbatches``.
* Gradient clipping by norm uses the norm over all stages (tied copies counted once).
* Precision ``32-true`` and ``bf16-mixed``.

Checkpoints and failures
------------------------
* ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write the whole model's ``state_dict`` and
  every optimizer's state under the *original* parameter names (one file written by rank 0;
  ``checkpoint_format="sharded"`` writes a ``torch.distributed.checkpoint`` directory, one shard
  per stage). Resuming (``fit(ckpt_path=...)``) works into any layout, from and to
  ``strategy="auto"`` (``lightning_autopipe.checkpoint``). Files are replaced atomically.
* Every send/receive/collective runs under ``timeout``; a rank that fails posts its error
  (rank, stage, step, action, exception) and every other rank raises ``PipelineRuntimeError``
  naming it, so the launcher ends the job instead of hanging.
* A non-finite training loss raises (naming the step and the first stage whose outputs were
  non-finite) unless ``nonfinite_loss="skip"``, which drops that step's gradients on every rank.

Options are :class:`~lightning_autopipe.options.AutoPipeOptions`. This module runs past the
house's ~450 lines because Lightning's strategy interface is wide (some thirty hooks and
properties, each marked ``@override``); every hook stays a few lines that delegate to
``runtime/`` and ``checkpoint/``, and the rest is this contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_autopipe import checkpoint as ckpt
from lightning_autopipe.errors import PipelineRuntimeError, PlanError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.runtime.checks import check_microbatches
from lightning_autopipe.runtime.example import _example
from lightning_autopipe.runtime.failure import describe, watch_launcher
from lightning_autopipe.runtime.groups import destroy_groups
from lightning_autopipe.runtime.pipeline import LocalPipeline, build_local_pipeline

__all__ = ["AutoPipeStrategy"]

_SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


class AutoPipeStrategy(ParallelStrategy):
    """Data-parallel 1F1B pipeline with split startup micro-batches (AutoPipe-H).

    Registered as ``"autopipe"`` when ``lightning_autopipe`` is imported. See the module
    docstring for what the LightningModule must provide.

    Args:
        options: an :class:`~lightning_autopipe.options.AutoPipeOptions`; default: the
            defaults.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            Lightning's, as for any parallel strategy.
        **option_overrides: any field of ``AutoPipeOptions`` by name (``num_stages=2``,
            ``timeout=60``, ``cluster="conf/cluster/mixed_rack.yaml"`` ...), applied over
            ``options``; each is documented there, once.

    Raises:
        TypeError: an option name that ``AutoPipeOptions`` does not have.
        ValueError: an option's value is invalid (``PlanError`` for the plan counts); the
            message names the value and the valid ones.
    """

    strategy_name = "autopipe"

    def __init__(
        self,
        options: AutoPipeOptions | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any = None,
        **option_overrides: Any,
    ) -> None:
        self.options = AutoPipeOptions.build(options, option_overrides)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._backend = self.options.process_group_backend  # resolved in setup_environment
        # Outlives teardown so trainer.save_checkpoint after fit still gathers the stages.
        self._checkpoint: ckpt.PipelineCheckpoint | None = None
        self._watch: Any = None
        self._num_nodes = 1
        self._pipe: LocalPipeline | None = None
        self._grads: list[Tensor | None] | None = None
        self._hidden_example: Any = None
        # Filled by setup (the recipes' plan report reads them):
        self.plan: Plan | None = None
        self.profile: Any = None
        self.cluster: Any = None

    # ------------------------------------------------------------------ Lightning plumbing
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

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel rank/size: every stage of one replica loads the same batches."""
        if self._pipe is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        layout = self._pipe.layout
        return {"num_replicas": layout.num_replicas, "rank": layout.replica}

    @property
    def pipeline(self) -> LocalPipeline | None:
        """This rank's stage, layout, groups and executor (after setup)."""
        return self._pipe

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        start_method = self.options.start_method
        if start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._backend = self._backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(
            self.cluster_environment, self._backend, timeout=self.options.timeout_delta
        )
        if self.local_rank > 0:  # launched by rank 0 of this node: do not outlive its failure
            self._watch = watch_launcher(self.global_rank)
            if self._watch is not None:
                self._watch.arm()

    # ----------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fn = trainer.state.fn
        _check_trainer(trainer, self.precision_plugin)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise PlanError(
                "AutoPipeStrategy needs automatic optimization (the schedule runs forward and "
                "backward itself); remove `self.automatic_optimization = False`"
            )
        example, batch_size, example_batch = _example(trainer, module)
        pins = self.options.pins
        check_microbatches(
            batch_size,
            pins["num_microbatches"],
            pins["startup_slices"],
            drain_slices=pins["drain_slices"],
        )
        param_order = [name for name, _ in module.named_parameters()]
        state_order = list(module.state_dict().keys())
        self._pipe = build_local_pipeline(
            module,
            example,
            batch_size,
            self.options,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            broadcast=self.broadcast,
            backend=self._backend,
            example_batch=example_batch,
            num_nodes=self.num_nodes,
        )
        self._checkpoint = ckpt.PipelineCheckpoint(
            self._pipe.layout, param_order, state_order, self.options.checkpoint_format
        )
        self.plan, self.profile, self.cluster = (
            self._pipe.plan,
            self._pipe.profile,
            self._pipe.cluster,
        )
        rank_zero_info(self._pipe.table)
        # The summary callback would run the full forward on example_input_array; the module
        # now holds one stage only, so the example is hidden during the run.
        self._hidden_example = module._example_input_array
        module._example_input_array = None
        self.model = module
        self.model_to_device()
        if fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        executor = self._pipe.executor
        self.precision_plugin.clip_grad_by_norm = (  # type: ignore[method-assign]
            lambda optimizer, clip_val: executor.clip_grad_norm_(float(clip_val))
        )

    def _check_optimizers(self) -> None:
        assert self._pipe is not None
        local = {id(p) for p in self._pipe.stage.parameters()}
        for opt in self.optimizers:
            foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in local]
            if foreign:
                raise PlanError(
                    f"an optimizer holds {len(foreign)} parameters that are not in this rank's "
                    f"stage {self._pipe.layout.stage}; build optimizers from self.parameters() "
                    "inside configure_optimizers (the strategy rebinds them to the local stage)"
                )

    @override
    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    # ---------------------------------------------------------------------- step hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the whole schedule (every forward and backward) and sync the gradients.

        Lightning zeroes gradients *between* ``training_step`` and ``backward``, so the
        gradients are put aside here and handed back in :meth:`backward`.
        """
        assert self._pipe is not None
        batch = args[0] if args else kwargs["batch"]
        params = self._pipe.executor.parameters
        for p in params:
            p.grad = None
        step = self.lightning_module.trainer.global_step if self.lightning_module else None
        with self.precision_plugin.train_step_context():
            loss = self._pipe.executor.train_step(batch, step=step)
        self._grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if not bool(torch.isfinite(loss)):
            self._on_nonfinite(loss, step)
        return loss

    def _on_nonfinite(self, loss: Tensor, step: int | None) -> None:
        """Every rank holds the same global loss, so every rank takes the same branch."""
        assert self._pipe is not None
        where = self._pipe.nonfinite_origin()
        if self.options.nonfinite_loss == "skip":
            rank_zero_warn(
                f"non-finite training loss {float(loss)} at step {step} ({where}); skipping the "
                "step: its gradients are dropped on every rank"
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
        """Install the gradients the schedule computed; the before/after-backward hooks run."""
        assert self._pipe is not None
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._grads is not None:
            for p, g in zip(self._pipe.executor.parameters, self._grads):
                p.grad = g
            self._grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._eval_step(
            args, kwargs, self.options.val_loss_name, self.precision_plugin.val_step_context
        )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._eval_step(
            args, kwargs, self.options.test_loss_name, self.precision_plugin.test_step_context
        )

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("AutoPipeStrategy does not run predict(); use strategy='auto'")

    def _eval_step(self, args: Any, kwargs: Any, name: str, context: Callable) -> Tensor:
        assert self._pipe is not None
        assert self.lightning_module is not None
        batch = args[0] if args else kwargs["batch"]
        index = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        with context():
            loss = self._pipe.executor.eval_step(batch, step=index)
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

    # ------------------------------------------------------------------- collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------- checkpoints (lightning_autopipe.checkpoint)
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
        pipe = self._gathering()
        if pipe is not None and pipe.sharded:
            pipe.save_sharded(checkpoint, filepath, barrier=self.barrier)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Either format; runs before ``setup`` (the module is still whole)."""
        if not ckpt.is_sharded(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        return ckpt.load_sharded(checkpoint_path, state, no_dist=not _distributed_is_initialized())

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

    # ------------------------------------------------------------------------ failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Post this rank's failure for its peers (the executor already posted its own)."""
        board = self._pipe.executor.failures if self._pipe is not None else None
        if board is not None:
            board.post(f"rank {self.global_rank} failed: {describe(exception)}")
        super().on_exception(exception)

    # ------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._pipe is not None:
            module._example_input_array = self._hidden_example
        if "clip_grad_by_norm" in vars(self.precision_plugin):
            del self.precision_plugin.clip_grad_by_norm
        if self._pipe is not None:
            self._pipe.executor.close()  # its hooks hold the groups: release them first
            if self._pipe.groups is not None:
                destroy_groups(self._pipe.groups)
        self._pipe = None
        if self._watch is not None:
            self._watch.disarm()
        super().teardown()


def _check_trainer(trainer: Any, precision_plugin: Any) -> None:
    """What the Trainer asks for must be something the pipeline runs (checked at setup)."""
    if trainer.state.fn == TrainerFn.PREDICTING:
        raise NotImplementedError(
            "AutoPipeStrategy does not run predict(); predict with strategy='auto' on the "
            "trained weights"
        )
    if trainer.accumulate_grad_batches != 1:
        raise PlanError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported by "
            "AutoPipeStrategy; the pipeline already accumulates over micro-batches: raise "
            "num_microbatches or the batch size instead"
        )
    precision = getattr(precision_plugin, "precision", "32-true")
    if precision not in _SUPPORTED_PRECISION:
        raise PlanError(
            f"precision {precision!r} is not supported by AutoPipeStrategy; use one of "
            f"{list(_SUPPORTED_PRECISION)}"
        )
