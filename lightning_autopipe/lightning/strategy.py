"""``AutoPipeStrategy``: Lightning's Trainer runs the model as a data-parallel pipeline.

The LightningModule contract (what runs where, logging, prediction, optimizers, data,
precision) is ``docs/usage.md``; checkpoints and failures ``docs/checkpoints.md``; elastic
restarts ``docs/elastic.md``; telemetry and re-planning ``docs/telemetry.md``. In short:
``forward`` is traced and cut into stages, the module's own steps run per micro-batch slice on
the last stage (:mod:`~lightning_autopipe.lightning.steps`), ``self.log`` is combined over the
step, optimizers see the local stage's parameters under their original names, checkpoints hold
the whole model under those names and load into any layout, and every collective runs under
the strategy's ``timeout`` so a failing rank ends the job with its error.

Options are :class:`~lightning_autopipe.options.AutoPipeOptions`; what can be checked before
processes start is checked in the launching process
(:mod:`~lightning_autopipe.lightning.prelaunch`).
Three base classes hold the rest of Lightning's wide strategy interface: the process world
(ranks, launcher, process group, collectives: :mod:`~lightning_autopipe.lightning.process_world`),
the step hooks (:mod:`~lightning_autopipe.lightning.step_hooks`) and the checkpoint hooks
(:mod:`~lightning_autopipe.lightning.checkpoint_hooks`); this module keeps the pipeline's
setup (trace, measure, plan, build), live re-planning, failures and teardown. It stays a little
past ~400 lines because those four share the held pipeline's private state (the pipeline, its
executor's precision hooks, BatchNorm's step work, the checkpoint layout), which a re-plan
switch replaces exactly as setup first installs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_autopipe import checkpoint as ckpt
from lightning_autopipe.errors import PlanError
from lightning_autopipe.lightning import elastic, finetuning, summary
from lightning_autopipe.lightning.checkpoint_hooks import CheckpointHooks
from lightning_autopipe.lightning.example import _example
from lightning_autopipe.lightning.held_pipeline import (
    HeldPipeline,
    destroy_pipeline_groups,
    destroy_released_groups,
    mark_in_run,
)
from lightning_autopipe.lightning.local_optimizers import make_local_optimizers
from lightning_autopipe.lightning.optimizer_state import with_measured_optimizer_state
from lightning_autopipe.lightning.precision import install_loss_scaling
from lightning_autopipe.lightning.prelaunch import (
    check_module,
    check_trainer,
)
from lightning_autopipe.lightning.process_world import ProcessWorld
from lightning_autopipe.lightning.replan import Replanner, SwitchRecord, write_plan
from lightning_autopipe.lightning.report_once import shown_by_rank_zero
from lightning_autopipe.lightning.reproducible import BatchNormSteps, reproducible_options
from lightning_autopipe.lightning.reproducible import note as reproducible_note
from lightning_autopipe.lightning.sampler import elastic_replica_batch, stripe_for_layout
from lightning_autopipe.lightning.stage_parameters import gradient_hooks_warned
from lightning_autopipe.lightning.step_hooks import StepHooks, epoch_end_note
from lightning_autopipe.lightning.steps import StepRunner
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.runtime.batchnorm import has_batch_norm
from lightning_autopipe.runtime.checks import check_microbatches
from lightning_autopipe.runtime.compiled_stage import check_backend
from lightning_autopipe.runtime.failure import describe
from lightning_autopipe.runtime.materialize import deferred_init
from lightning_autopipe.runtime.pipeline import LocalPipeline, build_local_pipeline
from lightning_autopipe.runtime.replan import switch_pipeline

__all__ = ["AutoPipeStrategy"]


class AutoPipeStrategy(CheckpointHooks, StepHooks, ProcessWorld):
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
        check_backend(self.options.compile)
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
        self._held = HeldPipeline()  # outlives teardown: validate / test / predict / fit again
        self._warned_hooks: set[str] = set()  # hooks warned of reading a stage's parameters
        self._warned_numbers: set[str] = set()  # numbers warned of changing since the capture
        self._failed = False
        self._summary_params: list[summary.ParamInfo] = []
        self._summaries: list[Any] = []
        self._grads: list[Tensor | None] | None = None
        self._hidden_example: Any = None
        self._initial_state: Any = None  # a checkpoint's weights for a meta-device module
        self._orders: tuple[list[str], list[str]] = ([], [])  # the whole model's names
        self._replanner = Replanner()
        self._bn: BatchNormSteps | None = None  # BatchNorm's step work for the held pipeline
        self._resumed: tuple[Any, Any, Any] | None = None  # (path, its facts, progress note)
        self._progress = elastic.ProgressNote(None)
        # Filled by setup (the recipes' plan report reads them):
        self.plan: Plan | None = None
        self.profile: Any = None
        self.cluster: Any = None

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """Lightning accumulates (``accumulate_grad_batches``): it runs the closure of each
        batch of a window and steps the optimizer after the last; each batch is one pipeline
        step whose gradients :meth:`backward` adds to the window's (:mod:`.step_hooks`)."""
        return False

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
        """This rank's stage, layout, groups and executor (after setup; kept after a run)."""
        return self._held.pipe

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Modules built here (``configure_model``, ``trainer.init_module()``) get their
        parameters on the meta device, buffers real: each rank materialises only its own stage
        (:mod:`lightning_autopipe.runtime.materialize`). ``empty_init=False`` builds for real."""
        if empty_init is False:
            with super().tensor_init_context(empty_init=False):
                yield
            return
        with deferred_init(), self.precision_plugin.tensor_init_context():
            yield

    # ----------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        mark_in_run(True)
        fn = trainer.state.fn
        check_trainer(trainer, self.precision_plugin)
        module = self.lightning_module
        assert module is not None
        check_module(module)
        if not self._held.serves(module):
            batch_norm = has_batch_norm(module)  # before the split: any stage's
            # an error every rank raises alike: one traceback (rank 0's), from here down
            shown_by_rank_zero(self.global_rank, lambda: self._build(trainer, module))
            self._note_batch_norm(batch_norm)
        else:  # the same module again (validate / test / predict / fit after fit)
            assert self._pipe is not None
            self._pipe.stage.to(self.root_device)  # teardown moved the module to the CPU
        # The summary callback would run the full forward on example_input_array; the module
        # now holds one stage only, so the example is hidden during the run and the summary
        # counts the whole model from the table taken before the split.
        self._hidden_example = module._example_input_array
        module._example_input_array = None
        self._summaries = summary.install(trainer, self._summary_params)
        self.model = module
        self.model_to_device()
        if fn == TrainerFn.FITTING:
            def make() -> None:  # a failure of either stops every rank with it
                finetuning.narrow_to_stage(trainer, module)  # before on_fit_start restores
                self.setup_optimizers(trainer)

            make_local_optimizers(make,
                                  lambda: self.optimizers, self._check_optimizers,
                                  device=self.root_device, distributed=self.world_size > 1)
            self._replanner.start_fit(self)
        self.setup_precision_plugin()
        self._install_executor()
        if fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _install_executor(self) -> None:
        """The precision plugin's loss scaling and clipping run on the current executor."""
        assert self._pipe is not None
        install_loss_scaling(self.precision_plugin, self._pipe.executor)  # 16-mixed only
        executor = self._pipe.executor
        self.precision_plugin.clip_grad_by_norm = (  # type: ignore[method-assign]
            lambda optimizer, clip_val: executor.clip_grad_norm_(float(clip_val))
        )

    def _build(self, trainer: Any, module: Any) -> None:
        """Trace, profile, plan and keep this rank's stage (every rank, collectively)."""
        self._held.release()
        destroy_released_groups()  # this one's and collected strategies', on every rank at once
        self._held.check_splittable(module)
        runner = StepRunner(module)
        example, batch_size, example_batch = _example(trainer, module)
        batch_size = elastic_replica_batch(trainer, self.options, self.world_size, batch_size)
        options = reproducible_options(self.options, batch_size)  # deterministic=True: fixed
        options = with_measured_optimizer_state(options, module,
                                                trainer.state.fn == TrainerFn.FITTING)
        pins = options.pins
        check_microbatches(
            batch_size,
            pins["num_microbatches"],
            pins["startup_slices"],
            drain_slices=pins["drain_slices"],
        )
        param_order = [name for name, _ in module.named_parameters()]
        state_order = list(module.state_dict().keys())
        self._summary_params = summary.whole_model_parameters(module)
        pipe = build_local_pipeline(
            module,
            example,
            batch_size,
            options,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            broadcast=self.broadcast,
            backend=self._backend,
            # The module's own steps are not run to profile the loss: they may update metrics.
            example_batch=example_batch if runner.uses_pipeline_loss else None,
            num_nodes=self.num_nodes,
            run_dir=_run_dir(trainer) if self.global_rank == 0 else None,
            loss_fn=runner,
            initial_state=self._initial_state,
        )
        self._initial_state = None
        self._orders = (param_order, state_order)
        self._adopt(pipe, module, runner)
        rank_zero_info(pipe.table)
        plan_dir = self._plan_dir()
        if plan_dir is not None:
            write_plan(plan_dir, pipe.plan, 0)
        self._note_attempt(trainer)

    def _adopt(self, pipe: LocalPipeline, module: Any, runner: StepRunner) -> None:
        """Hold ``pipe`` (releasing the earlier one) and point checkpoints at its layout."""
        self._held.hold(self, pipe, module, runner)
        runner.partial = pipe.layout.num_stages > 1  # other stages' parameters are released
        self._checkpoint = ckpt.PipelineCheckpoint(
            pipe.layout, *self._orders, self.options.checkpoint_format, pipe.executor.failures
        )
        self.plan, self.profile, self.cluster = pipe.plan, pipe.profile, pipe.cluster

    def _plan_dir(self) -> Path | None:
        """Rank 0's folder for ``plan.json`` and ``plans/`` (beside ``cluster.yaml``)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return _run_dir(trainer) if self.global_rank == 0 and trainer is not None else None

    # ------------------------------------------------------------------- live re-planning
    @property
    def switches(self) -> list[SwitchRecord]:
        """Every live switch of plans so far (``replan="auto"``), in order."""
        return self._replanner.switches

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """The optimizer step, then the re-plan boundary (:mod:`.replan`). A hook of the step
        that reads ``self.parameters()`` of a split model is warned once
        (:mod:`.stage_parameters`): a gradient norm over them is this stage's."""
        split = self._pipe is not None and self._pipe.layout.num_stages > 1
        with gradient_hooks_warned(self.lightning_module, split, self._warned_hooks):
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._replanner.after_optimizer_step(self)
        return out

    def _switch_to(self, plan: Plan, step: int, cluster: Any = None) -> Any:
        """Every rank: this rank's state migrated in memory to ``plan``'s layout (collective);
        the new pipeline carries ``cluster`` (the measured speeds ``plan`` was made for).

        The new pipeline is held as soon as it is built (a failure later releases it with the
        run); the old pipeline's process groups are destroyed on every rank together.
        Returns the migration's :class:`~lightning_autopipe.runtime.migrate.MigrationStats`.
        """
        assert self._pipe is not None
        module, runner, old = self._held.module, self._held.runner, self._pipe
        scaler = getattr(self.precision_plugin, "scaler", None)
        if getattr(self.precision_plugin, "precision", None) != "16-mixed":
            scaler = None
        _, migrated = switch_pipeline(
            self._pipe, plan, self.optimizers, scaler=scaler, step=step,
            timeout=self.options.timeout_delta,
            on_built=lambda new: self._adopt(new, module, runner), cluster=cluster,
        )
        destroy_pipeline_groups(old.groups)  # on every rank at once
        if self._bn is not None:  # BatchNorm's step work, on the new stage
            self._bn.close()
            self._bn = BatchNormSteps(self._pipe, track=not self.options.compile)
        self._install_executor()
        self._check_optimizers()
        return migrated.stats

    def _note_attempt(self, trainer: Any) -> None:
        """Log what a resumed (elastic) attempt lost and replays; note each step's start."""
        assert self._pipe is not None
        attempt = elastic.ElasticAttempt.from_env()
        callback = getattr(trainer, "checkpoint_callback", None)
        noting = self.global_rank == 0 and attempt is not None  # under torchrun, on rank 0
        folder = getattr(callback, "dirpath", None) if noting else None
        self._progress = elastic.ProgressNote(folder)
        resumed, self._resumed = self._resumed, None
        if resumed is not None and trainer.state.fn == TrainerFn.FITTING:
            path, facts, progress = resumed
            rank_zero_info(elastic.resume_message(
                path, facts, progress, self.world_size, self.num_nodes,
                self._pipe.layout, attempt,
            ))
        elif attempt is not None and attempt.restart > 0 and trainer.state.fn == TrainerFn.FITTING:
            rank_zero_warn(
                f"elastic: {attempt.describe()}, but no checkpoint was loaded: training starts "
                "over. Save with ModelCheckpoint(every_n_train_steps=N, save_last=True) and "
                "call fit(ckpt_path='last') to resume instead"
            )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """An :class:`~lightning_autopipe.lightning.sampler.ElasticDataLoader` is striped for
        this rank's replica (its global batch is split over the plan's replicas)."""
        if self._pipe is None:
            return dataloader
        layout = self._pipe.layout
        return stripe_for_layout(dataloader, layout.replica, layout.num_replicas)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        module = self.lightning_module
        if module is not None:  # rank 0 notes the step (1-based) now running
            self._progress.started(module.trainer.global_step + 1, self.world_size)

    def _note_batch_norm(self, batch_norm: bool) -> None:
        """New pipeline: BatchNorm's step work for its stage, and the note, logged once."""
        if self._bn is not None:
            self._bn.close()
            self._bn = None
        if self._pipe is None:
            return
        self._bn = BatchNormSteps(self._pipe, track=not self.options.compile)
        text = reproducible_note(self._pipe.plan, batch_norm)
        if text is not None:
            rank_zero_info(text)

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

    # ------------------------------------------------------------------------ failures
    def _failure_board(self) -> Any:
        return self._pipe.executor.failures if self._pipe is not None else None

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Post this rank's failure for its peers (the executor already posted its own)."""
        board = self._failure_board()
        if self._pipe is not None:
            note = epoch_end_note(exception, self.lightning_module, self._pipe.layout)
            if note is not None:
                exception.add_note(note)
        if board is not None:
            board.post(f"rank {self.global_rank} failed: {describe(exception)}")
        self._failed = True  # the pipeline may hold half a step: teardown releases it
        super().on_exception(exception)

    # ------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """Restore the module's example and callbacks; keep the pipeline for the next call.

        A failed run releases it (its executor may hold half a step); otherwise it stays for
        ``validate`` / ``test`` / ``predict`` / ``fit`` again with the same module, and is
        released when the strategy builds another, is collected, or the process exits.
        """
        module = self.lightning_module
        if module is not None and self._pipe is not None:
            module._example_input_array = self._hidden_example
        if "clip_grad_by_norm" in vars(self.precision_plugin):
            del self.precision_plugin.clip_grad_by_norm
        summary.uninstall(self._summaries)
        self._summaries = []
        if self._failed:
            self._held.release(failed=True)
            self._failed = False
        if self._watch is not None:
            self._watch.disarm()
        mark_in_run(False)
        if self._deferred():  # a meta-device module that never got its stage: not movable
            self._lightning_module, held = None, self._lightning_module
            super().teardown()
            self._lightning_module = held
            return
        super().teardown()


def _run_dir(trainer: Any) -> Path:
    """Where rank 0 writes the discovered cluster: ``autopipe/`` in the logger's version folder
    (next to its metrics and checkpoints), else in ``default_root_dir``. Read from the logger
    itself: ``Trainer.log_dir`` is a collective, which only rank 0 reaching here would hang."""
    logger = getattr(trainer, "logger", None)
    log_dir = getattr(logger, "log_dir", None) if logger is not None else None
    return Path(log_dir or trainer.default_root_dir) / "autopipe"
