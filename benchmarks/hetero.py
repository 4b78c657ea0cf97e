"""Heterogeneity benchmark: two CPU ranks, one slowed by a neighbour on its core, discovered.

    .venv/bin/python benchmarks/hetero.py [--steps 3] [--rounds 4] [--out FILE]

The GPT of ``benchmarks/runtime.py`` (vocab 512, seq 128, 8 layers, d_model 256), global batch
32, fp32, SGD, two gloo ranks with one thread each, rank 0 pinned to the first core and rank 1
to the second, which a CPU-bound neighbour process shares for the whole run (killed at the end;
its own deadline bounds it too): rank 1 computes at about half speed and nothing declares it.

The dataloader batch is one replica's (as with DDP and the strategy): 32 samples per replica,
so a plan with two replicas trains 64 per step; samples/s compares them. Rows, all timed in the
same run, interleaved round by round (the median round of each):

* one process on the fast core (rank 0 alone, the whole batch);
* AutoPipe with discovery, 2 stages pinned (``cluster=None``: the strategy's default);
* AutoPipe with discovery, everything on ``auto``;
* the homogeneous local cluster with 2 stages pinned: what the planner makes when it assumes
  the ranks are alike (the measured link, every rank at speed 1);
* DAPPLE's plan on the discovered cluster (its model has one device type);
* an even split of the blocks over the two ranks;
* a diagnostic: 2 stages planned with each device type's speed corrected by its rank's
  predicted / measured compute in training steps 4-6 of the discovered plan (what the speeds
  are while training, as opposed to while every rank profiles at once).

Columns: samples/s, the ratio to one process, the simulator's predicted step (on the cluster
the row was planned for) and measured / predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._publish import publish  # noqa: E402
from benchmarks.runtime import (  # noqa: E402
    BATCH,
    LR,
    PROFILE_MB,
    GPTTask,
    _data,
    breakdown_table,
    pipeline_step,
    predicted_compute,
)
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.options import AutoPipeOptions  # noqa: E402
from lightning_autopipe.planner.plan import Plan  # noqa: E402
from lightning_autopipe.planner.search import search_plan  # noqa: E402
from lightning_autopipe.planner.simulate import simulate  # noqa: E402
from lightning_autopipe.runtime.pipeline import build_local_pipeline  # noqa: E402
from lightning_autopipe.runtime.speeds import measured_cluster  # noqa: E402

WORLD = 2
CORRECTED = "diagnostic: speeds corrected from measured steps, 2 stages"
CORRECTION_STEPS = 6  # of the discovered plan, the mean of the last three corrects the speeds
COMMAND = ".venv/bin/python benchmarks/hetero.py"
NEIGHBOUR_S = 1800  # the neighbour's own deadline, should the benchmark die without killing it


def start_neighbour(core: int, seconds: float = NEIGHBOUR_S) -> subprocess.Popen:
    """A CPU-bound process pinned to ``core``: the rank pinned there computes at about half
    speed and nothing declares it. Its own deadline (``seconds``) ends it should the caller
    die without :func:`stop_neighbour`."""
    busy = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    return subprocess.Popen([sys.executable, "-c", busy],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def stop_neighbour(proc: subprocess.Popen) -> None:
    """Kill a :func:`start_neighbour` process and reap it."""
    proc.kill()
    proc.wait()


@contextmanager
def neighbour_on(core: int, seconds: float = NEIGHBOUR_S) -> Iterator[subprocess.Popen]:
    """A :func:`start_neighbour` process for the ``with`` block, killed at its end."""
    proc = start_neighbour(core, seconds)
    try:
        yield proc
    finally:
        stop_neighbour(proc)


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bcast(obj: Any, src: int) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def _pipeline(plan: Plan | None, cluster: Any, rank: int, run_dir: Path | None, **pins: Any):
    x, y = _data()
    options = AutoPipeOptions(plan=plan, cluster=cluster, timeout=900, **pins)
    pipe = build_local_pipeline(
        GPTTask(), (x[:PROFILE_MB],), BATCH, options,
        rank=rank, world_size=WORLD, device=torch.device("cpu"), broadcast=_bcast,
        example_batch=(x[:PROFILE_MB], y[:PROFILE_MB]), run_dir=run_dir,
    )
    batch = (x, y)  # every replica's batch (as DDP: the global batch is 32 x replicas)
    return pipe, pipeline_step(pipe, batch, torch.optim.SGD(pipe.stage.parameters(), lr=LR))


def _corrected(cluster: Cluster, sim: Any, stats: list[dict]) -> Cluster:
    """The discovered cluster with each device's speed scaled by its rank's predicted /
    measured compute in training steps of the discovered plan
    (:func:`~lightning_autopipe.runtime.speeds.measured_cluster`: a device type with its own
    profile gets that profile scaled).

    A diagnostic, not what the strategy does: discovery times every rank while all of them
    profile flat out, but a rank sharing its core with a neighbour runs faster when the plan
    leaves it idle part of the step (presumably the scheduler crediting a task that slept), so
    the speed it trains at depends on the plan it was given.
    """
    ratios: dict[str, float] = {}
    for dev, st in zip(cluster.devices, stats):
        pred = sum(predicted_compute(sim, dev.name).values())
        meas = st["F"] + st["B"] + st["W"]
        print(f"correction: {dev.name} predicted compute {pred:.0f} ms, measured {meas:.0f} ms",
              flush=True)
        ratios[dev.name] = pred / meas
    top = max(ratios.values())  # the fastest rank keeps its discovered speed
    return measured_cluster(cluster, {name: r / top for name, r in ratios.items()})


def _single(rank: int):
    model = GPTTask()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()

    def step() -> None:
        if rank == 0:
            model.pipeline_loss(model(x), (x, y)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def _local_like(cluster: Cluster) -> Cluster:
    """The discovered link and reduction, with every rank alike (speed 1): today's default."""
    lv = cluster.servers[0].levels[0]
    spec = cluster.servers[0].device
    return Cluster.local(WORLD, device_name=spec.name, gbps=lv.gbps, latency_us=lv.latency_us,
                         reduce_gbps=spec.reduce_gbps, memory_gb=spec.memory_gb)


