"""``PipelineCheckpoint``: save and load a pipeline's state as the whole model's.

Each rank of a pipeline holds one stage, so a rank's own ``state_dict`` and optimizer state are a
fragment under stage-local ids. The saved checkpoint must hold the whole model under the original
parameter names, so it loads into ``strategy="auto"`` (or the plain model) and back into any
pipeline layout: this gathers the stages to rank 0 (consolidated) or writes one named shard per
stage (sharded), and re-shards on load. ``AutoPipeStrategy``'s checkpoint hooks delegate here
with everything it needs passed in: the rank's layout, the whole model's parameter and
``state_dict`` orders (taken before the split) and the format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_autopipe.checkpoint import optimizer as optstate
from lightning_autopipe.checkpoint import sharded
from lightning_autopipe.errors import PipelineRuntimeError, PlanError
from lightning_autopipe.runtime.failure import GONE
from lightning_autopipe.runtime.groups import RankLayout

__all__ = ["PipelineCheckpoint", "stage_model_state"]


@dataclass(frozen=True)
class PipelineCheckpoint:
    """One rank's side of a pipeline checkpoint (built once the layout is known).

    Attributes:
        layout: this rank's place in the pipeline (its rank, the world size, its replica).
        param_order: the whole model's parameter names, in ``named_parameters()`` order.
        state_order: the whole model's ``state_dict`` keys, in order.
        format: ``"consolidated"`` or ``"sharded"``.
        failures: the run's failure board (:class:`~lightning_autopipe.runtime.failure.
            FailureBoard`): a gather that fails because a peer failed names that failure.
    """

    layout: RankLayout
    param_order: Sequence[str]
    state_order: Sequence[str]
    format: str = "consolidated"
    failures: Any = None

    @property
    def pipelined(self) -> bool:
        """More than one rank holds parts of the model (collectives gather them)."""
        return _distributed_is_initialized() and self.layout.world_size > 1

    @property
    def sharded(self) -> bool:
        """Every rank writes its own part (a pipelined run in the sharded format)."""
        return self.format == "sharded" and self.pipelined

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """The model's ``state_dict`` under the original names (collective on every rank).

        Consolidated: replica 0 of every stage sends its tensors to rank 0, which returns the
        whole model's in the original key order (other ranks return their own part; only rank
        0 writes). Sharded: this rank's stage (empty on replicas other than 0).
        """
        local = module.state_dict()
        if not self.pipelined:
            return local
        mine = {k: v.detach() for k, v in local.items()} if self._writes_shard else {}
        if self.format == "sharded":
            return mine
        parts = self._gather_to_zero(_to_cpu(mine))
        if self.layout.rank != 0:
            return local
        merged: dict[str, Any] = {}
        for part in parts:
            for key, value in part.items():
                merged.setdefault(key, value)
        rank = {k: i for i, k in enumerate(self.state_order)}
        return dict(sorted(merged.items(), key=lambda kv: rank.get(kv[0], len(rank))))

    def optimizer_state(self, optimizer: Any, module: nn.Module) -> dict[str, Any]:
        """The optimizer's state keyed by original parameter names, every stage merged.

        Call only when :attr:`pipelined` (one process saves its optimizer as it is).
        Consolidated: rank 0 returns a plain ``torch.optim`` state dict over the whole model (ids
        in the model's parameter order, names under ``"param_names"``); other ranks ``{}``.
        Sharded: this rank's part in the named form with the groups merged across stages.
        """
        named = optstate.named_optimizer_state(optimizer, optstate.param_names_by_id(module))
        if not self._writes_shard:
            named = {"state": {}, "param_groups": named["param_groups"]}
        if self.format == "sharded":
            with _every_rank_saves(self.layout.rank, self.failures):
                groups = self._all_gather(named["param_groups"])
            return {
                "state": named["state"],
                "param_groups": optstate.merge_param_groups(groups, self.param_order),
            }
        parts = self._gather_to_zero(_to_cpu(named))
        return optstate.merge_optimizer_states(parts, self.param_order) if parts else {}

    def save_sharded(self, checkpoint: dict[str, Any], path: Any, barrier: Callable) -> None:
        """Every rank writes its part of the DCP directory at ``path``; rank 0 swaps it in."""
        sharded.save_sharded(checkpoint, path, is_rank_zero=self.layout.rank == 0, barrier=barrier)

    def load_optimizer_states(
        self, saved_states: Sequence[Any], optimizers: Sequence[Any], module: nn.Module,
        device: torch.device,
    ) -> None:
        """Re-shard the saved (whole-model, name-keyed) optimizer states onto the local stage.

        A checkpoint without names (``strategy="auto"``) is matched by position against the
        whole model's groups, gathered from every stage in the model's parameter order.

        Raises:
            PlanError: the checkpoint holds another number of optimizers than were built.
        """
        if len(saved_states) != len(optimizers):
            raise PlanError(
                f"the checkpoint holds {len(saved_states)} optimizer states but "
                f"configure_optimizers built {len(optimizers)}; resume with the same "
                "optimizers"
            )
        names = optstate.param_names_by_id(module)
        full: list[list[list[str]]] | None = None
        for i, (opt, saved) in enumerate(zip(optimizers, saved_states)):
            if isinstance(saved, sharded.ShardedOptimizerState):
                local = sharded.load_sharded_optimizer(
                    saved, opt, names, no_dist=not _distributed_is_initialized()
                )
            else:
                if optstate.group_names(saved) is None and full is None:
                    full = self._whole_model_groups(optimizers, names)
                local = optstate.local_optimizer_state(
                    saved, opt, names, full_names=full[i] if full is not None else None
                )
            opt.load_state_dict(local)
            _optimizers_to_device([opt], device)

    # ---------------------------------------------------------------------------- internals
    @property
    def _writes_shard(self) -> bool:
        """Replica 0 of each stage holds the tensors a checkpoint stores (others are copies)."""
        return self.layout.replica == 0

    def _gather_to_zero(self, obj: Any) -> list[Any]:
        if not self.pipelined:
            return [obj]
        out: list[Any] | None = [None] * self.layout.world_size if self.layout.rank == 0 else None
        with _every_rank_saves(self.layout.rank, self.failures):
            dist.gather_object(obj, out, dst=0)
        return out or []

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.pipelined:
            return [obj]
        out: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(out, obj)
        return out

    def _whole_model_groups(
        self, optimizers: Sequence[Any], names: dict[int, str]
    ) -> list[list[list[str]]]:
        """Names per group per optimizer of the whole model (every stage's, model order)."""
        mine = [
            [[names[id(p)] for p in g["params"]] for g in opt.param_groups] for opt in optimizers
        ]
        parts = self._all_gather(mine)
        out = []
        for i, groups in enumerate(mine):
            merged = optstate.merge_param_groups(
                [[{optstate.NAMES: part[i][g]} for g in range(len(groups))] for part in parts],
                self.param_order,
            )
            out.append([g[optstate.NAMES] for g in merged])
        return out


def stage_model_state(
    saved: Mapping[str, Any], local: Mapping[str, Any], *, strict: bool = True
) -> dict[str, Any]:
    """The part of a whole-model ``state_dict`` that one stage holds (``local``'s keys).

    A module already split into a pipeline holds only its stage's tensors (the others are
    released), so loading a whole-model checkpoint into it (``ckpt_path="best"`` after ``fit``)
    takes that stage's keys and leaves the rest to the ranks that hold them.

    Raises:
        PlanError: with ``strict``, a key of this stage is not in the checkpoint.
    """
    missing = [k for k in local if k not in saved]
    if strict and missing:
        raise PlanError(
            f"the checkpoint lacks {len(missing)} of this rank's stage keys ({missing[:6]}); "
            "load a checkpoint of this model (or set the module's strict_loading = False)"
        )
    return {k: saved[k] for k in local if k in saved}


def _to_cpu(obj: Any) -> Any:
    """Tensors moved to the CPU (gathered objects are unpickled on rank 0)."""
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())


@contextmanager
def _every_rank_saves(rank: int, failures: Any = None) -> Iterator[None]:
    """Name the likely cause when gathering a checkpoint's parts fails: a peer's failure when
    one was posted (a rank that raised or died while saving), else the usual mistake. Every
    rank holds one stage's part, so saving is collective, and a save called on rank 0 alone
    (DDP's habit, ``if trainer.is_global_zero: trainer.save_checkpoint(...)``) waits out the
    timeout."""
    try:
        yield
    except RuntimeError as exc:
        first = failures.first(wait_s=2.0) if failures is not None else None
        if first not in (None, GONE) and first != failures.posted:
            raise PipelineRuntimeError(
                f"rank {rank} stopped while gathering the checkpoint's parts because {first}"
            ) from exc
        raise PipelineRuntimeError(
            f"rank {rank}: gathering the checkpoint's parts from every rank failed ({exc}); "
            "a peer rank died or hung while saving (check its log), or the save ran on some "
            "ranks only: under AutoPipeStrategy each rank holds one stage's part, so "
            "trainer.save_checkpoint must be called on every rank (not under "
            "`if trainer.is_global_zero:`; ModelCheckpoint does so)"
        ) from exc
