"""``python -m lightning_autopipe plan``: plan a profiled model on a cluster, print the plan."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lightning_autopipe.errors import AutoPipeError
from lightning_autopipe.planner.generators import AUTO_SCHEDULES, GENERATORS
from lightning_autopipe.planner.report import format_plan
from lightning_autopipe.profile import Profile

__all__ = ["device_mismatch", "plan_main", "resolve_cluster_path"]

_CONF = Path(__file__).resolve().parents[2] / "conf" / "cluster"


def resolve_cluster_path(name: str) -> Path:
    """A cluster YAML path, or the name of one under ``conf/cluster`` (``mixed_rack``)."""
    p = Path(name)
    if p.exists():
        return p
    for cand in (_CONF / name, _CONF / f"{name}.yaml", Path("conf/cluster") / f"{name}.yaml"):
        if cand.exists():
            return cand
    return p


def _cluster(name: str, world_size: int | None) -> Any:
    """The ``--cluster`` argument as a Cluster; errors list what exists and how to fix."""
    from lightning_autopipe.cluster import Cluster
    from lightning_autopipe.errors import ClusterError

    if name == "local":
        if world_size is None or world_size < 1:
            given = "" if world_size is None else f" (got --world-size {world_size})"
            raise ClusterError(
                "--cluster local describes the processes a run launches on this machine; pass "
                "--world-size N, N >= 1, to plan for N of them (default CPU link figures; a "
                f"training run measures the real ones), or name a cluster file{given}"
            )
        return Cluster.local(world_size)
    path = resolve_cluster_path(name)
    if not path.exists():  # the name first: a misspelt one is the likelier mistake
        known = ", ".join(sorted(p.stem for p in _CONF.glob("*.yaml")))
        raise ClusterError(
            f"no cluster file {name!r}; pass a YAML path or one of the names under "
            f"{_CONF}: {known}"
        )
    if world_size is not None:
        raise ClusterError("--world-size only applies to --cluster local; a cluster file "
                           "lists its devices itself")
    return Cluster.load(path)


def device_mismatch(profile: Profile, cluster: Any) -> str | None:
    """Why a CPU-measured profile misprices ``cluster``'s accelerators, or None.

    A device type's ``speed`` is relative to the profiled device, so GPUs priced from a CPU
    profile come out at CPU speed times that figure: the plan's shape may still be useful, its
    step times are not. Types with their own profile are priced from it and are fine.
    """
    if not str(profile.device).lower().startswith("cpu"):
        return None
    foreign = sorted({
        d.spec.name for d in cluster.devices
        if d.spec.profile is None and "cpu" not in d.spec.name.lower()
    })
    if not foreign:
        return None
    return (
        f"the profile was measured on {profile.device!r} but cluster {cluster.name!r} describes "
        f"{', '.join(foreign)}, whose speed is taken relative to the profiled device: the "
        "predicted step times are this CPU's, scaled. Profile on the cluster's device "
        "(python -m lightning_autopipe profile --device cuda ...), give each device type its "
        "own profile in the cluster file, or plan the recipes with --plan-only (FLOP-based "
        "profiles for GPU clusters)"
    )


def _parser() -> argparse.ArgumentParser:
    from lightning_autopipe.planner.search import PLANNERS

    p = argparse.ArgumentParser(
        prog="python -m lightning_autopipe plan",
        description="Choose stages, replicas, micro-batches and slices for a profiled "
        "model on a cluster, and predict the step with the simulator.",
    )
    p.add_argument("--profile", required=True, help="Profile JSON (python -m ... profile)")
    p.add_argument("--cluster", required=True,
                   help="cluster YAML, or a name under conf/cluster (e.g. mixed_rack); 'local' "
                   "with --world-size N: N processes on this machine (default CPU link figures)")
    p.add_argument("--world-size", type=int, help="processes of the 'local' cluster")
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per step")
    p.add_argument("--planner", choices=PLANNERS, default="autopipe")
    p.add_argument("--stages", type=int, help="pin the pipeline depth")
    p.add_argument("--replicas", type=int, help="pin the data-parallel width")
    p.add_argument("--micro-batches", type=int, help="pin micro-batches per replica")
    p.add_argument("--startup-slices", type=int, help="pin the slices of micro-batch 0")
    p.add_argument("--drain-slices", type=int, help="pin the slices of the last micro-batch")
    p.add_argument("--schedule", default="auto", choices=["auto", *sorted(GENERATORS)],
                   help="pin the schedule (auto: the fastest of " + ", ".join(AUTO_SCHEDULES)
                   + "; interleaved-1f1b and zbv run several stage chunks per rank)")
    p.add_argument("--devices", help="comma-separated device names to restrict to")
    p.add_argument("--uniform-replicas", action="store_true",
                   help="same replica count on every stage (what the runtime executes)")
    p.add_argument("--use-all-devices", action="store_true",
                   help="stages x replicas must equal the device count")
    p.add_argument("--even-replicas", action="store_true",
                   help="even replica batches (default: replicas of unlike speed train uneven "
                        "shares when predicted faster, as the strategy plans them)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="return the best plan even if it does not fit device memory")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--out", help="also save the plan JSON here")
    p.add_argument("--trace", help="write the simulated step as a Chrome/Perfetto trace JSON")
    p.add_argument("--png", help="write the simulated step as a Gantt chart PNG")
    return p


def plan_main(argv: list[str]) -> int:
    """Entry point of ``python -m lightning_autopipe plan``; returns the exit status."""
    args = _parser().parse_args(argv)
    from lightning_autopipe.planner.replica_batches import balance_replicas
    from lightning_autopipe.planner.search import make_plan

    try:
        profile = Profile.load(args.profile)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read profile {args.profile}: {exc}", file=sys.stderr)
        return 2
    try:
        cluster = _cluster(args.cluster, args.world_size)
        mismatch = device_mismatch(profile, cluster)
        if mismatch:
            print(f"warning: {mismatch}", file=sys.stderr)
        plan = make_plan(
            profile, cluster, args.global_batch_size, planner=args.planner,
            num_stages=args.stages, replicas=args.replicas,
            num_microbatches=args.micro_batches, startup_slices=args.startup_slices,
            drain_slices=args.drain_slices,
            schedules=AUTO_SCHEDULES if args.schedule == "auto" else (args.schedule,),
            devices=args.devices.split(",") if args.devices else None,
            uniform_replicas=args.uniform_replicas, use_all_devices=args.use_all_devices,
            memory_check=not args.no_memory_check,
        )
        if not args.even_replicas and len({s.replicas for s in plan.stages}) == 1:
            plan = balance_replicas(plan, profile, cluster)
    except AutoPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _write(args, plan, profile, cluster)
    except OSError as exc:
        print(f"error: cannot write {exc.filename or 'an output file'}: {exc.strerror or exc}; "
              "pass a path in a writable folder", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else format_plan(plan, profile, cluster))
    return 0


def _write(args: argparse.Namespace, plan: Any, profile: Profile, cluster: Any) -> None:
    """The files the options ask for: ``--out`` (plan JSON), ``--trace``, ``--png``."""
    if args.out:
        plan.save(args.out)
    if args.trace or args.png:
        from lightning_autopipe.planner import timeline
        from lightning_autopipe.planner.simulate import simulate

        result = simulate(plan, profile, cluster)
        if args.trace:
            timeline.write_chrome_trace(result, args.trace)
            print(f"wrote {args.trace} (open in https://ui.perfetto.dev)", file=sys.stderr)
        if args.png:
            timeline.write_png(result, args.png)
            print(f"wrote {args.png}", file=sys.stderr)
