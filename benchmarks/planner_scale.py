"""Plan-search time at scale, this checkout's planner beside a reference checkout's, one run.

    .venv/bin/python benchmarks/planner_scale.py [--baseline REF] [--out FILE] [--quick]

Cases: seeded random profiles of 100/200/500/1,000 blocks (lognormal forward times, backward
1.5-2.5x, parameters, activations and memory spread over four decades) on clusters of
8/64/256/1,024 devices of two types (half the servers fast NVLink ones, half slower PCIe
ones, 16 devices each; 8 devices are two servers of four), global batch 2,048; then the
shipped profiles (``benchmarks/profiles``) on the shipped clusters (``conf/cluster``) at the
planner benchmark's batch sizes.

For every case the table gives the search time (``Plan.search_ms``, the better of two
searches in one process, since the machine is shared), its CPU time, the CPU time of the
whole call, and
the command's wall and CPU time (one ``python -m lightning_autopipe plan`` process,
interpreter start included), each for this
checkout and for the reference (``--baseline``: a git revision, checked out into a temporary
worktree; the default is the commit the faster search started from), with their ratio, and
the predicted iteration of both (a ratio below 1 is a shorter predicted step). ``notes`` says
when a local search stopped at its budget (this planner's, then the reference's). The shipped
profiles come first. The reference and this checkout run one after
the other in separate processes, each case in both before the next case.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/planner_scale.py"
#: the planner before the bounded pricing of candidates (what the ratios compare against)
BASELINE = "bcd66a4"
BLOCKS = (100, 200, 500, 1000)
DEVICES = (8, 64, 256, 1024)
BATCH = 2048
SHIPPED = {"gpt2-xl": 512, "gpt-96": 512, "bert-large": 1024, "resnet152": 4096}
CLUSTERS = ("nvlink_2x8", "pcie_2x8", "mixed_rack", "mixed_64")


def random_profile_dict(blocks: int, seed: int = 0) -> dict:
    """A seeded random profile of ``blocks`` blocks, as Profile JSON (both planners read it)."""
    rng = random.Random(seed * 7919 + blocks)
    out = []
    for i in range(blocks):
        f = rng.lognormvariate(0, 1)
        out.append({
            "name": f"b{i}", "forward_ms": f, "backward_ms": f * rng.uniform(1.5, 2.5),
            "param_bytes": rng.randint(10**4, 10**8), "activation_bytes": rng.randint(10**3, 10**7),
            "memory_bytes": rng.randint(10**4, 10**8),
        })
    return {"model": f"random-{blocks}", "micro_batch_size": 1, "device": "reference",
            "blocks": out}


def two_type_cluster_dict(devices: int) -> dict:
    """``devices`` devices in servers of 16 (two of four for 8): half fast, half slow."""
    per = 4 if devices < 32 else 16
    count = devices // per // 2
    return {
        "name": f"two-types-{devices}", "network_gbps": 100, "network_latency_us": 20,
        "servers": [
            {"name": "fast", "count": count, "gpus": per, "nic_gbps": 200,
             "device": {"name": "fast", "speed": 1.0, "memory_gb": 80},
             "levels": [{"size": per, "gbps": 2400}]},
            {"name": "slow", "count": count, "gpus": per, "nic_gbps": 100,
             "device": {"name": "slow", "speed": 0.45, "memory_gb": 32},
             "levels": [{"size": per // 2, "gbps": 64}, {"size": per, "gbps": 32}]},
        ],
    }


def cases(quick: bool) -> list[dict]:
    """Every case as files on disk: (name, profile path, cluster path, batch)."""
    tmp = Path(tempfile.mkdtemp(prefix="planner-scale-"))
    out = []
    for model, batch in SHIPPED.items():
        for cname in CLUSTERS:
            if quick and cname == "mixed_64":
                continue
            out.append({"case": f"{model} / {cname} (B={batch})",
                        "profile": str(ROOT / "benchmarks" / "profiles" / f"{model}.json"),
                        "cluster": str(ROOT / "conf" / "cluster" / f"{cname}.yaml"),
                        "batch": batch})
    for n in BLOCKS:
        prof = tmp / f"random-{n}.json"
        prof.write_text(json.dumps(random_profile_dict(n)))
        for d in DEVICES:
            if quick and n * d > 200 * 64:
                continue
            cl = tmp / f"two-types-{d}.json"
            cl.write_text(json.dumps(two_type_cluster_dict(d)))
            out.append({"case": f"random {n} blocks x {d} devices (B={BATCH})",
                        "profile": str(prof), "cluster": str(cl), "batch": BATCH})
    return out


def _worker(case: dict) -> dict:
    """Run in a child whose ``sys.path`` starts at the checkout being measured."""
    import yaml

    from lightning_autopipe.cluster import Cluster
    from lightning_autopipe.planner import make_plan, search
    from lightning_autopipe.profile import Profile

    # the search's CPU time: the whole call less the simulation that only reports the chosen
    # plan (simulating finalists to choose among them is part of the search)
    outside, inside = [0.0], [False]
    simulate_finalists, finish_plan = search._simulate_finalists, search.finish_plan

    def finalists(*a, **k):
        inside[0] = True
        try:
            return simulate_finalists(*a, **k)
        finally:
            inside[0] = False

    def finish(*a, **k):
        start = time.process_time()
        try:
            return finish_plan(*a, **k)
        finally:
            if not inside[0]:
                outside[0] += time.process_time() - start

    search._simulate_finalists, search.finish_plan = finalists, finish

    prof = Profile.load(case["profile"])
    path = Path(case["cluster"])
    cl = (Cluster.from_dict(json.loads(path.read_text())) if path.suffix == ".json"
          else Cluster.from_dict(yaml.safe_load(path.read_text()), base=path.parent))
    plans, cpu, search_cpu = [], [], []
    for _ in range(2):
        start, outside[0] = time.process_time(), 0.0
        plans.append(make_plan(prof, cl, case["batch"]))
        cpu.append(time.process_time() - start)
        search_cpu.append(cpu[-1] - outside[0])
    best = min(plans, key=lambda p: p.search_ms)
    return {"search_ms": best.search_ms, "iteration_ms": best.iteration_ms,
            "cpu_ms": min(cpu) * 1e3, "search_cpu_ms": min(search_cpu) * 1e3,
            "notes": best.search_notes,
            "shape": f"{best.num_stages}x{best.stages[0].replicas} m{best.num_microbatches} "
                     f"k{best.startup_slices} j{best.drain_slices} {best.schedule}"}


def _measure(root: Path, case: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    got = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(case)], cwd=root, env=env,
        capture_output=True, text=True, check=True,
    )
    res = json.loads(got.stdout.strip().splitlines()[-1])
    cluster = case["cluster"]
    if cluster.endswith(".json"):  # the CLI reads YAML; JSON is YAML
        alt = Path(cluster).with_suffix(".yaml")
        alt.write_text(Path(cluster).read_text())
        cluster = str(alt)
    t0, c0 = time.perf_counter(), _children_cpu()
    subprocess.run(
        [sys.executable, "-m", "lightning_autopipe", "plan", "--profile", case["profile"],
         "--cluster", cluster, "--global-batch-size", str(case["batch"]), "--json"],
        cwd=root, env=env, capture_output=True, text=True, check=True,
    )
    res["cli_s"] = time.perf_counter() - t0
    res["cli_cpu_s"] = _children_cpu() - c0
    return res


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _baseline_root(ref: str) -> Path:
    where = Path(tempfile.mkdtemp(prefix="planner-baseline-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(where), ref], cwd=ROOT,
                   check=True, capture_output=True)
    return where


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare against")
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    ap.add_argument("--quick", action="store_true", help="only the small random cases")
    ap.add_argument("--only", action="append", default=[],
                    help="only the cases whose name contains this (repeatable)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    t0 = time.perf_counter()
    base = _baseline_root(args.baseline)
    flags = (f" --baseline {args.baseline}" if args.baseline != BASELINE else "") + (
        " --quick" if args.quick else "") + "".join(f" --only '{o}'" for o in args.only)
    try:
        rows = []
        for case in cases(args.quick):
            if args.only and not any(o in case["case"] for o in args.only):
                continue
            old, new = _measure(base, case), _measure(ROOT, case)
            rows.append((case, old, new))
            print(f"{case['case']}: search {new['search_ms']:.0f} ms (was "
                  f"{old['search_ms']:.0f}), iteration {new['iteration_ms']:.1f} "
                  f"(was {old['iteration_ms']:.1f})", file=sys.stderr)
            if args.out:  # the table so far, so that an interrupted run still leaves one
                args.out.write_text(_report(rows, args.baseline, flags, t0) + "\n")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       capture_output=True)
    report = _report(rows, args.baseline, flags, t0)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0


def _report(rows: list, baseline: str, flags: str, t0: float) -> str:
    lines = [
        "# Planner search at scale\n",
        f"Reproduce: `{COMMAND}{flags}`\n",
        f"Reference: the planner at `{baseline}`, run in its own worktree in the same "
        "run. `search` is `Plan.search_ms` (wall time, the better of two searches), "
        "`search cpu` its CPU time (the `make_plan` call less the simulation that only "
        "reports the chosen plan; the better of the two), `cpu` "
        "the CPU time of the whole `make_plan` call (the final simulation included; the "
        "better of the two), `CLI` the wall and CPU time of one `python -m "
        "lightning_autopipe plan` (interpreter start included). The machine has 2 cores "
        "shared with other jobs, whose load stretches wall times several-fold: the CPU "
        "columns are the ones to compare. `iteration x ref` < 1 is a shorter predicted step "
        "than the reference's.\n",
        "| case | search ms | ref ms | search cpu ms | ref | search cpu x ref | cpu ms "
        "| ref cpu ms | cpu x ref | CLI s (cpu) | ref CLI s (cpu) | iteration ms | ref ms "
        "| iteration x ref | shape | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for case, old, new in rows:
        notes = "; ".join(new["notes"]) or "-"
        if old["notes"]:
            notes += " (reference: " + "; ".join(old["notes"]) + ")"
        lines.append(
            f"| {case['case']} | {new['search_ms']:.0f} | {old['search_ms']:.0f} | "
            f"{new['search_cpu_ms']:.0f} | {old['search_cpu_ms']:.0f} | "
            f"{_ratio(new['search_cpu_ms'], old['search_cpu_ms'])} | "
            f"{new['cpu_ms']:.0f} | {old['cpu_ms']:.0f} | {_ratio(new['cpu_ms'], old['cpu_ms'])}"
            f" | {new['cli_s']:.2f} ({new['cli_cpu_s']:.2f}) | {old['cli_s']:.2f} "
            f"({old['cli_cpu_s']:.2f}) | {new['iteration_ms']:.1f} | {old['iteration_ms']:.1f} "
            f"| {_ratio(new['iteration_ms'], old['iteration_ms'])} | {new['shape']} | {notes} |"
        )
    lines.append(f"\nTotal benchmark time {time.perf_counter() - t0:.0f} s.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