def _worker(rank: int, port: int, out: str, steps: int, rounds: int, cores: list[int]) -> None:
    os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=900))
    try:
        _run(rank, Path(out), steps, rounds)
    finally:
        dist.destroy_process_group()


def _run(rank: int, out: Path, steps: int, rounds: int) -> None:
    t0 = time.perf_counter()
    discovered, pinned_step = _pipeline(None, None, rank, out / "autopipe", num_stages=2)
    cluster, ref = discovered.cluster, discovered.profile
    discovery_s = time.perf_counter() - t0
    names = [d.name for d in cluster.devices]
    local = _local_like(cluster)
    late = []
    for i in range(CORRECTION_STEPS):  # the speeds of the first steps still move: the last ones
        pinned_step()
        if i >= CORRECTION_STEPS // 2:
            late.append(pinned_step.stats)
    measured_compute: list[Any] = [None] * WORLD
    dist.all_gather_object(measured_compute, {k: statistics.mean(s[k] for s in late)
                                              for k in ("F", "B", "W")})
    plans: Any = None
    if rank == 0:
        corrected = _corrected(cluster, simulate(discovered.plan, ref, cluster), measured_compute)
        plans = {
            "AutoPipe, discovered, 2 stages pinned": (discovered.plan, cluster),
            "AutoPipe, discovered, all auto": (search_plan(ref, cluster, names, BATCH), cluster),
            "homogeneous local cluster, 2 stages": (
                search_plan(ref, local, [d.name for d in local.devices], BATCH, num_stages=2),
                local),
            "DAPPLE on the discovered cluster": (
                search_plan(ref, cluster, names, BATCH, planner="dapple"), cluster),
            "even split, 2 stages": (
                search_plan(ref, cluster, names, BATCH, planner="uniform", num_stages=2),
                cluster),
            CORRECTED: (search_plan(ref, corrected, names, BATCH, num_stages=2), corrected),
        }
        plans = {k: (p.to_json(), c.to_dict() if c is not cluster else None) for k, (p, c) in
                 plans.items()}
    plans = _bcast(plans, 0)
    runs: dict[str, Any] = {"one process, fast core": (_single(rank), None, None)}
    for label, (text, local_dict) in plans.items():
        plan = Plan.from_json(text)
        row_cluster = Cluster.from_dict(local_dict) if local_dict else cluster
        if label.startswith("AutoPipe, discovered, 2"):
            runs[label] = (pinned_step, plan, row_cluster)
            continue
        _, step = _pipeline(plan, row_cluster, rank, None)
        runs[label] = (step, plan, row_cluster)
    times: dict[str, list[float]] = {k: [] for k in runs}
    samples: dict[str, list[Any]] = {k: [] for k in runs}  # the last step's breakdown per round
    for _ in range(rounds):
        for label, (step, _, _) in runs.items():
            step()  # warm-up
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            times[label].append((time.perf_counter() - t) / steps * 1e3)
            samples[label].append(getattr(step, "stats", None))
    median_round = {k: sorted(range(rounds), key=v.__getitem__)[rounds // 2]
                    for k, v in times.items()}
    mine = {k: samples[k][median_round[k]] for k in runs if samples[k][0] is not None}
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, mine)
    if rank != 0:
        return
    single = statistics.median(times["one process, fast core"])
    sims = {label: simulate(plan, ref, row_cluster) for label, (_, plan, row_cluster)
            in runs.items() if plan is not None}
    rows = []
    for label, (_, plan, _) in runs.items():
        ms = statistics.median(times[label])
        pred = sims[label].iteration_ms if label in sims else None
        blocks = [list(s.blocks) for s in plan.stages] if plan is not None else []
        layout = ("1 process" if plan is None else
                  f"{plan.num_stages}x{plan.replicas} blocks {blocks} m{plan.num_microbatches} "
                  f"k{plan.startup_slices} j{plan.drain_slices} {plan.schedule}")
        samples = plan.global_batch_size if plan is not None else BATCH
        rows.append({"row": label, "ms": ms, "samples_s": samples / ms * 1e3,
                     "x_single": samples / ms / (BATCH / single),
                     "predicted_ms": pred, "measured_over_predicted": ms / pred if pred else None,
                     "layout": layout})
    breakdown = breakdown_table({
        label: ([every[r][label] for r in range(WORLD)], sims[label],
                [d.name for d in row_cluster.devices])
        for label, (_, plan, row_cluster) in runs.items() if label in every[0]
    })
    speeds = {d.name: d.spec.speed for d in cluster.devices}
    fixed = {d.name: d.spec.speed for d in corrected.devices}
    result = {"rows": rows, "speeds": speeds, "discovery_s": discovery_s, "breakdown": breakdown,
              "corrected_speeds": fixed,
              "cluster": (out / "autopipe" / "cluster.yaml").read_text()}
    (out / "hetero.json").write_text(json.dumps(result, indent=1))


