"""Closed-loop benchmark: live re-planning while a neighbour slows rank 1, then leaves.

    .venv/bin/python benchmarks/adaptive.py [--steps 30] [--drift 10 25 40] [--out FILE]
        [--cases slowed drift]

The GPT, batch and core pinning of ``benchmarks/hetero.py`` (two gloo ranks, one thread each,
rank r pinned to core r, SGD, 32 samples per step), trained through ``Trainer`` and
``AutoPipeStrategy`` (discovery, ``cluster=None``; 2 stages pinned, so the data-parallel
layout a switch must keep is the pipeline's), each run launched afresh, one after another:

* one process on the fast core, the neighbour on the other (hetero's baseline), timed before,
  between and after the slowed runs (each run is compared with the timings on either side);
* slowed, ``replan="auto"`` and ``"off"``: a CPU-bound neighbour shares rank 1's core from
  before the launch (discovery sees it) to the end;
* drift, ``"auto"`` and ``"off"``: discovery and the first plan see two alike cores; rank 0
  starts the neighbour at the start of step ``--drift[0]`` and kills it at the start of step
  ``--drift[1]``, of ``--drift[2]``.

Re-planning checks every ``--window`` steps after a plan's first (warm-up) step, so first
``--window`` + 1 steps after the start or a switch (``replan_window`` = ``replan_min_steps``),
threshold ``--threshold``. A step's time is the
wall time between two ends of a training batch on rank 0 (a switch made in that step's
``optimizer_step`` included); where it went on each rank (compute, receive waits, the tail)
comes from the strategy's step monitor. The report is :mod:`benchmarks.adaptive_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_autopipe  # noqa: E402
from benchmarks._publish import publish  # noqa: E402
from benchmarks.adaptive_report import report  # noqa: E402
from benchmarks.hetero import _single, free_port, neighbour_on, start_neighbour, stop_neighbour  # noqa: E402
from benchmarks.runtime import BATCH, LR, GPTTask, _data  # noqa: E402
from lightning_autopipe.lightning import telemetry  # noqa: E402

WORLD = 2
COMMAND = ".venv/bin/python benchmarks/adaptive.py"
NEIGHBOUR_S = 1800  # every neighbour's own deadline, should the benchmark die first


class Task(pl.LightningModule):
    """hetero's GPT as a LightningModule: the same fixed batch every step, SGD."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.net = GPTTask()
        self.steps = steps

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def pipeline_loss(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.net.pipeline_loss(logits, batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        x, y = _data()
        data = TensorDataset(x.repeat(self.steps, 1), y.repeat(self.steps, 1))
        return DataLoader(data, batch_size=BATCH)


class StepLog(pl.Callback):
    """Every step's wall time and the monitor's breakdown of it on this rank; on rank 0 of a
    drift run, the neighbour's start and stop."""

    def __init__(self, drift: list[int] | None, core: int) -> None:
        self.drift, self.core = drift, core
        self.rows: list[dict[str, Any]] = []
        self.neighbour: Any = None
        self.events: list[tuple[str, int, float]] = []
        self.verdicts: list[dict[str, Any]] = []
        self.first_plan = ""
        self.discovered: dict[str, float] = {}
        self._created = self._last = time.perf_counter()
        self.setup_s = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last = time.perf_counter()
        self.setup_s = self._last - self._created  # launch, discovery, planning, build
        self.first_plan = trainer.strategy.pipeline.plan.to_json()
        # discovery's speeds (a switch or a re-calibration gives the pipeline measured ones)
        self.discovered = {d.name: d.spec.speed for d in trainer.strategy.cluster.devices}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        if not self.drift or trainer.global_rank != 0:
            return
        step = trainer.global_step
        if step == self.drift[0]:
            self.neighbour = start_neighbour(self.core, NEIGHBOUR_S)
            self.events.append(("neighbour starts", step, os.getloadavg()[0]))
        elif step == self.drift[1]:
            self._stop()
            self.events.append(("neighbour stops", step, os.getloadavg()[0]))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, out: Any, batch: Any,
                           i: int) -> None:
        now = time.perf_counter()
        strategy = trainer.strategy
        mon = telemetry.monitor_of(strategy)
        row = mon.last.measured.as_dict() if mon is not None and mon.last else {}
        self.rows.append({"wall": (now - self._last) * 1e3, "switches": len(strategy.switches),
                          "load": os.getloadavg()[0], **row})
        self._last = now
        replanner = strategy._replanner  # the strategy keeps only the last verdict
        if replanner.checks > len(self.verdicts):
            v = replanner.last_verdict
            self.verdicts.append({"step": v.step, "switch": v.switch, "reason": v.reason,
                                  "measured_ms": v.measured_step_ms,
                                  "candidate_ms": v.candidate_step_ms,
                                  "speeds": dict(v.speeds)})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exc: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.neighbour is not None:
            stop_neighbour(self.neighbour)
            self.neighbour = None


def _rank_main(rank: int, port: int, cores: list[int], run: dict, out: str) -> None:
    os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", LOCAL_RANK=str(rank))
    strategy = lightning_autopipe.AutoPipeStrategy(
        num_stages=run["stages"], replan=run["replan"], replan_window=run["window"],
        replan_min_steps=run["window"], replan_threshold=run["threshold"], timeout=900,
    )
    log = StepLog(run.get("drift"), cores[1])
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=run["steps"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[log], default_root_dir=str(Path(out) / run["name"]),
    )
    trainer.fit(Task(run["steps"]))
    record = {
        "rank": rank, "rows": log.rows, "events": log.events, "verdicts": log.verdicts,
        "first_plan": log.first_plan, "setup_s": log.setup_s,
        "speeds": log.discovered,
        "recalibrations": [dict(vars(r)) for r in strategy._replanner.recalibrations],
        "switches": [dict(vars(s)) for s in strategy.switches],
        "stage": strategy.pipeline.layout.stage,
    }
    (Path(out) / f"{run['name']}.rank{rank}.json").write_text(json.dumps(record))


def _single_main(rank: int, cores: list[int], steps: int, out: str) -> None:
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    step = _single(0)
    step()  # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    (Path(out) / "single.json").write_text(json.dumps({"rows": times,
                                                       "load": os.getloadavg()[0]}))


