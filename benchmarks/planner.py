"""Planner benchmark: AutoPipe vs DAPPLE, Piper and the simple partitioners, on four clusters.

    .venv/bin/python benchmarks/planner.py [--out benchmarks/results/planner.md] [--quick]
        [--profiles-dir benchmarks/results/gpu] [--measured-only]
    .venv/bin/python benchmarks/planner.py --chunks [--quick] [--out ...planner_chunks.md]

``--chunks`` runs only the comparison with and without several stage chunks per rank
(``benchmarks/planner_chunks.py``: predicted iteration and memory of both plans per case).

Every plan is scored by the same simulator (``planner/simulate.py``). Block costs come from
FLOP and byte counts (``lightning_autopipe.planner.analytic``: time = FLOPs / (312 TFLOP/s x
45%), backward = 2 x forward, Korthikanti et al. activation memory), not from measurements: no
GPU was available; the Profile JSONs are written to ``benchmarks/profiles/``. Shapes: AutoPipe
searches depth x replicas x micro-batches x slices; ``time``/``parameters``/``uniform`` get
AutoPipe's shape (they only partition); DAPPLE and Piper choose depth and per-stage replicas
with their own dynamic programs (DAPPLE also the micro-batch count, from AutoPipe's, 8, 32
and 128; Piper, whose model has no bubble, takes AutoPipe's). ``optimal`` (exhaustive,
scored by the simulator) only runs on the small case where it is tractable.

Measured profiles (``*.profile.json`` under ``--profiles-dir``, as ``benchmarks/gpu_check.sh``
writes them: ``profiles/<model>.<precision>.profile.json``) are planned on the same clusters
next to the FLOP-derived models, with the clusters' device speeds taken relative to the
measured device (speed 1.0 is that device); the table then has a ``costs`` column saying which
rows are which, and the summary is given per kind of cost. Without measured profiles the
output says so and is the FLOP-derived benchmark alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._publish import publish  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.errors import MemoryPlanError, PlanError  # noqa: E402
from lightning_autopipe.planner import analytic_profile, make_plan  # noqa: E402
from lightning_autopipe.profile import Profile  # noqa: E402

PROFILES = ROOT / "benchmarks" / "profiles"
MEASURED = ROOT / "benchmarks" / "results" / "gpu"
#: global batch of a measured profile's cases, by model family (the FLOP-derived models')
MEASURED_BATCH = {"gpt": 512, "bert": 1024, "resnet": 4096}
FLOP = "FLOP-derived"
CLUSTERS = ("nvlink_2x8", "pcie_2x8", "mixed_rack", "mixed_64")
PLANNERS = ("autopipe", "dapple", "piper", "time", "parameters", "uniform")
COMMAND = ".venv/bin/python benchmarks/planner.py"


def build_profiles() -> dict[str, tuple[Profile, int]]:
    """(profile, global batch) per model, written to ``benchmarks/profiles/<name>.json``."""
    models = {
        "gpt2-xl": (analytic_profile("gpt", layers=48, hidden=1600, heads=25, seq_len=1024,
                                     vocab=50257, micro_batch_size=1, model="gpt2-xl"), 512),
        "gpt-96": (analytic_profile("gpt", layers=96, hidden=2048, heads=16, seq_len=1024,
                                    vocab=50257, micro_batch_size=1, model="gpt-96"), 512),
        "bert-large": (analytic_profile("bert", layers=24, hidden=1024, heads=16, seq_len=512,
                                        vocab=30522, micro_batch_size=8,
                                        model="bert-large"), 1024),
        "resnet152": (analytic_profile("resnet", layers=152, micro_batch_size=32,
                                       model="resnet152"), 4096),
    }
    PROFILES.mkdir(parents=True, exist_ok=True)
    for name, (prof, _) in models.items():
        prof.save(PROFILES / f"{name}.json")
    return models


def _small_case() -> tuple[Profile, Cluster, int, dict]:
    """A case the exact planner can enumerate: 10 blocks, 4 stages on 2 fast + 2 slow GPUs."""
    prof = analytic_profile("gpt", layers=4, hidden=1024, heads=16, seq_len=512, vocab=32000,
                            micro_batch_size=1, model="gpt-4x1024")
    rack = Cluster.load(ROOT / "conf/cluster/mixed_rack.yaml")
    cl = Cluster.from_dict({**rack.to_dict(), "name": "mixed-rack-4"})
    devs = ["nv:0", "nv:1", "pcie0:0", "pcie0:1"]
    return prof, cl, 32, {"devices": devs, "num_stages": 4, "replicas": 1,
                          "num_microbatches": 8}


def _row(case: str, name: str, fn) -> dict:
    t0 = time.perf_counter()
    try:
        plan = fn()
    except MemoryPlanError:
        return {"case": case, "planner": name, "error": "does not fit memory"}
    except PlanError as exc:
        return {"case": case, "planner": name, "error": str(exc)[:60]}
    reps = [s.replicas for s in plan.stages]
    rep = str(reps[0]) if len(set(reps)) == 1 else "/".join(map(str, reps))
    return {
        "case": case, "planner": name, "iteration_ms": plan.iteration_ms,
        "balance": plan.balance, "search_ms": plan.search_ms, "wall_s": time.perf_counter() - t0,
        "shape": f"{plan.num_stages}x{rep} m{plan.num_microbatches} k{plan.startup_slices}"
        + (f" j{plan.drain_slices}" if plan.drain_slices > 1 else "")
        + (f" {plan.schedule}" if plan.schedule != "1f1b" else ""),
        "pins": (plan.num_stages, reps[0], plan.num_microbatches),
    }


def measured_profiles(directory: Path) -> dict[str, tuple[Profile, int]]:
    """(profile, global batch) per ``<model>.<precision>`` of every ``*.profile.json`` under
    ``directory`` (none when it does not exist)."""
    found = {}
    for path in sorted(directory.rglob("*.profile.json")) if directory.is_dir() else []:
        prof = Profile.load(path)
        family = next((f for f in MEASURED_BATCH if prof.model.startswith(f)), "gpt")
        found[path.name.removesuffix(".profile.json")] = (prof, MEASURED_BATCH[family])
    return found


def _cases(rows: list, models: dict, clusters: dict, quick: bool, costs: str) -> None:
    for mname, (prof, batch) in models.items():
        for cname, cl in clusters.items():
            if quick and cname == "mixed_64":
                continue
            case = f"{mname} / {cname} (B={batch})"
            auto = _row(case, "autopipe", lambda p=prof, c=cl, b=batch: make_plan(p, c, b))
            rows.append({**auto, "costs": costs(prof)})
            print(_fmt(auto), file=sys.stderr)
            if "error" in auto:
                continue
            s, r, m = auto["pins"]
            for name in PLANNERS[1:]:
                pins = {}  # DAPPLE weighs micro-batch counts itself (AutoPipe's among them)
                if name != "dapple":
                    pins["num_microbatches"] = m
                if name in ("time", "parameters", "uniform"):
                    pins.update(num_stages=s, replicas=r)
                row = _row(case, name, lambda n=name, p=prof, c=cl, b=batch, k=pins:
                           make_plan(p, c, b, planner=n, **k))
                rows.append({**row, "costs": costs(prof)})
                print(_fmt(row), file=sys.stderr)


def run(quick: bool = False, measured: dict | None = None, flop: bool = True) -> list[dict]:
    """Every case's rows: the FLOP-derived models (``flop``) and the ``measured`` profiles."""
    rows: list[dict] = []
    clusters = {c: Cluster.load(ROOT / "conf" / "cluster" / f"{c}.yaml") for c in CLUSTERS}
    if flop:
        _cases(rows, build_profiles(), clusters, quick, lambda _: FLOP)
    if measured:
        _cases(rows, measured, clusters, quick, lambda prof: f"measured: {prof.device}")
    if not flop:
        return rows
    prof, cl, batch, pins = _small_case()
    case = f"gpt-4x1024 / 2 fast + 2 slow (B={batch}, S=4 pinned)"
    for name in ("autopipe", "optimal", *PLANNERS[1:]):
        row = _row(case, name, lambda n=name: make_plan(prof, cl, batch, planner=n, **pins))
        rows.append({**row, "costs": FLOP})
        print(_fmt(row), file=sys.stderr)
    return rows


