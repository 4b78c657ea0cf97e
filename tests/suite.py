"""The whole test suite as ``make test`` runs it: three pytest lanes, one after another.

The ``launch`` lane holds the shared Lightning worlds and the tests marked ``launch`` (what
starts Lightning ranks of its own: recipes, torchrun nodes, elastic restarts, failing ranks),
the ``rest`` lane everything else (the gloo worlds and the planner included), the ``serial``
lane the tests that time processes against each other. The lanes run one at a time: on 2 cores
the two first lanes side by side took 1296 s of CI wall time, while each alone takes 441 s and
312 s on a 2-core machine, because a launch's 2-4 ranks wait on each other in
every collective and a rank that the other lane's process pushes off its core stalls them all.

The ``rest`` lane runs as two pytest shards side by side, one per core, each running the next
test file that neither has begun: most of its tests stay in one single-threaded process and
run beside each other, while a test that starts processes takes the machine for itself
(:mod:`tests._machine`: the other shard finishes its running test and waits), so no rank
shares its core with a test.

Usage: ``python tests/suite.py [pytest arguments]`` (passed to every lane, e.g. ``-x`` or
``--durations=20``); the exit status is the first failing lane's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: tests._machine importable

from tests._machine import LOCK_VARIABLE  # noqa: E402

#: (name, marks, shards run side by side)
LANES = (("launch", "launch and not serial", 1), ("rest", "not launch and not serial", 2),
         ("serial", "serial", 1))
#: Each lane's pytest runs with its name here (tests/conftest.py: only ``launch`` may launch the
#: shared Lightning worlds).
LANE_VARIABLE = "AUTOPIPE_SUITE_LANE"


def _pytest(marks: str, args: list[str], basetemp: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "tests", "-m", marks,
            f"--basetemp={basetemp}", *args]


def _report(name: str, log: Path, status: int, seconds: float) -> None:
    print(f"\n======== lane {name}: exit {status} after {seconds:.0f} s ========", flush=True)
    print(log.read_text(), end="", flush=True)


def _run_lane(name: str, marks: str, shards: int, args: list[str], root: Path) -> list[int]:
    """The lane's shards side by side; each one's log is printed when all have ended."""
    env = {**os.environ, LANE_VARIABLE: name}
    if shards > 1:
        env[LOCK_VARIABLE] = str(root / f"{name}.lock")
        # inductor compiles in the test's own process, one g++ at a time (a ``one_child``
        # test), not in a pool of worker processes that would need the machine
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    start = time.monotonic()
    running = []
    for i in range(shards):
        label = name if shards == 1 else f"{name} {i + 1}/{shards}"
        log = root / f"{name}.{i}.log"
        with open(log, "w") as out:  # a file, not a pipe: a lane never blocks on us
            proc = subprocess.Popen(_pytest(marks, args, root / f"{name}{i}"), cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        running.append((label, log, proc))
    statuses = []
    for label, log, proc in running:
        status = proc.wait()
        _report(label, log, status, time.monotonic() - start)
        statuses.append(status)
    return statuses


def main(args: list[str]) -> int:
    """Run the lanes; 0 when every lane passed (pytest's 5, nothing selected, counts as passed)."""
    statuses = []
    with tempfile.TemporaryDirectory(prefix="autopipe-suite-") as tmp:
        root = Path(tmp)
        for name, marks, shards in LANES:
            statuses += _run_lane(name, marks, shards, args, root)
    failed = [s for s in statuses if s not in (0, 5)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
