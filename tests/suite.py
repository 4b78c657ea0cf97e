"""The whole test suite as ``make test`` runs it: two pytest lanes side by side, then the
``serial`` tests alone.

Most of the suite's time is processes that the tests launch (Lightning worlds, torchrun nodes,
recipes). A launch keeps both cores busy while its ranks import and trace, and leaves them idle
while its ranks wait on each other; one pytest process running everything in order leaves one
core idle through every single-process test. Two lanes fill those gaps with a fixed split that
needs no plugin: the ``launch`` lane (the shared Lightning worlds and the tests marked
``launch``, one after another, as before) beside the rest, then the ``serial`` tests (which time
processes against each other) with the machine to themselves.

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
LANES = (("launch", "launch and not serial"), ("rest", "not launch and not serial"))
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
        start = time.monotonic()
        running = []
        for name, marks in LANES:
            log = root / f"{name}.log"
            with open(log, "w") as out:  # a file, not a pipe: a lane never blocks on us
                proc = subprocess.Popen(_pytest(marks, args, root / name), cwd=ROOT,
                                        env={**os.environ, LANE_VARIABLE: name},
                                        stdout=out, stderr=subprocess.STDOUT)
            running.append((name, log, proc))
        print(f"lanes {', '.join(n for n, _ in LANES)} running side by side ...", flush=True)
        try:
            for name, log, proc in running:
                status = proc.wait()
                _report(name, log, status, time.monotonic() - start)
                statuses.append(status)
        finally:
            for _, _, proc in running:  # interrupted: no lane outlives the suite
                if proc.poll() is None:
                    proc.kill()
        start = time.monotonic()
        log = root / "serial.log"
        with open(log, "w") as out:
            status = subprocess.call(_pytest("serial", args, root / "serial"), cwd=ROOT,
                                     env={**os.environ, LANE_VARIABLE: "serial"},
                                     stdout=out, stderr=subprocess.STDOUT)
        _report("serial", log, status, time.monotonic() - start)
        statuses.append(status)
    failed = [s for s in statuses if s not in (0, 5)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
