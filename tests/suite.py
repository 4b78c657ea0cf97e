"""The whole test suite as ``make test`` runs it: three pytest lanes.

The ``launch`` lane holds the shared Lightning worlds and the tests marked ``launch`` (what
starts Lightning ranks of its own: recipes, torchrun nodes, elastic restarts, failing ranks),
the ``rest`` lane everything else (the gloo worlds and the planner included), the ``serial``
lane the tests that time processes against each other; it runs last, alone.

The ``rest`` lane runs *behind* the launch lane, started with it: its two pytest shards run at
the ``SCHED_IDLE`` policy (:mod:`tests._machine`), so their single-threaded tests take only a
core that the launch lane's ranks leave idle (a rank waiting on its peer, a launcher on its
children) and give it back as soon as a rank wakes. At the ordinary policy the two lanes side
by side took 1296 s of CI wall time against 441 s and 312 s one after the other: a rank pushed
off its core stalls every peer in every collective. Each shard runs the next test file that
neither has begun, those that stay in their own process first; a test that starts processes
waits until the launch lane has ended and then takes the machine for itself (the other shard
finishes its running test and waits), so no rank ever shares its core with a test.

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

from tests._machine import BEHIND_VARIABLE, LOCK_VARIABLE  # noqa: E402

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


def _start_lane(name: str, marks: str, shards: int, args: list[str], root: Path,
                behind: Path | None = None) -> list[tuple[str, Path, subprocess.Popen]]:
    """The lane's shards, started side by side (``behind``: the file the launch lane holds,
    :data:`tests._machine.BEHIND_VARIABLE`)."""
    env = {**os.environ, LANE_VARIABLE: name}
    if shards > 1:
        env[LOCK_VARIABLE] = str(root / f"{name}.lock")
        # inductor compiles in the test's own process, one g++ at a time (a ``one_child``
        # test), not in a pool of worker processes that would need the machine
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    if behind is not None:
        env[BEHIND_VARIABLE] = str(behind)
    running = []
    for i in range(shards):
        label = name if shards == 1 else f"{name} {i + 1}/{shards}"
        log = root / f"{name}.{i}.log"
        with open(log, "w") as out:  # a file, not a pipe: a lane never blocks on us
            proc = subprocess.Popen(_pytest(marks, args, root / f"{name}{i}"), cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        running.append((label, log, proc))
    return running


def _wait(running: list[tuple[str, Path, subprocess.Popen]], start: float) -> list[int]:
    """Each shard's exit status; its log is printed as it ends."""
    statuses = []
    for label, log, proc in running:
        status = proc.wait()
        _report(label, log, status, time.monotonic() - start)
        statuses.append(status)
    return statuses


def _idle_policy_allowed() -> bool:
    """Whether a process here may take the ``SCHED_IDLE`` policy (Linux; a container's
    seccomp profile may refuse it). Without it the rest lane would compete with the launch
    ranks at the ordinary policy, so it runs after the launch lane instead."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main(args: list[str]) -> int:
    """Run the lanes; 0 when every lane passed (pytest's 5, nothing selected, counts as passed)."""
    (launch, launch_marks, _), (rest, rest_marks, shards), (serial, serial_marks, _) = LANES
    with tempfile.TemporaryDirectory(prefix="autopipe-suite-") as tmp:
        root = Path(tmp)
        behind = root / "launch.running"
        with open(behind, "wb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # until the launch lane has ended
            start = time.monotonic()
            first = _start_lane(launch, launch_marks, 1, args, root)
            if _idle_policy_allowed():
                second = _start_lane(rest, rest_marks, shards, args, root, behind)
                statuses = _wait(first, start)
            else:
                statuses = _wait(first, start)
                start = time.monotonic()
                second = _start_lane(rest, rest_marks, shards, args, root)
        statuses += _wait(second, start)
        statuses += _wait(_start_lane(serial, serial_marks, 1, args, root), time.monotonic())
    failed = [s for s in statuses if s not in (0, 5)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
