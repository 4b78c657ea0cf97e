"""Cases of tests/runtime/test_memory_model.py, run on the shared 2-rank gloo world.

Every case builds its given plan with ``build_local_pipeline`` (the memory meter on), trains
two Adam steps and returns the meter's readings of every rank (step 2, gathered).
"""

from __future__ import annotations

import torch

from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.runtime.groups import destroy_groups
from tests.runtime import _meta as W

WORLD = 2


def run(rank: int, world: int, plans: dict[str, tuple[str, str]]) -> dict:
    """Every case ``name -> (model kind, plan JSON)`` in turn; name -> the gathered readings."""
    torch.set_num_threads(1)
    readings = {}
    for name, (kind, text) in plans.items():
        torch.manual_seed(0)
        module = W.Task(lambda k=kind: W.build(k), kind)
        pipe = W.pipeline(module, kind, AutoPipeOptions(plan=Plan.from_json(text), timeout=60),
                          rank, world)
        W.train(pipe, module, kind, steps=2)
        readings[name] = pipe.executor.memory.readings
        pipe.executor.close()
        destroy_groups(pipe.groups)
    return readings
