"""The whole test suite as ``make test`` runs it: two pytest lanes side by side.

The ``launch`` lane holds the shared Lightning worlds and the tests marked ``launch`` (what
starts Lightning ranks of its own: recipes, torchrun nodes, elastic restarts, failing ranks),
the ``rest`` lane everything else (the gloo worlds and the planner included; last, alone, the
``serial`` tests, which time processes against each other).

The ``rest`` lane runs as two pytest shards side by side, one per core, each running the next
test file that neither has begun: most of its tests stay in one single-threaded process and
run beside each other, while a test that starts processes takes the machine for itself
(:mod:`tests._machine`: the other shard finishes its running test and waits), so no rank
shares its core with a test.

The ``rest`` lane starts beside the ``launch`` lane at idle priority: a launch's ranks leave
cores idle for long (one rank imports torch and Lightning while the other waits, a hang's
timeout runs out, a recipe starts its second rank), and the rest lane's single-process tests
fill them without taking a core from a rank. Its tests that start ranks (``ranks``) run there
too, their ranks at the same idle priority; those that time themselves or assert on a plan made
from profiles they take (``quiet``) wait until the launch lane has ended, and the ``serial``
tests come after every other test (their tests start ranks, so each holds the machine alone).
They ran as a third pytest lane once, which spent 9-13 s starting an interpreter and collecting
the whole suite for three tests. Two lanes' ranks at *equal* priority on 2 cores took 1296 s of
CI wall time side by side against 441 s and 312 s one after the other, because a launch's 2-4
ranks wait on each other in every collective and a rank pushed off its core stalls them all.

Usage: ``python tests/suite.py [pytest arguments]`` (passed to every lane, e.g. ``-x`` or
``--durations=20``); the exit status is the first failing lane's.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: tests._machine importable

from tests._machine import BESIDE_VARIABLE, LOCK_VARIABLE, idle_priority  # noqa: E402

#: (name, marks, shards run side by side)
LAUNCH, REST = ("launch", "launch", 1), ("rest", "not launch", 2)
#: Each lane's pytest runs with its name here (tests/conftest.py: only ``launch`` may launch the
#: shared Lightning worlds).
LANE_VARIABLE = "AUTOPIPE_SUITE_LANE"

#: One shard's pytest as it runs: (label, log, process).
Running = list[tuple[str, Path, subprocess.Popen]]


def _pytest(marks: str, args: list[str], basetemp: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "tests", "-m", marks,
            f"--basetemp={basetemp}", *args]


def _report(name: str, log: Path, status: int, seconds: float) -> None:
    print(f"\n======== lane {name}: exit {status} after {seconds:.0f} s ========", flush=True)
    print(log.read_text(), end="", flush=True)


def _start_lane(lane: tuple[str, str, int], args: list[str], root: Path,
                beside: Path | None = None) -> Running:
    """The lane's shards, started; ``beside``: the launch lane's lock file (the shards run at
    idle priority until it is released, :mod:`tests._machine`)."""
    name, marks, shards = lane
    # inductor compiles in the compiling process, one g++ at a time, not in a pool of worker
    # interpreters that each import torch: in a rest shard a ``one_child`` test's pool would
    # need the machine, and the shared 2-rank world's compiled cases took 46 CPU-s with the
    # pools (two workers per rank, inductor's default on 2 cores) against 34 without
    env = {**os.environ, LANE_VARIABLE: name, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if shards > 1:
        env[LOCK_VARIABLE] = str(root / f"{name}.lock")
    if beside is not None:
        env[BESIDE_VARIABLE] = str(beside)
    running = []
    for i in range(shards):
        label = name if shards == 1 else f"{name} {i + 1}/{shards}"
        log = root / f"{name}.{i}.log"
        with open(log, "w") as out:  # a file, not a pipe: a lane never blocks on us
            proc = subprocess.Popen(_pytest(marks, args, root / f"{name}{i}"), cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=idle_priority if beside is not None else None)
        running.append((label, log, proc))
    return running


def _finish(running: Running, start: float) -> list[int]:
    """Each shard's exit status once all have ended; each one's log printed."""
    statuses = []
    for label, log, proc in running:
        status = proc.wait()
        _report(label, log, status, time.monotonic() - start)
        statuses.append(status)
    return statuses


#: The checkout's Python folders whose modules the suite's processes import.
SOURCES = ("lightning_autopipe", "tests", "recipes", "benchmarks", "examples")


def compile_sources() -> None:
    """Write the bytecode of the checkout's modules (only what is missing or stale) before any
    process starts. Where ``PYTHONDONTWRITEBYTECODE`` is set (as on the machines the suite runs
    on) no import writes it, so each of the suite's few hundred processes compiled the package
    again: 0.17 s of every rank's start-up for ``lightning_autopipe`` alone (``-X importtime``,
    0.25 s without bytecode against 0.08 s with it). Python reads existing bytecode whatever
    that variable says, and recompiles in memory any file edited since."""
    import compileall

    for name in SOURCES:
        if (ROOT / name).is_dir():
            compileall.compile_dir(ROOT / name, quiet=2)


def main(args: list[str]) -> int:
    """Run the lanes; 0 when every lane passed (pytest's 5, nothing selected, counts as passed)."""
    compile_sources()
    with tempfile.TemporaryDirectory(prefix="autopipe-suite-") as tmp:
        root = Path(tmp)
        start = time.monotonic()
        lock_path = root / "launch.running"
        with open(lock_path, "wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held while the launch lane runs
            launch = _start_lane(LAUNCH, args, root)
            rest = _start_lane(REST, args, root, beside=lock_path)
            statuses = _finish(launch, start)
        statuses += _finish(rest, start)
    failed = [s for s in statuses if s not in (0, 5)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
