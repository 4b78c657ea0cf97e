"""Several stage chunks per rank in the planner: predicted step and memory with and without.

    .venv/bin/python benchmarks/planner.py --chunks [--quick] [--out FILE.md]

For each FLOP-derived model of ``benchmarks/planner.py`` (gpt2-xl, gpt-96, bert-large) on the
shipped clusters, AutoPipe plans twice side by side in one run: with the one-chunk schedules
(``1f1b``, ``zb-h1``: the default) and with the chunked ones allowed too
(``interleaved-1f1b`` with 2 or 3 chunks per rank, ``zbv`` with 2). Both plans are scored by
the same simulator; the table gives the predicted iteration, the ratio, the chosen schedule
and chunks per rank and the largest per-device peak memory. Each model runs at its benchmark
batch and at a small one (32 sequences for the GPTs, 64 for BERT: few micro-batches per
replica, where fill and drain weigh most).
"""

from __future__ import annotations

import time

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.planner import make_plan

ONE = ("1f1b", "zb-h1")
CHUNKED = (*ONE, "interleaved-1f1b", "zbv")
MODELS = ("gpt2-xl", "gpt-96", "bert-large")
GiB = 2**30


def _plan(prof, cl, batch, schedules, pins):
    t0 = time.perf_counter()
    try:
        plan = make_plan(prof, cl, batch, schedules=schedules, **pins)
    except PlanError as exc:
        return {"error": type(exc).__name__}
    return {"ms": plan.iteration_ms, "mem": max(plan.peak_memory_bytes.values()) / GiB,
            "shape": f"{plan.num_ranks}x{plan.stages[0].replicas} m{plan.num_microbatches} "
                     f"k{plan.startup_slices} j{plan.drain_slices} {plan.schedule}"
                     + (f" v{plan.chunks_per_rank}" if plan.chunks_per_rank > 1 else ""),
            "wall": time.perf_counter() - t0}


def rows(models: dict, clusters: dict[str, Cluster], quick: bool) -> list[dict]:
    out = []
    for mname in MODELS:
        prof, batch = models[mname]
        for cname, cl in clusters.items():
            if quick and cname == "mixed_64":
                continue
            for b in (batch, 64 if mname.startswith("bert") else 32):
                one = _plan(prof, cl, b, ONE, {})
                many = _plan(prof, cl, b, CHUNKED, {})
                out.append({"case": f"{mname} / {cname} (B={b})", "one": one, "many": many})
                print(out[-1], flush=True, file=__import__("sys").stderr)
    return out


def _cell(r: dict) -> str:
    if "error" in r:
        return f"{r['error']} | | |"
    return f"{r['ms']:.1f} | {r['mem']:.1f} | {r['shape']} |"


def table(found: list[dict]) -> str:
    lines = ["| case | one chunk: iteration ms | peak GiB | plan | chunks allowed: iteration "
             "ms | peak GiB | plan | x one chunk |", "|---|---:|---:|---|---:|---:|---|---:|"]
    for r in found:
        one, many = r["one"], r["many"]
        ratio = (f"{many['ms'] / one['ms']:.3f}" if "ms" in one and "ms" in many else "")
        lines.append(f"| {r['case']} | {_cell(one)} {_cell(many)} {ratio} |")
    picked = [r for r in found if "ms" in r["many"] and " v" in r["many"]["shape"]]
    gains = [r["many"]["ms"] / r["one"]["ms"] for r in picked if "ms" in r["one"]]
    lines += ["", f"Chunks chosen in {len(picked)} of {len(found)} cases"
              + (f"; there the step is x{min(gains):.3f} .. x{max(gains):.3f} of the one-chunk "
                 "plan's" if gains else "") + "."]
    return "\n".join(lines)
