"""One torchrun worker of the elastic scenario (``tests/reliability/test_elastic.py``).

    torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d ... _elastic_run.py OUT_DIR

Every attempt runs the same script: ``fit(ckpt_path="last")`` of the tiny GPT task on an
``ElasticDataLoader`` (global batch ``GLOBAL_BATCH``), checkpoints every ``EVERY`` steps, and
after the last step a final checkpoint. The test drives the scenario through marker files:

* ``kill_node.json``: in the first 4-rank world, node-b's local rank 0 writes it when step
  ``KILL_AT`` starts and waits; the test SIGKILLs node-b (agent and workers).
* ``paused_write.json``: after that, in a 2-rank world, rank 0 writes half of the step
  ``PAUSE_AT`` checkpoint's temporary file and waits; the test SIGKILLs it mid-write and
  starts node-b again, which rejoins.

Every rank appends the samples of each step it trains to ``batches.<pid>.jsonl`` (with the
world and the step it resumed from, which tell the attempts apart).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._stack import import_the_stack  # noqa: E402

import_the_stack()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.checkpoint import AtomicCheckpointIO  # noqa: E402
from lightning_autopipe.lightning.sampler import ElasticDataLoader  # noqa: E402
from tests.reliability import _task as T  # noqa: E402

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 5  # 12 steps cross two epoch boundaries
STEPS = 12
EVERY = 2
KILL_AT = 6  # node-b dies as this step starts (last checkpoint: step 4)
PAUSE_AT = 8  # the 2-rank world is killed while writing this step's checkpoint
WAIT_S = 120  # how long a paused rank waits to be killed (the test kills it in about 1 s)


def dataset() -> TensorDataset:
    x, y = T.dataset(GLOBAL_BATCH * STEPS_PER_EPOCH).tensors
    return TensorDataset(x, y, torch.arange(len(x)))


class ElasticTask(T.Task):
    """The reliability task on a resumable loader of global batches (indices as a 3rd tensor)."""

    def train_dataloader(self):
        return ElasticDataLoader(dataset(), GLOBAL_BATCH, shuffle=True, seed=0)


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Scenario(Callback):
    """Records each rank's samples per step; pauses node-b at ``KILL_AT`` (first 4-rank world)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.start = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        layout = trainer.strategy.pipeline.layout
        step = trainer.global_step + 1
        record = {"step": step, "world": trainer.world_size, "start": self.start,
                  "replica": layout.replica, "replicas": layout.num_replicas,
                  "idx": batch[2].tolist()}
        with open(self.out / f"batches.{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        marker = self.out / "kill_node.json"
        if (step == KILL_AT and trainer.world_size == 4 and not marker.exists()
                and os.environ.get("AUTOPIPE_HOST") == "node-b"
                and os.environ.get("LOCAL_RANK") == "0"):
            _write(marker, {"pid": os.getpid()})
            time.sleep(WAIT_S)


class PausingIO(AtomicCheckpointIO):
    """Atomic writes; in the 2-rank world after the node loss, rank 0 stops half-way through
    the temporary file of step ``PAUSE_AT``'s checkpoint until it is killed."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        marker = self.out / "paused_write.json"
        if (checkpoint.get("global_step") != PAUSE_AT or int(os.environ["WORLD_SIZE"]) != 2
                or not (self.out / "kill_node.json").exists() or marker.exists()):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        real_save = torch.save

        def half_then_wait(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            _write(marker, {"pid": os.getpid(), "path": str(path)})
            time.sleep(WAIT_S)

        with mock.patch.object(torch, "save", half_then_wait):
            super().save_checkpoint(checkpoint, path, storage_options)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    task = ElasticTask()
    trainer = pl.Trainer(
        strategy=lightning_autopipe.AutoPipeStrategy(
            num_stages=2, num_microbatches=2, startup_slices=2, profile_repeats=1, timeout=120,
        ),
        accelerator="cpu",
        devices=2,
        num_nodes=2,  # the script's; each attempt runs on the nodes torchrun gathered
        max_steps=STEPS,
        use_distributed_sampler=False,
        plugins=[PausingIO(out)],
        callbacks=[
            Scenario(out),
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=EVERY, save_top_k=0,
                            save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    trainer.fit(task, ckpt_path="last")
    trainer.save_checkpoint(out / "final.ckpt")
    if trainer.global_rank == 0:
        _write(out / "final.json", {"world": trainer.world_size, "step": trainer.global_step})


if __name__ == "__main__":
    main()
