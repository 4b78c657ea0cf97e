"""``AutoPipeStrategy``: Lightning's Trainer runs the model as a data-parallel pipeline.

The LightningModule contract
----------------------------
* ``forward`` is what gets traced (``lightning_autopipe.graph.split_model``) and cut into
  pipeline stages; only tensors may cross stage boundaries.
* ``pipeline_loss(self, outputs, batch) -> Tensor`` returns the *mean* loss of one micro-batch
  slice; it runs on the last stage with ``outputs`` shaped like ``forward``'s and ``batch``
  sliced along dim 0 consistently with the inputs (every tensor whose first dimension is the
  batch size is sliced; other values pass unchanged). Each slice's loss is weighted by its
  sample count, so gradients equal whole-batch training on one process.
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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.runtime.groups import destroy_groups
from lightning_autopipe.runtime.pipeline import LocalPipeline, build_local_pipeline, search_plan

__all__ = ["AutoPipeStrategy"]

log = logging.getLogger(__name__)
_SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


def _auto_or_positive(name: str, value: Any) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be 'auto' or a positive int, got {value!r}")
    return value


class AutoPipeStrategy(ParallelStrategy):
    """Data-parallel 1F1B pipeline with split startup micro-batches (AutoPipe-H).

    Registered as ``"autopipe"`` when ``lightning_autopipe`` is imported. See the module
    docstring for what the LightningModule must provide.

    Args:
        cluster: a ``Cluster``, a cluster YAML path, or None for "the launched processes as
            one homogeneous server" (``Cluster.local``).
        planner: planner name handed to ``make_plan`` (``"autopipe"``, baselines...).
        num_stages: pipeline depth, or ``"auto"`` (every depth dividing the world is planned
            and the one with the most samples/s wins).
        num_microbatches: micro-batches per replica and step, or ``"auto"``.
        startup_slices: slices of micro-batch 0, or ``"auto"``.
        granularity: block granularity for ``split_model`` (``"sub-block"``...).
        plan: a ``Plan`` or a path to one saved with ``Plan.save``: skip profiling/planning.
        timeout: seconds (or a ``timedelta``) for the process group and every sub-group, so a
            failed peer ends the run instead of hanging it.
        start_method: ``"popen"`` (re-run the script per rank) or ``"spawn"`` / ``"fork"``.
        profile_repeats: timed repeats per block when profiling.
        val_loss_name / test_loss_name: names the forward-only loss is logged under.
        bucket_mb: gradient all-reduce bucket size.
        process_group_backend: override gloo/NCCL.
    """

    strategy_name = "autopipe"

    def __init__(
        self,
        cluster: Any = None,
        planner: str = "autopipe",
        num_stages: int | str = "auto",
        num_microbatches: int | str = "auto",
        startup_slices: int | str = "auto",
        granularity: str = "sub-block",
        plan: Plan | str | Path | None = None,
        timeout: float | timedelta = 120.0,
        start_method: str = "popen",
        profile_repeats: int = 3,
        val_loss_name: str = "val_loss",
        test_loss_name: str = "test_loss",
        bucket_mb: float = 25.0,
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', not "
                f"{start_method!r}"
            )
        self._cluster_arg = cluster
        self.planner = planner
        self.num_stages = _auto_or_positive("num_stages", num_stages)
        self.num_microbatches = _auto_or_positive("num_microbatches", num_microbatches)
        self.startup_slices = _auto_or_positive("startup_slices", startup_slices)
        self.granularity = granularity
        self._plan_arg = plan
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if not seconds > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self._timeout = timedelta(seconds=seconds)
        self._start_method = start_method
        self.profile_repeats = int(profile_repeats)
        self.val_loss_name = val_loss_name
        self.test_loss_name = test_loss_name
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._process_group_backend = process_group_backend
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
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
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

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    # ----------------------------------------------------------------------------- setup
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fn = trainer.state.fn
        if fn == TrainerFn.PREDICTING:
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
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision not in _SUPPORTED_PRECISION:
            raise PlanError(
                f"precision {precision!r} is not supported by AutoPipeStrategy; use one of "
                f"{list(_SUPPORTED_PRECISION)}"
            )
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise PlanError(
                "AutoPipeStrategy needs automatic optimization (the schedule runs forward and "
                "backward itself); remove `self.automatic_optimization = False`"
            )
        example, batch_size = _example(trainer, module)
        self._pipe = build_local_pipeline(
            module,
            example,
            batch_size,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            plan_fn=self._plan_fn(batch_size),
            plan_given=self._plan_arg is not None,
            broadcast=self.broadcast,
            granularity=self.granularity,
            profile_repeats=self.profile_repeats,
            cluster_arg=self._cluster_arg,
            backend=self._process_group_backend,
            timeout=self._timeout,
            bucket_bytes=self.bucket_bytes,
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

    def _plan_fn(self, batch_size: int) -> Callable[[Any, Any, list[str]], Plan]:
        def plan_fn(profile: Any, cluster: Any, names: list[str]) -> Plan:
            if self._plan_arg is not None:
                plan = self._plan_arg
                return plan if isinstance(plan, Plan) else Plan.load(plan)
            return search_plan(
                profile,
                cluster,
                names,
                batch_size,
                planner=self.planner,
                num_stages=self.num_stages,
                num_microbatches=self.num_microbatches,
                startup_slices=self.startup_slices,
            )

        return plan_fn

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

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    # ---------------------------------------------------------------------- step hooks
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
        with self.precision_plugin.train_step_context():
            loss = self._pipe.executor.train_step(batch)
        self._grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return loss

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

    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._eval_step(
            args, kwargs, self.val_loss_name, self.precision_plugin.val_step_context
        )

    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._eval_step(
            args, kwargs, self.test_loss_name, self.precision_plugin.test_step_context
        )

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("AutoPipeStrategy does not run predict(); use strategy='auto'")

    def _eval_step(self, args: Any, kwargs: Any, name: str, context: Callable) -> Tensor:
        assert self._pipe is not None
        assert self.lightning_module is not None
        batch = args[0] if args else kwargs["batch"]
        with context():
            loss = self._pipe.executor.eval_step(batch)
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

    # ------------------------------------------------------------------- collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoint state
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's ``state_dict`` under the original names, on every rank.

        Each rank holds one stage; replica 0 of every stage contributes its tensors, so a
        checkpoint written by rank 0 loads into the plain module (e.g. under
        ``strategy="auto"``). Optimizer state stays per stage.
        """
        module = self.lightning_module
        assert module is not None
        local = module.state_dict()
        if self._pipe is None or not _distributed_is_initialized() or self.world_size == 1:
            return local
        mine = {k: v.detach().cpu() for k, v in local.items()}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine if self._pipe.layout.replica == 0 else {})
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        return merged

    # ------------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._pipe is not None:
            module._example_input_array = self._hidden_example
        if "clip_grad_by_norm" in vars(self.precision_plugin):
            del self.precision_plugin.clip_grad_by_norm
        if self._pipe is not None and self._pipe.groups is not None:
            destroy_groups(self._pipe.groups)
        self._pipe = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="AutoPipe-H: heterogeneity-aware data-parallel pipeline",
            override=True,
        )


