"""The whole test suite as ``make test`` runs it: three pytest lanes, one after another.

The ``launch`` lane holds the shared Lightning worlds and the tests marked ``launch`` (what
starts Lightning ranks of its own: recipes, torchrun nodes, elastic restarts, failing ranks),
the ``rest`` lane everything else (the gloo worlds and the planner included), the ``serial``
lane the tests that time processes against each other. The lanes run one at a time: on 2 cores
the two first lanes side by side took 1296 s of CI wall time, while each alone takes 441 s and
312 s on a 2-core machine, because a launch's 2-4 ranks wait on each other in
every collective and a rank that the other lane's process pushes off its core stalls them all.

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
LANES = (("launch", "launch and not serial"), ("rest", "not launch and not serial"),
         ("serial", "serial"))
#: Each lane's pytest runs with its name here (tests/conftest.py: only ``launch`` may launch the
#: shared Lightning worlds).
LANE_VARIABLE = "AUTOPIPE_SUITE_LANE"


def _pytest(marks: str, args: list[str], basetemp: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "tests", "-m", marks,
            f"--basetemp={basetemp}", *args]


def _report(name: str, log: Path, status: int, seconds: float) -> None:
    print(f"\n======== lane {name}: exit {status} after {seconds:.0f} s ========", flush=True)
    print(log.read_text(), end="", flush=True)


def main(args: list[str]) -> int:
    """Run the lanes; 0 when every lane passed (pytest's 5, nothing selected, counts as passed)."""
    statuses = []
    with tempfile.TemporaryDirectory(prefix="autopipe-suite-") as tmp:
        root = Path(tmp)
        for name, marks in LANES:
            start = time.monotonic()
            log = root / f"{name}.log"
            with open(log, "w") as out:  # a file, not a pipe: a lane never blocks on us
                status = subprocess.call(_pytest(marks, args, root / name), cwd=ROOT,
                                         env={**os.environ, LANE_VARIABLE: name},
                                         stdout=out, stderr=subprocess.STDOUT)
            _report(name, log, status, time.monotonic() - start)
            statuses.append(status)
    failed = [s for s in statuses if s not in (0, 5)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
