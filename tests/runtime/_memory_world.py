"""Workers of tests/runtime/test_memory_model.py: each schedule's measured peak per stage.

One 2-rank gloo world runs every case in turn (``CASES``): it builds the case's given plan
with ``build_local_pipeline`` (the memory meter on), trains two Adam steps and writes the
meter's readings of every rank (step 2, gathered on rank 0) to ``OUT/memory.pt``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.runtime.groups import destroy_groups
from tests.runtime import _meta as W

WORLD = 2


def run(rank: int, port: int, out: str, plans: dict[str, tuple[str, str]]) -> None:
    """Every case ``name -> (model kind, plan JSON)`` in turn on this rank."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    readings = {}
    try:
        for name, (kind, text) in plans.items():
            torch.manual_seed(0)
            module = W.Task(lambda k=kind: W.build(k), kind)
            pipe = W.pipeline(module, kind, AutoPipeOptions(plan=Plan.from_json(text),
                                                            timeout=60), rank, WORLD)
            W.train(pipe, module, kind, steps=2)
            readings[name] = pipe.executor.memory.readings
            pipe.executor.close()
            destroy_groups(pipe.groups)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(readings, Path(out) / "memory.pt")