def _example(trainer: Any, module: Any) -> tuple[Any, int]:
    """Example forward inputs (``example_input_array`` or the first batch) and the batch size.

    The batch size is the dataloader's (one data-parallel replica's batch); it sizes the plan.
    """
    from lightning_autopipe.runtime.local_stage import as_call_args, model_inputs

    fitting = trainer.state.fn == TrainerFn.FITTING
    loop = trainer.fit_loop if fitting else _eval_loop(trainer)
    loader = loop._data_source.dataloader()
    if isinstance(loader, list | tuple):
        loader = loader[0]
    batch = None
    size = getattr(loader, "batch_size", None)
    example = module.example_input_array
    if example is None or not size:
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise PlanError("the dataloader is empty; AutoPipeStrategy needs a batch") from None
        inputs = as_call_args(model_inputs(module, batch))
        first = next(iter(inputs.values() if isinstance(inputs, dict) else inputs))
        size = size or int(first.shape[0])
        if example is None:
            example = inputs
    return as_call_args(example), int(size)


def _eval_loop(trainer: Any) -> Any:
    if trainer.state.fn == TrainerFn.VALIDATING:
        return trainer.validate_loop
    return trainer.test_loop


def _register() -> None:
    """Put ``"autopipe"`` in Lightning's registry (idempotent; run on package import)."""
    from lightning.pytorch.strategies import StrategyRegistry

    AutoPipeStrategy.register_strategies(StrategyRegistry)
