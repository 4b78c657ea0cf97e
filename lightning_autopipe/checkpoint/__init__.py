"""Layout-independent checkpoints: model and optimizer state under the original model's names.

* **Consolidated** (default): one file, written by rank 0 only, in Lightning's usual format. The
  ``state_dict`` is the whole model's; each optimizer state is a plain ``torch.optim`` state dict
  whose ids follow the whole model's parameter order, plus ``"param_names"`` per group
  (:mod:`.optimizer`). It loads into the plain model (``strict=True``), into
  ``strategy="auto"`` training, and into any pipeline layout.
* **Sharded** (``checkpoint_format="sharded"``): a ``torch.distributed.checkpoint`` directory
  with one named shard per stage (:mod:`.sharded`).

Writes are atomic (:mod:`.files`); reads run no code from the file (:mod:`.safe`: tensors and
plain containers only, anything else is refused). :class:`PipelineCheckpoint` (:mod:`.hooks`)
is what the strategy's checkpoint hooks call; :func:`read_model_state` reads either format in
one process.
"""

from lightning_autopipe.checkpoint.files import (
    AtomicCheckpointIO,
    atomic_torch_save,
    with_atomic_writes,
)
from lightning_autopipe.checkpoint.hooks import PipelineCheckpoint, stage_model_state
from lightning_autopipe.checkpoint.optimizer import (
    group_names,
    local_optimizer_state,
    merge_optimizer_states,
    merge_param_groups,
    named_optimizer_state,
    param_names_by_id,
)
from lightning_autopipe.checkpoint.safe import (
    SafeFileSystemReader,
    refusing_unsafe,
    safe_load,
    unsafe_message,
)
from lightning_autopipe.checkpoint.sharded import (
    ShardedModelState,
    ShardedOptimizerState,
    is_sharded,
    load_for_stage,
    load_sharded,
    load_sharded_optimizer,
    read_model_state,
    save_sharded,
)

__all__ = [
    "AtomicCheckpointIO",
    "PipelineCheckpoint",
    "SafeFileSystemReader",
    "ShardedModelState",
    "ShardedOptimizerState",
    "atomic_torch_save",
    "group_names",
    "is_sharded",
    "load_for_stage",
    "load_sharded",
    "load_sharded_optimizer",
    "local_optimizer_state",
    "merge_optimizer_states",
    "merge_param_groups",
    "named_optimizer_state",
    "param_names_by_id",
    "read_model_state",
    "refusing_unsafe",
    "safe_load",
    "save_sharded",
    "stage_model_state",
    "unsafe_message",
    "with_atomic_writes",
]
