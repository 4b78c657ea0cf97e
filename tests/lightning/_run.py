"""Launched by tests/lightning/test_ordinary_module.py: ordinary LightningModules on real ranks.

    python tests/lightning/_run.py OUT_DIR WORLD CASE [CASE ...]

Lightning's popen launcher re-runs this script in every rank, so every rank runs every case in
order and writes ``OUT_DIR/<case>.rank<r>.pt``. Cases:

* ``ordinary``: :func:`tests.lightning._module.run_sequence` on 2 stages (x WORLD/2 replicas).
* ``twice`` / ``never`` / ``metric``: ``fit`` of a module making that contract mistake;
  ``twice-replica1``: the mistake on replica 1's last stage only. Each records its error.
* ``crafted``: ``fit(ckpt_path=OUT_DIR/crafted.ckpt)`` (a file whose unpickling would run code).
* ``readme``: the README's contract example, run as written (``net`` and ``loader`` given).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

import lightning_autopipe  # noqa: E402
from tests.lightning import _module as M  # noqa: E402

ERROR_TIMEOUT = 30  # seconds: a rank left waiting for a peer would take at least this long


def _trainer(world: int, root: Path, timeout: float = 60, **kwargs) -> pl.Trainer:
    strategy = lightning_autopipe.AutoPipeStrategy(
        num_stages=2, num_microbatches=M.MICROBATCHES, startup_slices=M.STARTUP_SLICES,
        drain_slices=1, profile_repeats=1, timeout=timeout,
    )
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, log_every_n_steps=1,
                      enable_progress_bar=False, num_sanity_val_steps=0,
                      default_root_dir=str(root), **kwargs)


def readme_example() -> str:
    """The first Python block of the README's "Use it from your own code" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from your own code", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_inputs() -> dict:
    """``net`` and ``loader`` for the README example: a tiny GPT on a learnable sequence."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_autopipe.models import TinyGPT

    torch.manual_seed(0)
    net = TinyGPT(vocab=32, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    g = torch.Generator().manual_seed(5)
    start = torch.randint(0, 32, (128, 1), generator=g)
    tokens = (start + torch.arange(17)) % 32  # the next token is the current one plus one
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return {"net": net, "loader": DataLoader(data, batch_size=8)}


def run_case(case: str, world: int, out: Path) -> dict:
    root = out / case
    record: dict = {"case": case}
    start = time.monotonic()
    try:
        if case == "ordinary":
            record.update(M.run_sequence(lambda **kw: _trainer(world, root, **kw),
                                         replicas=world // 2, explicit_sampler=False,
                                         ckpt_dir=out / "ckpt-ordinary"))
        elif case == "readme":
            ns = readme_inputs()
            exec(compile(readme_example(), "README.md", "exec"), ns)
            trainer = ns["trainer"]
            record.update(steps=trainer.global_step,
                          metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
                          plan=trainer.strategy.plan.to_json())
        else:
            mistake, _, where = case.partition("-replica")
            task = M.Classifier(mistake if mistake != "crafted" else None,
                                only_replica=int(where) if where else None)
            dl = M.loaders(world // 2, explicit_sampler=False)
            trainer = _trainer(world, root, timeout=ERROR_TIMEOUT, max_epochs=1, logger=False,
                               enable_checkpointing=False)
            ckpt = out / "crafted.ckpt" if mistake == "crafted" else None
            trainer.fit(task, dl["train"], ckpt_path=ckpt)
    except lightning_autopipe.AutoPipeError as exc:
        record["error"] = (type(exc).__name__, str(exc))
    record["elapsed"] = time.monotonic() - start
    initialized = torch.distributed.is_initialized()
    record["rank"] = torch.distributed.get_rank() if initialized else int(
        os.environ.get("LOCAL_RANK", 0))
    return record


def main() -> None:
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[3:]:
        record = run_case(case, world, out)
        torch.save(record, out / f"{case}.rank{record['rank']}.pt")


if __name__ == "__main__":
    main()
