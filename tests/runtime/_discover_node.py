"""One rank of a torchrun launch that discovers its cluster (tests/runtime/test_discover_nodes.py).

Run by ``python -m torch.distributed.run ... tests/runtime/_discover_node.py <out dir>``; the
host identity comes from ``$AUTOPIPE_HOST`` (one per torchrun node).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.runtime.pipeline import build_local_pipeline
from tests.runtime import _cases as C

Model = C.PipelineNet


def _bcast(obj, src):
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = C.dataset("gpt", 8, seed=3)
    pipe = build_local_pipeline(
        Model(), (x,), 8, AutoPipeOptions(num_stages=2, profile_repeats=1), rank=rank,
        world_size=world, device=torch.device("cpu"), broadcast=_bcast, example_batch=(x, y),
        run_dir=out / "autopipe",
    )
    loss = float(pipe.executor.train_step((x, y)))
    pipe.executor.close()
    if rank == 0:
        (out / "result.json").write_text(json.dumps({
            "plan": pipe.plan.to_dict(), "loss": loss, "world": world,
            "servers": [[s.name, s.gpus, [lv.gbps for lv in s.levels]]
                        for s in pipe.cluster.servers],
            "network_gbps": pipe.cluster.network_gbps,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