def _single_run(cores: list[int], steps: int, work: Path) -> dict:
    mp.spawn(_single_main, args=(cores, steps, str(work)), nprocs=1, join=True)
    return json.loads((work / "single.json").read_text())


def _launch(run: dict, cores: list[int], work: Path) -> list[dict]:
    """One run's two ranks, launched afresh; every rank's record, in rank order."""
    print(f"run {run['name']} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    mp.spawn(_rank_main, args=(free_port(), cores, run, str(work)), nprocs=WORLD, join=True)
    return [json.loads((work / f"{run['name']}.rank{r}.json").read_text())
            for r in range(WORLD)]


def _command(args: Any) -> str:
    return (f"{COMMAND} --steps {args.steps} --drift {' '.join(map(str, args.drift))} "
            f"--single-steps {args.single_steps} --window {args.window} "
            f"--threshold {args.threshold} --stages {args.stages}"
            + (f" --cases {' '.join(args.cases)}" if len(args.cases) < 2 else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps of each slowed run")
    p.add_argument("--drift", type=int, nargs=3, default=[10, 25, 40],
                   metavar=("START", "STOP", "STEPS"))
    p.add_argument("--single-steps", type=int, default=6)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.1)
    p.add_argument("--stages", default="auto",
                   help="num_stages of every run: 'auto' (the planner's depth: a pipeline, or "
                        "two data-parallel replicas with uneven batches) or a pinned depth")
    p.add_argument("--out", help="also write the table here (markdown)")
    p.add_argument("--report", help="only print the tables of a saved adaptive.json")
    p.add_argument("--cases", nargs="+", choices=("slowed", "drift"),
                   default=["slowed", "drift"], help="which cases to run (default both)")
    args = p.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text()), _command(args), args.drift))
        return 0
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        print("needs two cores: one per rank", file=sys.stderr)
        return 2
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"autopipe-adaptive-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    common = {"window": args.window, "threshold": args.threshold,
              "stages": args.stages if args.stages == "auto" else int(args.stages)}
    runs: dict[str, Any] = {}
    singles: list[dict] = []
    with neighbour_on(cores[1], NEIGHBOUR_S):
        # One process timed before, between and after the slowed runs: each run's
        # x-one-process ratio is taken against the timings on either side of it, under the
        # load of its own minutes.
        singles.append(_single_run(cores, args.single_steps, work))
        near: dict[str, list[float]] = {}
        for replan in ("auto", "off") if "slowed" in args.cases else ():
            name = f"slowed-{replan}"
            runs[name] = _launch({"name": name, "replan": replan, "steps": args.steps,
                                  **common}, cores, work)
            singles.append(_single_run(cores, args.single_steps, work))
            near[name] = singles[-2]["rows"] + singles[-1]["rows"]
        runs["single-near"] = near
    for replan in ("auto", "off") if "drift" in args.cases else ():
        runs[f"drift-{replan}"] = _launch(
            {"name": f"drift-{replan}", "replan": replan, "steps": args.drift[2],
             "drift": args.drift[:2], **common}, cores, work)
    if "drift" in args.cases:
        with neighbour_on(cores[1], NEIGHBOUR_S):  # once more at the end: the load moves
            singles.append(_single_run(cores, args.single_steps, work))
    runs["single"] = {"rows": [t for one in singles for t in one["rows"]],
                      "load": sum(one["load"] for one in singles) / len(singles)}
    (work / "adaptive.json").write_text(json.dumps(runs))
    print(f"records: {work / 'adaptive.json'}", file=sys.stderr)
    publish(report(runs, _command(args), args.drift), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
