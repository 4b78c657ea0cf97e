"""Runtime benchmark: AutoPipe vs torch.distributed.pipelining vs DDP vs one process, 2 CPU ranks.

    .venv/bin/python benchmarks/runtime.py [--steps 3] [--warmup 2] [--rounds 5] [--out FILE]

A small GPT (vocab 512, seq 128, 8 layers, d_model 256, 4 heads), global batch 32, fp32, SGD.
Every distributed run uses 2 processes with one thread each (gloo); the single-process baseline
uses one thread. AutoPipe runs go straight through the runtime (``build_local_pipeline`` +
``PipelineExecutor``, the code ``AutoPipeStrategy`` runs inside Lightning), launched with
``torch.multiprocessing``; so do the DDP and ``torch.distributed.pipelining`` peers. The
pipelining peers use the same stage modules (our partition) with equal micro-batches.

Compiled rows (inductor): the single process with ``torch.compile`` on the whole model, and the
pinned 1F1B and ZB-H1 sliced pipelines and the chunked rows at m = 4 with ``compile=True``
(each stage chunk compiled once, its batch dimension unbacked, so the slices reuse the graph;
where the schedule splits backwards the compiled backward is split into B and W graphs); the
warm-up steps compile. The report gives each one's speed-up over its eager row and each
pipeline's ratio to one process eager and compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._publish import publish  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.errors import PlanError  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner import make_plan  # noqa: E402
from lightning_autopipe.planner.balance import balanced_cuts  # noqa: E402
from lightning_autopipe.planner.layout import BlockCosts  # noqa: E402
from lightning_autopipe.planner.plan import Plan, Proposal, StagePlan  # noqa: E402
from lightning_autopipe.planner.simulate import simulate  # noqa: E402
from lightning_autopipe.profile import Profile, median_profile  # noqa: E402
from lightning_autopipe.runtime import monitor  # noqa: E402
from lightning_autopipe.runtime.monitor import StepMonitor  # noqa: E402
from lightning_autopipe.runtime.profiler import profile_blocks  # noqa: E402
from lightning_autopipe.zoo.models import TinyGPT  # noqa: E402

VOCAB, SEQ, LAYERS, D, HEADS = 512, 128, 8, 256, 4
BATCH, WORLD, PROFILE_MB = 32, 2, 4
LR = 0.01
_STATS: list[dict[str, float]] = []  # per AutoPipe run: where this rank's last step went
EAGER_PIPE = "AutoPipe pinned 2 stages, 1F1B sliced"  # the plans the compiled rows run
EAGER_ZB = "AutoPipe pinned 2 stages, ZB-H1 sliced"
COMPILED_SINGLE = "single process, compiled"
COMPILED_PIPE = EAGER_PIPE + ", compiled"
COMPILED_ZB = EAGER_ZB + ", compiled"
#: torch's schedules of two stages per rank, with the placement of their four stages
TORCH_MULTI = {"zbv": "V: stages 0+3 / 1+2", "dualpipev": "V: stages 0+3 / 1+2",
               "interleaved-zb": "0+2 / 1+3"}
#: AutoPipe's chunked rows: (schedule, chunks per rank, pinned m or None for the planner's)
CHUNKED = {
    "AutoPipe pinned 2x2 chunks, ZB-V": ("zbv", 2, None),
    "AutoPipe pinned 2x2 chunks, ZB-V m=4": ("zbv", 2, 4),
    "AutoPipe pinned 2x2 chunks, interleaved 1F1B": ("interleaved-1f1b", 2, None),
    "AutoPipe pinned 2x2 chunks, interleaved 1F1B m=4": ("interleaved-1f1b", 2, 4),
}
#: the chunked rows at m = 4 run compiled too (one graph per chunk): torch's schedules of two
#: stages per rank refuse ``torch.compile``, several compiled stages per rank are ours alone
COMPILED_CHUNKED = {f"{name}, compiled": name for name, (_, _, m) in CHUNKED.items() if m == 4}


class GPTTask(nn.Module):
    """The model under the pipeline contract (``forward`` + ``pipeline_loss``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyGPT(vocab=VOCAB, seq_len=SEQ, d_model=D, n_layers=LAYERS, n_heads=HEADS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def pipeline_loss(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------------------------------- runners
# Each ``_make_*`` builds one configuration on this rank and returns its step function; the
# worker builds them all, then times them in interleaved rounds (best round per run), so a
# busy neighbour on the 2 shared cores slows every run alike instead of a few unlucky ones.


def _make_single(rank: int, compiled: bool = False) -> Any:
    """One process, one thread, the whole batch (rank 1 idles at the barrier); ``compiled``:
    ``torch.compile`` (inductor) on the model, as one would compile a single process."""
    model = GPTTask()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        if rank == 0:
            loss = model.pipeline_loss(forward(x), (x, y))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def _make_ddp(rank: int) -> Any:
    model = nn.parallel.DistributedDataParallel(GPTTask())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    per = BATCH // WORLD
    xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    def step() -> None:
        loss = model.module.pipeline_loss(model(xs), (xs, ys))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _make_autopipe(rank: int, plan_json: str, compiled: bool = False) -> Any:
    """Through the runtime ``AutoPipeStrategy`` runs (trace, local stage, groups, executor);
    ``compiled``: ``compile=True`` (inductor)."""
    from lightning_autopipe.options import AutoPipeOptions
    from lightning_autopipe.runtime.pipeline import build_local_pipeline

    module = GPTTask()
    x, y = _data()
    plan = Plan.from_json(plan_json)

    def bcast(obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    pipe = build_local_pipeline(
        module,
        (x[:PROFILE_MB],),
        BATCH // plan.replicas,
        AutoPipeOptions(plan=plan, timeout=600, compile=compiled),
        rank=rank,
        world_size=WORLD,
        device=torch.device("cpu"),
        broadcast=bcast,
    )
    r, per = pipe.layout.replica, BATCH // plan.replicas
    batch = (x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
    return pipeline_step(pipe, batch, torch.optim.SGD(module.parameters(), lr=LR))


def pipeline_step(pipe: Any, batch: Any, opt: Any) -> Any:
    """A training step of ``pipe`` on ``batch`` with ``opt``, measured by the runtime's step
    monitor (:class:`~lightning_autopipe.runtime.monitor.StepMonitor`); each call leaves where
    the step went (:func:`step_breakdown`'s keys) on the function as ``stats`` and the monitor
    as ``monitor``."""
    mon = StepMonitor.for_pipeline(pipe)

    def step() -> None:
        with mon.step():
            pipe.executor.train_step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.stats = mon.last.measured.as_dict()  # type: ignore[attr-defined]

    step.monitor = mon  # type: ignore[attr-defined]
    return step


def breakdown_table(runs: dict[str, tuple[list[dict], Any, list[str]]]) -> list[str]:
    """Markdown rows of :func:`step_breakdown` per run and rank, beside the simulator's compute
    on that rank's device (``runs``: name -> (per-rank breakdowns, the run's simulation, the
    device name of each rank))."""
    lines = [
        "| run | rank | F | pred. F | B | pred. B | W | pred. W | RF wait | RB wait | sync "
        "| step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (stats, sim, devices) in runs.items():
        for r, st in enumerate(stats):
            pred = predicted_compute(sim, devices[r])
            lines.append(
                f"| {name} | {r} | {st['F']:.0f} | {pred['F']:.0f} | {st['B']:.0f} | "
                f"{pred['B']:.0f} | {st['W']:.0f} | {pred['W']:.0f} | {st['RF']:.0f} | "
                f"{st['RB']:.0f} | {st['sync']:.0f} | {st['step']:.0f} |"
            )
    return lines


def predicted_compute(sim: Any, device: str) -> dict[str, float]:
    """The simulator's compute ms on ``device`` in one step, per kind (F, B, W): the runtime
    monitor's :func:`~lightning_autopipe.runtime.monitor.predicted_compute`."""
    return monitor.predicted_compute(sim, device)


def step_breakdown(timeline: list[Any], t0: float, t1: float) -> dict[str, float]:
    """Where one executor step went, ms: compute per kind (F, B, W), blocked in receives of
    activations (RF) and gradients (RB), sends (SF, SB), the tail after the last action
    (waiting for sends, the loss broadcast, the gradient sync: ``sync``) and the whole step;
    the runtime monitor's :func:`~lightning_autopipe.runtime.monitor.breakdown`."""
    return monitor.breakdown(timeline, t0, t1).as_dict()


def _make_pipelining(rank: int, cut: int, schedule: str, m: int) -> Any:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = GPTTask()
    x, y = _data()
    blocks = split_model(module, (x[:PROFILE_MB],))
    submod = blocks.stage(*[(0, cut), (cut, len(blocks))][rank])
    stage = PipelineStage(submod, rank, WORLD, torch.device("cpu"))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out[0] if isinstance(out, tuple | list) else out
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, m, loss_fn=loss_fn)
    opt = torch.optim.SGD(submod.parameters(), lr=LR)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _make_pipelining_multi(rank: int, cuts: list[int], schedule: str, m: int) -> Any:
    """torch's zero-bubble schedules: two stages per rank (four stages over two ranks).

    ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` place them in a V (rank 0: stages 0
    and 3, rank 1: 1 and 2), ``ScheduleInterleavedZeroBubble`` round robin (rank r: stages r
    and r + 2); ``cuts`` are a time-balanced four-way split of the same blocks.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    module = GPTTask()
    x, y = _data()
    blocks = split_model(module, (x[:PROFILE_MB],))
    v_shape = schedule in ("zbv", "dualpipev")
    mine = (0, 3) if v_shape else (0, 2)
    if rank == 1:
        mine = (1, 2) if v_shape else (1, 3)
    stages = [PipelineStage(blocks.stage(cuts[i], cuts[i + 1]), i, 4, torch.device("cpu"))
              for i in mine]

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out[0] if isinstance(out, tuple | list) else out
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    cls = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV,
           "interleaved-zb": ScheduleInterleavedZeroBubble}[schedule]
    sched = cls(stages, m, loss_fn=loss_fn)
    params = list({id(p): p for st in stages for p in st.submod.parameters()}.values())
    opt = torch.optim.SGD(params, lr=LR)
    first = rank == 0  # holds stage 0 (inputs) under both placements; stage 3 (loss) too for V
    last = (rank == 0) if v_shape else (rank == 1)

    def step() -> None:
        kwargs: dict[str, Any] = {}
        if last:
            kwargs["target"] = y
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _make(rank: int, job: dict) -> Any:
    kind = job["kind"]
    if kind == "single":
        return _make_single(rank, job.get("compile", False))
    if kind == "ddp":
        return _make_ddp(rank)
    if kind == "autopipe":
        return _make_autopipe(rank, job["plan"], job.get("compile", False))
    if kind in TORCH_MULTI:
        return _make_pipelining_multi(rank, job["cuts"], kind, job["m"])
    return _make_pipelining(rank, job["cut"], kind, job["m"])


def _timed(step: Any, steps: int) -> tuple[float, Any]:
    """Median seconds per step (each step between barriers) and that step's stats, if any."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append((time.perf_counter() - t0, getattr(step, "stats", None)))
    times.sort(key=lambda t: t[0])
    return times[len(times) // 2]


def _worker(
    rank: int,
    port: int,
    jobs: list[dict],
    steps: int,
    warmup: int,
    rounds: int,
    out: str,
    reprofile: list[int],
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=900))
    results: dict[str, Any] = {}
    try:
        runners = {job["name"]: _make(rank, job) for job in jobs}
        for step in runners.values():
            for _ in range(warmup):
                step()
        best: dict[str, float] = {}
        stats: dict[str, Any] = {}
        best_round: dict[str, int] = {}
        each_round: dict[str, list[float]] = {name: [] for name in runners}
        round_profiles = []
        for r in range(rounds):
            # the machine's speed drifts over minutes: a profile taken in the same round prices
            # the plans at the speed their timings ran at (both ranks profile at once)
            dist.barrier()
            mine = {mb: p.to_json() for mb, p in _profiles(tuple(reprofile), rounds=1).items()}
            every: list[Any] = [None] * WORLD  # each rank's, so each rank is priced as it ran
            dist.all_gather_object(every, mine)
            round_profiles.append(every)
            for name, step in runners.items():
                sec, sample = _timed(step, steps)
                each_round[name].append(sec)
                if sec < best.get(name, float("inf")):
                    best[name], stats[name], best_round[name] = sec, sample, r
                if rank == 0:
                    print(f"  round {r} {name:<38} {sec * 1e3:8.1f} ms/step", flush=True)
        results.update(best)
        results["best round"] = best_round
        results["every round"] = each_round
        results["round profiles"] = round_profiles
        for name in runners:
            if stats[name] is not None:
                both: list[Any] = [None] * WORLD
                dist.all_gather_object(both, stats[name])
                results[name + " stats"] = both
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _profiles(sizes: tuple[int, ...], rounds: int) -> dict[int, Profile]:
    """Block profiles (loss on the last block) per micro-batch size, median of ``rounds``."""
    module = GPTTask()
    x, y = _data()
    blocks = split_model(module, (x[:PROFILE_MB],))

    def loss(outputs: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
        return module.pipeline_loss(blocks.unflatten_outputs(outputs), (x[:n], y[:n]))

    taken: dict[int, list[Profile]] = {mb: [] for mb in sizes}
    for _ in range(rounds):
        for mb in sizes:
            taken[mb].append(profile_blocks(blocks, (x[:mb],), repeats=3, loss_fn=loss))
    return {mb: median_profile(ps) for mb, ps in taken.items()}


def _profile_worker(rank: int, port: int, out: str) -> None:
    """Measure the gloo link, then profile every block (loss on the last) on both ranks at once.

    As ``AutoPipeStrategy`` does: the link figures replace ``Cluster.local``'s defaults, and both
    ranks profile together so the figures include the contention for the shared cores, caches
    and memory bandwidth that training sees.
    """
    from lightning_autopipe.runtime.action_overhead import measure_action_overhead
    from lightning_autopipe.runtime.calibrate import measure_link, measure_reduce

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        link = measure_link()
        link = (*link, measure_reduce(link))
        # the runtime's own cost per compute action, measured on both ranks at once (the
        # slower one's: Cluster.local is homogeneous); the plans price it on every action
        both: list[Any] = [None] * WORLD
        dist.all_gather_object(both, measure_action_overhead())
        link = (*link, max(both))
    finally:
        dist.destroy_process_group()
    # One profile per micro-batch size: on a CPU a block's time is not linear in the batch
    # (caches, small GEMMs), so each candidate is priced at its own size. The sizes are
    # profiled in interleaved rounds and combined by median, so that a noisy second on the
    # shared machine skews no size against the others.
    profiles = {mb: p.to_json() for mb, p in _profiles((2, 4, 8, 16), rounds=3).items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"link": link, "profiles": profiles}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------- main
def _variant(
    plan: Plan,
    *,
    startup_slices: int | None = None,
    drain_slices: int | None = None,
    cut: int | None = None,
) -> Plan:
    data = plan.to_dict()
    if startup_slices is not None:
        data["startup_slices"] = startup_slices
    if drain_slices is not None:
        data["drain_slices"] = drain_slices
    if cut is not None:
        stages = [
            StagePlan((0, cut), plan.stages[0].devices),
            StagePlan((cut, plan.num_blocks), plan.stages[1].devices),
        ]
        data["stages"] = [{"blocks": s.blocks, "devices": s.devices} for s in stages]
    data["planner"] = plan.planner
    return Plan.from_dict(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; best is kept")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "runtime.md"))
    ap.add_argument("--only", nargs="*", default=None, help="debug: run only these rows (substr)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    command = "python benchmarks/runtime.py " + " ".join(sys.argv[1:])
    load0 = os.getloadavg()

    print("profiling (2 processes at once, 1 thread each, loss on the last block) ...", flush=True)
    module = GPTTask()
    x, _ = _data()
    blocks = split_model(module, (x[:PROFILE_MB],))
    prof_out = Path(args.out).with_suffix(".profiles.tmp")
    mp.spawn(_profile_worker, args=(_free_port(), str(prof_out)), nprocs=WORLD)
    got = json.loads(prof_out.read_text())
    prof_out.unlink()
    profiles = {int(k): Profile.from_json(v) for k, v in got["profiles"].items()}
    latency_us, gbps, reduce, overhead = got["link"]
    print(
        f"planning (gloo link measured: {gbps:.1f} Gb/s, {latency_us:.0f} us; all-reduce "
        f"reduces at {reduce:.1f} Gb/s; the runtime adds {overhead:.2f} ms per action) ...",
        flush=True,
    )
    cluster = Cluster.local(WORLD, gbps=gbps, latency_us=latency_us, reduce_gbps=reduce,
                            overhead_ms=overhead)
    names = [d.name for d in cluster.devices]
    common = dict(devices=names, uniform_replicas=True, use_all_devices=True)
    pinned = _pinned_sliced(profiles, cluster, common)
    one = _pinned_sliced(profiles, cluster, common, schedules=("1f1b",))
    zb = _pinned_sliced(profiles, cluster, common, schedules=("zb-h1",))
    auto = _auto(profiles, cluster, common)
    layer4 = next(i for i, n in enumerate(blocks.names) if ".h.4." in f".{n}.")
    equal = _variant(one, cut=layer4)  # may coincide with the planner's cut
    cut = one.stages[0].blocks[1]
    rows: list[tuple[str, Plan | None]] = [
        ("AutoPipe pinned 2 stages, sliced", pinned),
        (EAGER_PIPE, one),
        ("AutoPipe pinned 2 stages, 1F1B no slicing",
         _variant(one, startup_slices=1, drain_slices=1)),
        (EAGER_ZB, zb),
        ("AutoPipe pinned 2 stages, ZB-H1 no slicing",
         _variant(zb, startup_slices=1, drain_slices=1)),
        ("AutoPipe runtime, equal-layer split", equal),
        ("AutoPipe all auto", auto),
        *((name, _chunked_plan(profiles, cluster, names, *spec))
          for name, spec in CHUNKED.items()),
    ]
    jobs: list[dict] = [
        {"name": "single process", "kind": "single"},
        {"name": COMPILED_SINGLE, "kind": "single", "compile": True},
        {"name": "DDP", "kind": "ddp"},
    ]
    same_cut = equal.cuts == pinned.cuts
    jobs += [
        {"name": name, "kind": "autopipe", "plan": p.to_json()}
        for name, p in rows
        if not (same_cut and p is equal)
    ]
    jobs.append({"name": COMPILED_PIPE, "kind": "autopipe", "plan": one.to_json(),
                 "compile": True})
    jobs.append({"name": COMPILED_ZB, "kind": "autopipe", "plan": zb.to_json(),
                 "compile": True})
    plan_of = dict(rows)
    jobs += [{"name": name, "kind": "autopipe", "plan": plan_of[eager].to_json(), "compile": True}
             for name, eager in COMPILED_CHUNKED.items()]
    for sched in ("1f1b", "gpipe"):
        for m in (4, 8, 16):
            jobs.append({"name": f"pipelining {sched} m={m}", "kind": sched, "cut": cut, "m": m})
    cuts4 = balanced_cuts(BlockCosts.from_profile(profiles[PROFILE_MB]).compute, [1.0] * 4)
    for sched in TORCH_MULTI:
        for m in (4, 8):
            jobs.append({"name": f"pipelining {sched} m={m}", "kind": sched, "cuts": cuts4,
                         "m": m})

    if args.only is not None:  # debugging a few rows: no table
        jobs = [j for j in jobs if any(o in j["name"] for o in args.only)]
    print(f"2 ranks x 1 thread, {args.rounds} interleaved rounds ...", flush=True)
    out = Path(args.out).with_suffix(".json.tmp")
    reprofile = sorted({p.microbatch_size for _, p in rows})
    spawn_args = (_free_port(), jobs, args.steps, args.warmup, args.rounds, str(out), reprofile)
    mp.spawn(_worker, args=spawn_args, nprocs=WORLD)
    measured = json.loads(out.read_text())
    out.unlink()
    if args.only is not None:
        return
    single = measured["single process"]
    load1 = os.getloadavg()

    def best(sched: str) -> tuple[str, float]:
        name = min((j["name"] for j in jobs if j["kind"] == sched), key=measured.__getitem__)
        return name, measured[name]

    table = _table(single, measured, rows, best, profiles, cluster, blocks, cut)
    table += _compiled_table(measured, plan_of, best_zero_bubble(measured))
    text = "\n".join(
        [
            f"Reproduce: `{command.strip()}`",
            "",
            f"GPT vocab {VOCAB} / seq {SEQ} / {LAYERS} layers / d {D} / {HEADS} heads, global "
            f"batch {BATCH}, fp32, SGD; {WORLD} ranks x 1 thread (gloo) vs 1 process x 1 thread; "
            f"each run: best of {args.rounds} interleaved rounds of the median of {args.steps} "
            f"steps, after {args.warmup} warm-up steps; load average "
            f"before/after {load0[0]:.2f}/{load1[0]:.2f} on {os.cpu_count()} cores. Predictions: "
            f"blocks profiled on both ranks at once inside whole forward/backward passes (loss "
            f"on the last block), gloo link measured at {gbps:.1f} Gb/s and {latency_us:.0f} us "
            f"per message, its all-reduce reducing at {reduce:.1f} Gb/s (the sums and copies "
            "a gradient all-reduce does on the CPU besides moving the bytes), the runtime's own "
            f"cost per compute action measured at {overhead:.2f} ms (`runtime/action_overhead"
            ".py`, priced on every F, B and W). 'predicted ms': "
            "the simulator on the profile the plans were made from "
            "(taken before the timings); 'pred. same round': on the profiles both ranks took "
            "at once at the start of the round whose timing is reported, each rank priced on "
            "its own (the machine's speed drifts by several percent over minutes, and two "
            "processes on two cores do not run at one speed); its 'measured/pred': the median "
            "over the rounds of each round's step against that round's prediction (a one-round "
            "profile is itself a few percent noisy).",
            "",
            *table,
        ]
    )
    publish(text, args.out)


def _plan(profiles: dict[int, Any], cluster: Cluster, common: dict, **pins: Any) -> Plan:
    mb = BATCH // (pins["replicas"] * pins["num_microbatches"])
    return make_plan(profiles[mb], cluster, BATCH, **pins, **common)


def _pinned_sliced(
    profiles: dict[int, Any], cluster: Cluster, common: dict,
    schedules: tuple[str, ...] = ("1f1b", "zb-h1"),
) -> Plan:
    """The planner's best 2-stage plan with startup slicing, over m in {4, 8, 16}.

    (Unpinned, the planner may pick k = 1; this row is about slicing, so k >= 2 is required
    and, failing that, k = 2 is pinned at the best m.)
    """
    pins = dict(num_stages=2, replicas=1, schedules=schedules)
    plans = [_plan(profiles, cluster, common, num_microbatches=m, **pins) for m in (4, 8, 16)]
    sliced = [p for p in plans if p.startup_slices >= 2]
    if sliced:
        return min(sliced, key=lambda p: p.iteration_ms)
    m = min(plans, key=lambda p: p.iteration_ms).num_microbatches
    return _plan(profiles, cluster, common, num_microbatches=m, startup_slices=2, **pins)


def _auto(profiles: dict[int, Any], cluster: Cluster, common: dict) -> Plan:
    """Everything on auto, planned as ``AutoPipeStrategy`` plans: from one profile.

    The strategy profiles once, at its example's size, and ``make_plan`` prices other unit
    sizes with the profile's fixed/per-sample split; depth, width, m, k and j are all its
    choice (``search_plan`` keeps the fastest depth). Only the global batch is held at
    ``BATCH`` here, so that every row trains the same samples per step.
    """
    plans = []
    for stages in (1, 2):
        try:
            plans.append(
                make_plan(
                    profiles[PROFILE_MB],
                    cluster,
                    BATCH,
                    num_stages=stages,
                    replicas=WORLD // stages,
                    **common,
                )
            )
        except PlanError:
            continue
    return min(plans, key=lambda p: p.iteration_ms)


def _chunked_plan(profiles: dict[int, Any], cluster: Cluster, names: list[str], schedule: str,
                  v: int, m: int | None) -> Plan:
    """The AutoPipe partitioner's plan of 2 ranks x ``v`` chunks under ``schedule``: the
    chunk cuts (each rank's share of the work from the profile, walked to the fast model's
    local optimum) and the startup/drain slices that the search's chunked step
    (:mod:`~lightning_autopipe.planner.vsearch`) picks, each m priced on its own micro-batch
    size's profile; the fastest simulated of m in {4, 8, 16} unless ``m`` is pinned.

    The search itself may prefer another number of chunks (``v`` is its choice); the rows pin
    it so that they compare with torch's two-stages-per-rank schedules like for like.
    """
    from lightning_autopipe.planner.search import finish_plan
    from lightning_autopipe.planner.vsearch import _chunked

    plans = []
    for mm in (m,) if m else (4, 8, 16):
        prof = profiles[BATCH // mm]
        costs = BlockCosts.from_profile(prof, cluster)
        base = Proposal([[names[0]], [names[1]]], [0, 1, costs.num_blocks], mm, 2)
        _, prop = _chunked(costs, cluster, base, BATCH, 2.0, schedule, v)
        plans.append(finish_plan(prop, "autopipe", prof, cluster, BATCH))
    return min(plans, key=lambda p: p.iteration_ms)


def per_rank_cluster(cluster: Cluster, profiles: list[Profile]) -> Cluster:
    """``cluster`` (one server, rank ``r`` = its device ``r``) with every device a type of its
    own that prices blocks from ``profiles[r]``, the profile that rank took: two processes on
    two cores of one machine do not run at one speed (another process shares a core, caches
    and clocks differ), so each rank is priced as fast as it measured itself, as discovery
    prices unequal ranks."""
    (server,) = cluster.servers
    specs = [replace(server.device_at(r), name=f"{server.device_at(r).name}-rank{r}",
                     profile=prof) for r, prof in enumerate(profiles)]
    own = replace(server, device=specs[0], devices=tuple(enumerate(specs))[1:])
    return replace(cluster, servers=[own])


def _describe(plan: Plan) -> str:
    cuts = "/".join(str(s.blocks[1] - s.blocks[0]) for s in plan.stages)
    shape = f"{plan.num_stages}x{plan.replicas}"
    if plan.chunks_per_rank > 1:
        shape = f"{plan.num_ranks} ranks x {plan.chunks_per_rank} chunks ({plan.placement})"
    return (
        f"{shape}, blocks {cuts}, m={plan.num_microbatches}, "
        f"k={plan.startup_slices}, j={plan.drain_slices}, {plan.schedule}"
    )


def _table(single, measured, rows, best, profiles, cluster, blocks, cut) -> list[str]:
    rate = BATCH / single
    lines = [
        "| run | layout | ms/step | samples/s | x single | predicted ms | measured/pred |"
        " pred. same round | measured/pred |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| single process | 1 thread | {single * 1e3:.0f} | {rate:.1f} | 1.00 | | | | |",
    ]

    def row(name: str, layout: str, sec: float, *preds: tuple[float, float]) -> str:
        p = " | ".join(f"{q:.0f} | {ratio:.3f}" for q, ratio in preds) if preds else " | | |"
        return (
            f"| {name} | {layout} | {sec * 1e3:.0f} | {BATCH / sec:.1f} | "
            f"{single / sec:.2f} | {p} |"
        )

    same_round_ratios: list[float] = []
    same_round = {}  # name -> the simulated step on the profile of the row's best round
    for name, plan in rows:
        if name not in measured:  # the equal-layer split is the planner's own cut
            lines.append(f"| {name} | = the pinned row's cut ({_describe(plan)}) | | | | | | | |")
            continue
        mb = plan.microbatch_size
        pred = simulate(plan, profiles[mb], cluster).iteration_ms
        sims = []  # per round: the simulated step on the profiles the ranks took in that round
        for by_rank in measured["round profiles"]:
            same = [Profile.from_json(taken[str(mb)]) for taken in by_rank]
            sims.append(simulate(plan, same[0], per_rank_cluster(cluster, same)))
        same_round[name] = sims[measured["best round"][name]]
        ratio = statistics.median(sec * 1e3 / sim.iteration_ms
                                  for sec, sim in zip(measured["every round"][name], sims))
        same_round_ratios.append(ratio)
        lines.append(row(name, _describe(plan), measured[name],
                         (pred, measured[name] * 1e3 / pred),
                         (same_round[name].iteration_ms, ratio)))
    lines.append(row("DDP", "1x2", measured["DDP"]))
    for sched in ("1f1b", "gpipe"):
        for m in (4, 8, 16):
            name = f"pipelining {sched} m={m}"
            lines.append(row(name, f"2x1, blocks {cut}/{len(blocks) - cut}", measured[name]))
    for sched, place in TORCH_MULTI.items():
        for m in (4, 8):
            name = f"pipelining {sched} m={m}"
            if name in measured:
                lines.append(row(name, f"4 stages on 2 ranks ({place})", measured[name]))
    lines += [
        "",
        "Where an AutoPipe step goes (the median step of its best round, per rank, ms): forward /"
        " backward / weight-gradient (W, zero-bubble) compute,"
        " blocked in receives of activations (RF) / gradients (RB), gradient sync after the last"
        " action; 'pred.': the simulator's compute on that rank from the same-round profile.",
        "",
        *breakdown_table({
            name: (measured.get(name + " stats", []), sim, [d.name for d in cluster.devices])
            for name, sim in same_round.items()
        }),
    ]
    b1_name, b1 = best("1f1b")
    zb_rows = zero_bubble_rows(measured)
    zb_name = best_zero_bubble(measured)
    chunked = [n for n in CHUNKED if n in measured]
    ch_name = min(chunked, key=measured.__getitem__) if chunked else None
    ch4 = [n for n in chunked if CHUNKED[n][2] == 4]
    ch4_name = min(ch4, key=measured.__getitem__) if ch4 else None
    zb4 = [n for n in zb_rows if n.endswith("m=4")]
    zb4_name = min(zb4, key=measured.__getitem__) if zb4 else None
    pinned = measured[rows[0][0]]
    auto = measured[next(name for name, _ in rows if name == "AutoPipe all auto")]
    worst = max(abs(r - 1) for r in same_round_ratios)
    lines += [
        "",
        "| target | value | goal |",
        "|---|---:|---|",
        f"| pinned AutoPipe / single process | {single / pinned:.2f}x | >= 1.80x |",
        f"| pinned AutoPipe / best Schedule1F1B ({b1_name}) | {b1 / pinned:.3f}x | >= 1.10x |",
        *([f"| pinned AutoPipe / best torch zero-bubble ({zb_name}) | "
           f"{measured[zb_name] / pinned:.3f}x | >= 1.00x |"] if zb_name else []),
        f"| auto AutoPipe / DDP | {measured['DDP'] / auto:.3f}x | >= 0.95x |",
        *([f"| best chunked AutoPipe ({ch_name}) / single process | "
           f"{single / measured[ch_name]:.2f}x | >= 1.85x |"] if ch_name else []),
        *([f"| best chunked AutoPipe ({ch_name}) / best torch zero-bubble ({zb_name}) | "
           f"{measured[zb_name] / measured[ch_name]:.3f}x | >= 1.05x |"]
          if ch_name and zb_name else []),
        *([f"| chunked AutoPipe at m=4 ({ch4_name}) / torch zero-bubble at m=4 ({zb4_name}) | "
           f"{measured[zb4_name] / measured[ch4_name]:.3f}x | (like for like) |"]
          if ch4_name and zb4_name else []),
        f"| largest measured/predicted gap, same-round profile | {worst:.1%} | <= 5% |",
    ]
    return lines


def zero_bubble_rows(measured: dict[str, Any]) -> list[str]:
    """The measured rows of torch's schedules of two stages per rank."""
    names = [f"pipelining {s} m={m}" for s in TORCH_MULTI for m in (4, 8)]
    return [n for n in names if n in measured]


def best_zero_bubble(measured: dict[str, Any]) -> str | None:
    """The fastest of :func:`zero_bubble_rows`, if any ran."""
    names = zero_bubble_rows(measured)
    return min(names, key=measured.__getitem__) if names else None


def _compiled_table(measured: dict[str, Any], plans: dict[str, Plan],
                    zb_name: str | None) -> list[str]:
    """Compiled vs eager: one process, the pinned 1F1B sliced pipeline, the pinned ZB-H1
    sliced pipeline (its compiled backward split into B and W graphs) and the chunked rows at
    m = 4, with the targets."""
    single, single_c = measured["single process"], measured[COMPILED_SINGLE]
    rows = [("single process", single, single_c, "1 thread")] + [
        (eager, measured[eager], measured[compiled], _describe(plans[eager]))
        for eager, compiled in ((EAGER_PIPE, COMPILED_PIPE), (EAGER_ZB, COMPILED_ZB))]
    chunked = [(eager, measured[eager], measured[name], _describe(plans[eager]))
               for name, eager in COMPILED_CHUNKED.items() if name in measured]
    lines = [
        "",
        "Compiled (inductor; single process: `torch.compile` on the model; AutoPipe: "
        "`compile=True`, each stage compiled once with an unbacked batch dimension; under ZB-H1 "
        "the last stage's compiled backward is cut into an input-gradient and a weight-gradient "
        "graph):",
        "",
        "| run | layout | eager ms/step | compiled ms/step | compiled speed-up |",
        "|---|---|---:|---:|---:|",
    ]
    for name, eager, compiled, layout in rows + chunked:
        lines.append(f"| {name} | {layout} | {eager * 1e3:.0f} | {compiled * 1e3:.0f} | "
                     f"{eager / compiled:.2f}x |")
    lines += ["", "| target | value | goal |", "|---|---:|---|"]
    for name, eager, compiled, _ in rows[1:]:
        short = "1F1B" if name == EAGER_PIPE else "ZB-H1"
        lines += [
            f"| compiled {short} pipeline / eager {short} pipeline | {eager / compiled:.2f}x "
            "| > 1.00x |",
            f"| compiled {short} pipeline / compiled single process (vs eager: "
            f"{single / eager:.2f}x) | {single_c / compiled:.2f}x | >= {single / eager:.2f}x |",
        ]
    lines.append(f"| compiled ZB-H1 / compiled 1F1B | "
                 f"{measured[COMPILED_PIPE] / measured[COMPILED_ZB]:.3f}x | (zero bubble's "
                 "gain, compiled) |")
    if chunked:
        name, _, compiled, _ = min(chunked, key=lambda row: row[2])
        lines.append(f"| best compiled chunked AutoPipe ({name}) / single process | "
                     f"{single / compiled:.2f}x | (eager target: >= 1.85x) |")
        if zb_name is not None:
            lines.append(
                f"| best compiled chunked AutoPipe ({name}) / best torch zero-bubble "
                f"({zb_name}, eager: torch's schedules of two stages per rank refuse "
                f"`torch.compile`) | {measured[zb_name] / compiled:.3f}x | (eager target: "
                ">= 1.05x) |")
    return lines


if __name__ == "__main__":
    main()
