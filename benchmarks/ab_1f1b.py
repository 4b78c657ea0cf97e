"""Step-by-step A/B: our runtime vs torch.distributed.pipelining's Schedule1F1B, same 2 ranks.

    .venv/bin/python benchmarks/ab_1f1b.py --cut 11 --m 4 --k 4 --j 2 [--their-m 8] [--steps 12]

The same two processes alternate one training step of ours (``build_local_pipeline`` + the
executor, as in ``benchmarks/runtime.py``) and one of ``Schedule1F1B`` on the same stage split,
so both see the same machine speed; medians over the steps after two warm-ups. Compute is timed
around every forward and backward on both sides (ours: the executor's timeline; theirs: a
wrapper around ``forward_one_chunk`` / ``backward_one_chunk``, private torch methods: this is a
measuring script, not library code). Their loss is computed outside ``forward_one_chunk``, so
the last rank's F excludes it there and includes it here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime as bench  # noqa: E402  (benchmarks/runtime.py: model, data, runners)

from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402


def _timed_chunks(acc: dict[str, float]) -> None:
    """Add the time of every forward / backward chunk of a pipelining stage to ``acc``."""
    from torch.distributed.pipelining import stage as stage_mod

    base = stage_mod._PipelineStageBase
    fwd, bwd = base.forward_one_chunk, base.backward_one_chunk

    def timed(fn: Any, key: str) -> Any:
        def run(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                acc[key] += (time.perf_counter() - t0) * 1e3

        return run

    base.forward_one_chunk = timed(fwd, "F")
    base.backward_one_chunk = timed(bwd, "B")


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    try:
        acc = {"F": 0.0, "B": 0.0}
        _timed_chunks(acc)
        n = 2 * bench.LAYERS + 3  # blocks of the benchmark GPT
        stages = [StagePlan((0, args.cut), ["local:0"]), StagePlan((args.cut, n), ["local:1"])]
        plan = Plan("pinned", bench.BATCH, args.m, args.k, stages, drain_slices=args.j)
        ours = bench._make_autopipe(rank, plan.to_json())
        theirs = bench._make_pipelining(rank, args.cut, "1f1b", args.their_m or args.m)
        got: dict[str, list[tuple[float, float, float]]] = {"ours": [], "theirs": []}
        for i in range(args.steps + 2):
            for name, step in (("ours", ours), ("theirs", theirs)):
                acc["F"] = acc["B"] = 0.0
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                ms = (time.perf_counter() - t0) * 1e3
                if i >= 2:
                    st = step.stats if name == "ours" else acc
                    got[name].append((st["F"], st["B"], ms))
        rows = [None, None]
        dist.all_gather_object(rows, got)
        if rank == 0:
            _report(rows, args)
    finally:
        dist.destroy_process_group()


def _report(rows: list[Any], args: argparse.Namespace) -> None:
    def med(vals: list[tuple[float, float, float]], i: int) -> float:
        return statistics.median(v[i] for v in vals)

    theirs_m = args.their_m or args.m
    print(
        f"cut {args.cut}: ours m={args.m} k={args.k} j={args.j} vs Schedule1F1B m={theirs_m}, "
        f"medians of {args.steps} alternating steps\n"
    )
    print("| rank | ours F | ours B | theirs F | theirs B |\n|---:|---:|---:|---:|---:|")
    for r, got in enumerate(rows):
        o, t = got["ours"], got["theirs"]
        print(f"| {r} | {med(o, 0):.0f} | {med(o, 1):.0f} | {med(t, 0):.0f} | {med(t, 1):.0f} |")
    ours, theirs = med(rows[0]["ours"], 2), med(rows[0]["theirs"], 2)
    print(f"\nstep: ours {ours:.0f} ms, Schedule1F1B {theirs:.0f} ms -> {theirs / ours:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cut", type=int, default=11, help="first block of stage 1")
    ap.add_argument("--m", type=int, default=4, help="our micro-batches")
    ap.add_argument("--k", type=int, default=1, help="our startup slices")
    ap.add_argument("--j", type=int, default=1, help="our drain slices")
    ap.add_argument("--their-m", type=int, default=None, help="Schedule1F1B's micro-batches")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    mp.spawn(_worker, args=(bench._free_port(), args), nprocs=2)


if __name__ == "__main__":
    main()
