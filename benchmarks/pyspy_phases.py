"""Where a pipelined step spends its CPU time, from a py-spy raw profile of benchmarks/runtime.py.

    .venv/bin/pip install py-spy     # not a project dependency
    .venv/bin/py-spy record --subprocesses --idle --rate 50 --format raw -o spy.txt -- \\
        .venv/bin/python benchmarks/runtime.py --only "pinned 2 stages, sliced" --rounds 2
    .venv/bin/python benchmarks/pyspy_phases.py spy.txt

Only samples inside the timed steps count (stacks through the benchmark's ``_timed``); each is
put in one phase by the first rule its stack matches, then the busiest leaf frames follow.
With ``--idle`` a rank blocked in a receive is sampled too, so waits show as their share.
"""

from __future__ import annotations

import argparse
import collections

# (phase, substrings any of which marks a stack), first match wins
PHASES = [
    ("blocking receive (pipeline fill/drain waits)", ("recv_tensors",)),
    ("end-of-step gradient sync", ("_sync_gradients", "GradientSync.finish")),
    ("loss broadcast (the first stage waiting for the last to finish)", ("_global_loss",)),
    ("benchmark barrier", ("barrier",)),
    ("backward compute", ("_engine_run_backward",)),
    ("forward compute (and loss)", ("executor.py",)),
    ("optimizer", ("optim",)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy --format raw output")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    phase: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.raw) as fh:
        for line in fh:
            stack, _, count = line.rstrip().rpartition(" ")
            if "_timed" not in stack:
                continue
            n = int(count)
            total += n
            top = stack.split(";")[-1]
            if top.startswith("PipelineExecutor._run"):  # the executor's own line: a send's
                name = "waiting for sends / executor bookkeeping"  # wait(), or Python glue
            else:
                name = next((p for p, keys in PHASES if any(k in stack for k in keys)), "other")
            phase[name] += n
            leaf[top] += n
    if not total:
        raise SystemExit("no samples inside the timed steps; was benchmarks/runtime.py profiled?")
    print(f"{total} samples inside timed steps\n\n| phase | share |\n|---|---:|")
    for name, n in phase.most_common():
        print(f"| {name} | {n / total:.1%} |")
    print("\n| leaf frame | share |\n|---|---:|")
    for name, n in leaf.most_common(args.top):
        print(f"| `{name}` | {n / total:.1%} |")


if __name__ == "__main__":
    main()