def _table(result: dict, steps: int, rounds: int) -> str:
    by = {r["row"]: r for r in result["rows"]}
    homo = by["homogeneous local cluster, 2 stages"]["samples_s"]
    lines = [
        f"command: {COMMAND} --steps {steps} --rounds {rounds}",
        f"measured device speeds: {result['speeds']} (discovery took "
        f"{result['discovery_s']:.1f} s); corrected from measured steps of the discovered "
        f"plan: {result['corrected_speeds']}",
        "",
        "| run | samples/s | x one process | x homogeneous plan | predicted ms | measured / "
        "predicted | layout |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] else "-"
        ratio = f"{r['measured_over_predicted']:.3f}" if r["measured_over_predicted"] else "-"
        lines.append(f"| {r['row']} | {r['samples_s']:.2f} | {r['x_single']:.3f} | "
                     f"{r['samples_s'] / homo:.3f} | {pred} | {ratio} | {r['layout']} |")
    lines += [
        "",
        "Where each pipeline's step goes (its median round's last step, per rank, ms): forward /"
        " backward / weight-gradient (W) compute, blocked in receives of activations (RF) /"
        " gradients (RB), the tail after the last action (sends, loss broadcast, gradient sync);"
        " 'pred.': the simulator's compute on that rank's device, on the cluster the row was"
        " planned for.",
        "",
        *result["breakdown"],
    ]
    lines += ["", "discovered cluster.yaml:", "```", result["cluster"].rstrip(), "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", help="also write the table here (markdown)")
    args = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs two cores: one per rank", file=sys.stderr)
        return 2
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"autopipe-hetero-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    with neighbour_on(cores[1]):
        mp.spawn(_worker, args=(free_port(), str(work), args.steps, args.rounds, cores[:2]),
                 nprocs=WORLD, join=True)
    publish(_table(json.loads((work / "hetero.json").read_text()), args.steps, args.rounds),
            args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