def _fmt(row: dict) -> str:
    if "error" in row:
        return f"{row['case']:<44} {row['planner']:<10} {row['error']}"
    return (f"{row['case']:<44} {row['planner']:<10} {row['iteration_ms']:>10.1f} ms "
            f"balance {row['balance']:.3f} search {row['search_ms']:.0f} ms  {row['shape']}")


def _mixed(rows: list[dict]) -> bool:
    """Some rows plan measured profiles (the table then says which rows are which)."""
    return any(r.get("costs", FLOP) != FLOP for r in rows)


def table(rows: list[dict]) -> str:
    auto = {r["case"]: r.get("iteration_ms") for r in rows if r["planner"] == "autopipe"}
    costs = _mixed(rows)
    lines = [
        "| case |" + (" costs |" if costs else "")
        + " planner | iteration ms | x AutoPipe | balance | search ms | S x R, m, k |",
        "|---|" + ("---|" if costs else "") + "---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        head = f"| {r['case']} |" + (f" {r.get('costs', FLOP)} |" if costs else "")
        if "error" in r:
            lines.append(f"{head} {r['planner']} | {r['error']} | | | | |")
            continue
        ratio = r["iteration_ms"] / auto[r["case"]] if auto.get(r["case"]) else float("nan")
        lines.append(
            f"{head} {r['planner']} | {r['iteration_ms']:.1f} | {ratio:.3f} | "
            f"{r['balance']:.3f} | {r['search_ms']:.0f} | {r['shape']} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Ratios to AutoPipe per yardstick; per kind of cost when the rows mix them."""
    if not _mixed(rows):
        return _summary(rows)
    kinds = {FLOP: [r for r in rows if r.get("costs", FLOP) == FLOP],
             "measured": [r for r in rows if r.get("costs", FLOP) != FLOP]}
    return "\n".join(f"{kind} costs:\n{_summary(part)}" for kind, part in kinds.items() if part)


def _summary(rows: list[dict]) -> str:
    auto = {r["case"]: r.get("iteration_ms") for r in rows if r["planner"] == "autopipe"}
    out = []
    for name in ("dapple", "piper", "time", "parameters", "uniform", "optimal"):
        ratios = [r["iteration_ms"] / auto[r["case"]] for r in rows
                  if r["planner"] == name and "error" not in r and auto.get(r["case"])]
        fails = sum(1 for r in rows if r["planner"] == name and "error" in r)
        if ratios:
            out.append(f"- {name}: AutoPipe faster by x{min(ratios):.3f} .. x{max(ratios):.3f}"
                       f" (geomean x{_geomean(ratios):.3f}) over {len(ratios)} cases"
                       + (f"; {fails} cases without a plan that fits" if fails else ""))
    searches = [r["search_ms"] for r in rows if r["planner"] == "autopipe" and "error" not in r]
    out.append(f"- AutoPipe search time: {min(searches):.0f} .. {max(searches):.0f} ms")
    return "\n".join(out)


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _geomean(xs: list[float]) -> float:
    prod = 1.0
    for x in xs:
        prod *= x
    return prod ** (1 / len(xs))


def _lognormal_case(seed: int) -> tuple[Profile, Cluster, int, int, int]:
    """A random lognormal profile (60-200 blocks), 4-16 stages, m from the depth to 4x it, on
    latency-only links (the partition quality test's family, other seeds)."""
    import math
    import random

    from lightning_autopipe.profile import BlockProfile

    rng = random.Random(seed)
    n, stages = rng.randint(60, 200), rng.choice([4, 8, 12, 16])
    m = rng.randint(stages, 4 * stages)
    blocks = []
    for i in range(n):
        f = rng.lognormvariate(0, 1)
        blocks.append(BlockProfile(f"b{i}", f, 2 * f, 10**6, 10**5, 10**6))
    cluster = Cluster.from_dict({"name": "free", "servers": [{
        "name": "s", "gpus": stages, "device": {"name": "d", "speed": 1.0, "memory_gb": 80},
        "levels": [{"size": stages, "gbps": math.inf, "latency_us": 20}]}]})
    return Profile("lognormal", 1, "ref", blocks), cluster, n, stages, m


def quality(seeds: range) -> str:
    """Partitioner vs a local search started from its answer, judged by the simulator.

    The search moves any boundary by 1-3 blocks or two adjacent ones by one each and walks to
    the best neighbour while the simulated step improves; 0 moves means the plan was already
    a local optimum."""
    from lightning_autopipe.planner.plan import Plan
    from lightning_autopipe.planner.polish import neighbours
    from lightning_autopipe.planner.simulate import simulate

    lines = ["| schedule | cases | stages | blocks | improved by the local search | best gain |"
             " mean gain |", "|---|---:|---|---|---:|---:|---:|"]
    for schedule in ("1f1b", "zb-h1"):
        gains, depths, sizes = [], set(), []
        for seed in seeds:
            prof, cluster, n, stages, m = _lognormal_case(seed)
            plan = make_plan(prof, cluster, 4 * m, num_stages=stages, replicas=1,
                             num_microbatches=m, schedules=(schedule,))

            def step(cuts: list[int], plan: Plan = plan, prof: Profile = prof,
                     cluster: Cluster = cluster) -> float:
                return simulate(plan.with_cuts(cuts), prof, cluster).iteration_ms

            start = best = step(plan.cuts)
            cuts = plan.cuts
            while True:
                cand = min(((step(c), c) for c in neighbours(cuts)), key=lambda t: t[0])
                if cand[0] >= best * (1 - 1e-9):
                    break
                best, cuts = cand
            gains.append((start - best) / start)
            depths.add(stages)
            sizes.append(n)
        improved = sum(g > 0 for g in gains)
        lines.append(
            f"| {schedule} | {len(gains)} | {'/'.join(map(str, sorted(depths)))} | "
            f"{min(sizes)}-{max(sizes)} | {improved} | {100 * max(gains):.2f}% | "
            f"{100 * sum(gains) / len(gains):.3f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    ap.add_argument("--quick", action="store_true", help="skip the 64-device cluster")
    ap.add_argument("--profiles-dir", type=Path, default=MEASURED,
                    help="plan the measured *.profile.json found here too (gpu_check.sh's)")
    ap.add_argument("--measured-only", action="store_true",
                    help="only the measured profiles' cases (no FLOP-derived models)")
    ap.add_argument("--quality-cases", type=int, default=30,
                    help="random lognormal cases per schedule for the partition-quality table "
                         "(0: none)")
    ap.add_argument("--chunks", action="store_true",
                    help="only plans with and without several stage chunks per rank")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.chunks:
        return _chunks(args, t0)
    measured = measured_profiles(args.profiles_dir)
    if args.measured_only and not measured:
        ap.error(f"--measured-only: no *.profile.json under {args.profiles_dir}")
    rows = run(args.quick, measured, flop=not args.measured_only)
    flags = "".join(f" {f}" for f, on in (("--quick", args.quick),
                                           ("--measured-only", args.measured_only)) if on)
    if args.profiles_dir != MEASURED:
        flags += f" --profiles-dir {args.profiles_dir}"
    if args.quality_cases != 30:
        flags += f" --quality-cases {args.quality_cases}"
    analytic = (
        "`lightning_autopipe.planner.analytic` with an A100-class reference device "
        "(312 TFLOP/s x 45%, backward = 2 x forward); cluster speeds are relative to it. "
    )
    if measured:
        devices = sorted({prof.device for prof, _ in measured.values()})
        source = (
            f"Rows with `costs` = `measured: ...` plan profiles measured on {', '.join(devices)} "
            f"({', '.join(measured)} under `{_shown(args.profiles_dir)}`, written by "
            "`benchmarks/gpu_check.sh`) on the same clusters, whose device speeds are then "
            "relative to the measured device (speed 1.0 = that device)."
        )
        if not args.measured_only:
            source += f" `{FLOP}` rows' costs are **computed from FLOPs and bytes**: " + analytic
        else:
            source += " "
    else:
        source = (
            f"No measured profiles under `{_shown(args.profiles_dir)}` "
            "(`benchmarks/gpu_check.sh` writes them on a GPU): FLOP-derived costs only.\n\n"
            "Costs are **computed from FLOPs and bytes** (no GPU was available): " + analytic
        )
    report = "\n".join([
        f"# Planner benchmark\n\nReproduce: `{COMMAND}{flags}`\n",
        source +
        "Every plan is scored by the same simulator (link contention, all-reduce, memory). "
        "Ratios > 1 mean the planner's step is slower than AutoPipe's. `time`, `parameters` "
        "and `uniform` use AutoPipe's shape; DAPPLE and Piper choose stages and per-stage "
        "replicas themselves (DAPPLE also the micro-batch count: AutoPipe's, 8, 32 or 128; "
        "Piper, whose model has no bubble, uses AutoPipe's); `optimal` is exhaustive and "
        "only runs on the small case. DAPPLE plans over at most 32 and Piper over at most 64 "
        "time-balanced super-blocks (layer granularity). `search ms` is wall time on a 2-core "
        "machine shared with other jobs (AutoPipe's excludes simulating the chosen plan).\n",
        table(rows), "", "Summary:", summary(rows), "",
        *([
            "Partition quality: AutoPipe's cuts vs a local search started from them, judged "
            f"by the simulator, on {args.quality_cases} random lognormal profiles per schedule "
            "(60-200 blocks, 4-16 stages, m from the depth to four times it, latency-only "
            "links; seeds 1000 on, the tests use 0-9). The search moves any boundary by 1-3 "
            "blocks or two adjacent boundaries by one each, and walks while the step "
            "improves.\n",
            quality(range(1000, 1000 + args.quality_cases)), "",
        ] if args.quality_cases else []),
        f"Total benchmark time {time.perf_counter() - t0:.0f} s.",
    ])
    publish(report, args.out)
    return 0


def _chunks(args: argparse.Namespace, t0: float) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner_chunks

    clusters = {c: Cluster.load(ROOT / "conf" / "cluster" / f"{c}.yaml") for c in CLUSTERS}
    found = planner_chunks.rows(build_profiles(), clusters, args.quick)
    flags = " --chunks" + (" --quick" if args.quick else "")
    report = "\n".join([
        f"# Planner: several stage chunks per rank\n\nReproduce: `{COMMAND}{flags}`\n",
        planner_chunks.__doc__.split("\n\n", 2)[2].strip() + "\n",
        planner_chunks.table(found), "",
        f"Total benchmark time {time.perf_counter() - t0:.0f} s.",
    ])
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
