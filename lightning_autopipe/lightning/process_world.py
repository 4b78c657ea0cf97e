"""The strategy's process world: ranks, the launcher, the process group and collectives.

Lightning asks a parallel strategy how many processes it runs, starts them through the
strategy's launcher and then lets each rank set up its environment. Here the launcher first
judges the configuration in the launching process (:mod:`~lightning_autopipe.lightning.prelaunch`),
every rank joins the default process group under the strategy's ``timeout``, and a rank that
its launcher started watches that launcher so that it does not outlive its failure. Kept apart
from :mod:`~lightning_autopipe.lightning.strategy` (the pipeline's setup and teardown) as a
base class of it: nothing here reads the pipeline.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.lightning import elastic
from lightning_autopipe.lightning.prelaunch import (
    CheckedMultiProcessingLauncher,
    CheckedScriptLauncher,
    check_before_launch,
)
from lightning_autopipe.lightning.report_once import install_excepthook
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.failure import (
    FailureBoard,
    describe,
    ending_with_launcher,
    is_communication_error,
    pipeline_failure,
    watch_launcher,
)

__all__ = ["ProcessWorld"]


class ProcessWorld(ParallelStrategy):
    """Ranks, launcher, process group and collectives of the pipeline strategy.

    The concrete strategy (:class:`~lightning_autopipe.lightning.strategy.AutoPipeStrategy`)
    sets the attributes below in its ``__init__``.
    """

    options: AutoPipeOptions
    _backend: str | None
    _num_nodes: int
    _watch: Any

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """The Trainer's ``num_nodes``; under torchrun, the nodes of this (elastic) attempt."""
        return elastic.launched_nodes(self._num_nodes)

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

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        start_method = self.options.start_method
        if start_method == "popen":
            self._launcher = CheckedScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes,
                check=self._check_before_launch,
            )
        else:
            self._launcher = CheckedMultiProcessingLauncher(
                self, start_method=start_method, check=self._check_before_launch
            )

    def _check_before_launch(self, trainer: Any) -> None:
        """Judge the configuration in the launching process, once, before any rank starts
        (:mod:`~lightning_autopipe.lightning.prelaunch`)."""
        check_before_launch(
            self.options, self.num_nodes * self.num_processes, self.num_nodes, trainer,
            self.precision_plugin, self.lightning_module,
        )

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
        # Launched by rank 0 of this node, or by torchrun's agent: do not outlive its failure,
        # from before the process group forms (a rank 0 that fails to bind its store left its
        # children waiting on the port for as long as anything listened there).
        launched = self.local_rank > 0 or elastic.ElasticAttempt.from_env() is not None
        if launched:
            self._watch = watch_launcher(self.global_rank)
            if self._watch is not None:
                self._watch.arm()
        try:
            with ending_with_launcher() if launched else nullcontext():
                _init_dist_connection(
                    self.cluster_environment, self._backend, timeout=self.options.timeout_delta
                )
        except dist.DistError as exc:  # DistStoreError / DistNetworkError: not all joined
            env, seconds = self.cluster_environment, self.options.timeout_delta.total_seconds()
            raise PipelineRuntimeError(
                f"rank {self.global_rank}: the {env.world_size()} ranks did not all join the "
                f"process group at {env.main_address}:{env.main_port} within {seconds:g} s "
                f"({describe(exc, 300)}); start every rank (num_nodes x devices processes, "
                "every node's launch with the same address and port) or give a slow start more "
                "time with AutoPipeStrategy(timeout=...)"
            ) from exc
        if self.global_rank > 0:
            install_excepthook()  # an error every rank raises alike: rank 0's traceback only

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            self._collective("Lightning's barrier", dist.barrier)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        self._collective("Lightning's broadcast", dist.broadcast_object_list, box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return self._collective("Lightning's reduction of a logged value",
                                    _sync_ddp_if_available, tensor, group, reduce_op=reduce_op)
        return tensor

    def _failure_board(self) -> FailureBoard | None:
        """Where the job's first failure is posted (the strategy's pipeline has one)."""
        return None

    def _collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn`` (a collective Lightning asks for); when it fails because a peer is gone (a
        peer whose own hook raised, e.g. in an epoch-end hook), the error names that peer's
        failure as posted on the failure board instead of the bare transport error."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not is_communication_error(exc):
                raise
            trainer = getattr(self.lightning_module, "_trainer", None)
            when = f"global step {trainer.global_step}" if trainer is not None else "the run"
            raise pipeline_failure(self._failure_board(), exc, where=f"rank {self.global_rank}",
                                   what=what, when=when, communication=True) from exc
