"""``PipelineCheckpointing``: checkpoint hooks that save and load a pipeline as the whole model.

Each rank of a pipeline holds one stage, so a rank's own ``state_dict`` and optimizer state are a
fragment under stage-local ids. The saved file must hold the whole model under the original
parameter names, so it loads into ``strategy="auto"`` (or the plain model) and back into any
pipeline layout: these hooks gather the stages to rank 0 (consolidated) or write one named shard
per stage (sharded), and re-shard on load. The format itself lives in
``lightning_autopipe.checkpoint``; this mixin is the strategy's side of it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import Tensor

from lightning_autopipe import checkpoint as ckpt
from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.groups import RankLayout

__all__ = ["PipelineCheckpointing"]


class PipelineCheckpointing:
    """Checkpoint hooks of ``AutoPipeStrategy``; put first in its bases so they override
    ``ParallelStrategy``'s (``super()`` here is ``ParallelStrategy``'s single-process path).

    The strategy provides ``_layout`` (None before setup), ``_param_order`` / ``_state_order``
    (the whole model's parameter and ``state_dict`` names, taken before the split) and
    ``checkpoint_format``, besides Lightning's ``lightning_module``, ``optimizers``, ranks and
    ``barrier``.
    """

    _layout: RankLayout | None
    _param_order: list[str]
    _state_order: list[str]
    checkpoint_format: str

    def _pipelined(self) -> bool:
        """More than one rank holds parts of the model (collectives gather them)."""
        return self._layout is not None and _distributed_is_initialized() and self.world_size > 1

    def _gather_to_zero(self, obj: Any) -> list[Any]:
        if not self._pipelined():
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._pipelined():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _writes_shard(self) -> bool:
        """Replica 0 of each stage holds the tensors a checkpoint stores (others are copies)."""
        return self._layout is None or self._layout.replica == 0

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict`` under the original names (collective on every rank).

        Consolidated: replica 0 of every stage sends its tensors to rank 0, which returns the
        whole model's in the original key order (other ranks return their own part; only rank
        0 writes). Sharded: this rank's stage (empty on replicas other than 0).
        """
        module = self.lightning_module
        assert module is not None
        local = module.state_dict()
        if not self._pipelined():
            return local
        mine = {k: v.detach() for k, v in local.items()} if self._writes_shard() else {}
        if self.checkpoint_format == "sharded":
            return mine
        parts = self._gather_to_zero(_to_cpu(mine))
        if self.global_rank != 0:
            return local
        merged: dict[str, Any] = {}
        for part in parts:
            for key, value in part.items():
                merged.setdefault(key, value)
        rank = {k: i for i, k in enumerate(self._state_order)}
        return dict(sorted(merged.items(), key=lambda kv: rank.get(kv[0], len(rank))))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by original parameter names, every stage merged.

        Consolidated: rank 0 returns a plain ``torch.optim`` state dict over the whole model (ids
        in the model's parameter order, names under ``"param_names"``); other ranks ``{}``.
        Sharded: this rank's part in the named form with the groups merged across stages.
        """
        module = self.lightning_module
        assert module is not None
        if not self._pipelined():
            return super().optimizer_state(optimizer)
        named = ckpt.named_optimizer_state(optimizer, ckpt.param_names_by_id(module))
        if not self._writes_shard():
            named = {"state": {}, "param_groups": named["param_groups"]}
        if self.checkpoint_format == "sharded":
            groups = self._all_gather(named["param_groups"])
            return {
                "state": named["state"],
                "param_groups": ckpt.merge_param_groups(groups, self._param_order),
            }
        parts = self._gather_to_zero(_to_cpu(named))
        return ckpt.merge_optimizer_states(parts, self._param_order) if parts else {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Rank 0 writes the consolidated file atomically; sharded: every rank writes its part."""
        if self.checkpoint_format == "sharded" and self._pipelined():
            ckpt.save_sharded(
                checkpoint, filepath, is_rank_zero=self.is_global_zero, barrier=self.barrier
            )
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Either format; runs before ``setup`` (the module is still whole)."""
        if ckpt.is_sharded(checkpoint_path):
            module = self.lightning_module
            assert module is not None
            no_dist = not _distributed_is_initialized()
            return ckpt.load_sharded(checkpoint_path, module.state_dict(), no_dist=no_dist)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Re-shard the saved (whole-model, name-keyed) optimizer state onto the local stage.

        A checkpoint without names (``strategy="auto"``) is matched by position against the
        whole model's groups, gathered from every stage in the model's parameter order.
        """
        module = self.lightning_module
        assert module is not None
        saved_states = checkpoint["optimizer_states"]
        if len(saved_states) != len(self.optimizers):
            raise PlanError(
                f"the checkpoint holds {len(saved_states)} optimizer states but "
                f"configure_optimizers built {len(self.optimizers)}; resume with the same "
                "optimizers"
            )
        names = ckpt.param_names_by_id(module)
        full: list[list[list[str]]] | None = None
        for i, (opt, saved) in enumerate(zip(self.optimizers, saved_states)):
            if isinstance(saved, ckpt.ShardedOptimizerState):
                local = ckpt.load_sharded_optimizer(
                    saved, opt, names, no_dist=not _distributed_is_initialized()
                )
            else:
                if ckpt.group_names(saved) is None and full is None:
                    full = self._whole_model_groups(names)
                local = ckpt.local_optimizer_state(
                    saved, opt, names, full_names=full[i] if full is not None else None
                )
            opt.load_state_dict(local)
            _optimizers_to_device([opt], self.root_device)

    def _whole_model_groups(self, names: dict[int, str]) -> list[list[list[str]]]:
        """Names per group per optimizer of the whole model (every stage's, model order)."""
        mine = [
            [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
            for opt in self.optimizers
        ]
        parts = self._all_gather(mine)
        out = []
        for i, groups in enumerate(mine):
            merged = ckpt.merge_param_groups(
                [[{"param_names": part[i][g]} for g in range(len(groups))] for part in parts],
                self._param_order,
            )
            out.append([g["param_names"] for g in merged])
        return out


def _to_cpu(obj: Any) -> Any:
    """Tensors moved to the CPU (gathered objects are unpickled on rank 0)."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
