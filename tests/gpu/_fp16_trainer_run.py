"""Launched by tests/gpu/test_fp16_trainer.py: fp16 with loss scaling through the Trainer.

    python tests/gpu/_fp16_trainer_run.py OUT_DIR ACCELERATOR

One device, ``strategy=AutoPipeStrategy(...)`` (one stage, two micro-batches, the first in two
slices), ``MixedPrecision("16-mixed", ACCELERATOR)`` with the plain scaler of
``tests/lightning/_fp16`` (whose net overflows at step 2), norm clipping on; then, on CUDA,
one step under the plain ``precision="16-mixed"`` flag. Writes ``OUT_DIR/run.pt``: the
per-step records of ``tests/lightning/_fp16_run.Record`` and which scaler class each run held.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._stack import import_the_stack  # noqa: E402

import_the_stack()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_autopipe import AutoPipeStrategy  # noqa: E402
from tests.lightning import _fp16 as F16  # noqa: E402
from tests.lightning._fp16_run import Record  # noqa: E402


def _fit(accelerator: str, steps: int, **precision) -> Record:
    record = Record()
    strategy = AutoPipeStrategy(num_stages=1, num_microbatches=2, startup_slices=2,
                                profile_repeats=1, timeout=60)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=accelerator, devices=1, max_steps=steps,
        gradient_clip_val=F16.CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[record], **precision,
    )
    trainer.fit(F16.Task(), F16.loader(F16.REPLICA_BATCH * F16.STEPS, seed=1))
    return record


def main() -> None:
    out, accelerator = Path(sys.argv[1]), sys.argv[2]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
    plugin = _fit(accelerator, F16.STEPS, plugins=[F16.plugin(device)])
    flag = _fit(accelerator, 1, precision="16-mixed") if device == "cuda" else None
    torch.save({"rows": plugin.rows, "scaler_class": plugin.scaler_class,
                "flag_scaler_class": flag.scaler_class if flag else None},
               out / "run.pt")


if __name__ == "__main__":
    main()
