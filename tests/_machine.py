"""The machine as a readers-writer lock between pytest processes that share it.

:mod:`tests.suite` runs the ``rest`` lane as two pytest shards side by side, one per core. Tests
that stay in their own single-threaded process (the planner, tracing, single-process runtime
cases: most of the lane) run beside each other; a test that starts processes of its own (a gloo
world, a launched script, an inductor compile pool) needs every core, because its ranks wait on
each other in every collective and one pushed off its core stalls them all. So each test holds
the machine *shared* while it runs, and the first process it starts takes it *exclusive*: the
other shard finishes its running test and waits until this one ends.

The shards share the lane's test files the same way: each collects them all and runs the
next one that no shard has claimed (:func:`claim`), so both end together.

The lock is two ``flock`` files named by ``AUTOPIPE_SUITE_LOCK`` (no variable: every call is a
no-op, as in a plain ``pytest`` run). A test marked ``one_child`` starts one single-threaded
child at a time, not ranks, and runs beside the other shard's test like any other. A writer
first takes the turnstile, so a shard running one short test after another cannot starve the
other shard's process test.

While the ``launch`` lane runs, the ``rest`` lane's shards run beside it at idle priority
(``SCHED_IDLE``: a core goes to them only when no launch rank wants it, and a waking rank takes
it back at once), so that the launch lane's idle cores (ranks importing one after another, a
hang's timeout) run the rest lane's single-process tests. A test that starts ranks but asserts
nothing on time (marked ``ranks``; the ``gloo`` fixture implies it) runs beside the launch lane
too, before the shard's single-process files: its ranks inherit the idle priority, so
they only slow themselves (a collective waits longer for a rank pushed off its core), never a
launch rank. A test that asserts on its own timings, or on a plan made from profiles it takes
(marked ``quiet``), must not run beside the launch lane: its shard takes the other files first,
then waits until the launch lane has ended (``AUTOPIPE_SUITE_BESIDE`` names a file the suite
holds locked until then) and goes back to normal priority, with every process it started. A
test that starts processes with neither mark waits the same way when it starts the first one.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import sys
from typing import IO

__all__ = ["BESIDE_VARIABLE", "LOCK_VARIABLE", "active", "await_the_launch", "begin_test",
           "beside_the_launch", "claim", "configure", "end_test", "idle_priority",
           "need_the_machine"]

LOCK_VARIABLE = "AUTOPIPE_SUITE_LOCK"
BESIDE_VARIABLE = "AUTOPIPE_SUITE_BESIDE"

_files: dict[str, IO[bytes]] = {}
# held: "", "shared" or "exclusive"; launch: the launch lane's file while it may still run
_state = {"held": "", "base": "", "beside": "", "ranks": "", "launch": ""}


def configure() -> None:
    """Take the lock's names out of the environment (pytest_configure): a pytest that a test
    starts (``benchmarks/gpu_check.sh`` runs one) is not a shard and must not claim files."""
    _state["base"] = os.environ.pop(LOCK_VARIABLE, "")
    _state["launch"] = os.environ.pop(BESIDE_VARIABLE, "")


def idle_priority() -> None:
    """This process at idle priority (the suite starts the shards that run beside the launch
    lane so); where Linux's ``SCHED_IDLE`` is refused, the lowest niceness instead."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _normal_priority() -> None:
    """Every thread of this process and of the processes it started (a gloo world's ranks,
    their fork server) back at normal priority, so that what it starts next inherits it too;
    where that is refused (no ``CAP_SYS_NICE``) it stays idle, which costs nothing once the
    launch lane has ended."""
    import psutil

    me = psutil.Process()
    for pid in [me.pid, *(child.pid for child in me.children(recursive=True))]:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue  # ended meanwhile
        for tid in threads:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                continue
            except (AttributeError, OSError):
                return


def beside_the_launch() -> bool:
    """True while the launch lane runs beside this shard (never outside the suite)."""
    path = _state["launch"]
    if not path:
        return False
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    _ended()
    return False


def await_the_launch() -> None:
    """Block until the launch lane has ended (at once outside the suite or after it ended)."""
    path = _state["launch"]
    if not path:
        return
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # released when the file closes
    _ended()


def _ended() -> None:
    _state["launch"] = ""
    _normal_priority()


def active() -> bool:
    return bool(_state["base"])


def _file(suffix: str) -> IO[bytes] | None:
    base = _state["base"]
    if not base:
        return None
    if suffix not in _files:
        _files[suffix] = open(base + suffix, "ab")  # noqa: SIM115 - held for the session
        atexit.register(_files[suffix].close)  # released at the shard's exit, not left to it
    return _files[suffix]


def claim(name: str) -> bool:
    """True for the first shard to ask for ``name`` (a test file), False for every other."""
    base = _state["base"]
    if not base:
        return True
    folder = base + ".claims"
    os.makedirs(folder, exist_ok=True)
    try:
        os.close(os.open(os.path.join(folder, name.replace("/", "%")),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def begin_test(beside: bool = False, ranks: bool = False) -> None:
    """Hold the machine shared for one test (after any writer already waiting); ``beside``:
    the test starts one single-threaded child at a time (a fresh interpreter, a CLI run), no
    ranks, so it keeps the shared hold while its child runs; ``ranks``: its ranks may start
    beside the launch lane (marked ``ranks``, not ``quiet``)."""
    _state["beside"] = "yes" if beside else ""
    _state["ranks"] = "yes" if ranks else ""
    main, gate = _file(".main"), _file(".gate")
    if main is None or gate is None or os.getpid() != _owner():
        return
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(gate, fcntl.LOCK_UN)
    fcntl.flock(main, fcntl.LOCK_SH)
    _state["held"] = "shared"


def need_the_machine() -> None:
    """The running test starts processes: hold the machine exclusive until the test ends (one
    not marked ``ranks``, after the launch lane)."""
    if _state["beside"] or os.getpid() != _owner():
        return
    if not _state["ranks"] and beside_the_launch():
        sys.__stderr__.write(f"\n{os.environ.get('PYTEST_CURRENT_TEST', 'a test')}: starts "
                             "processes beside the launch lane: mark it `ranks` (it asserts "
                             "nothing on time) or `quiet` so that its shard runs other files "
                             "until the launch lane ends\n")
        await_the_launch()
    main, gate = _file(".main"), _file(".gate")
    if main is None or gate is None or _state["held"] == "exclusive":
        return
    fcntl.flock(main, fcntl.LOCK_UN)  # a shared hold is given up first (flock converts so)
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(main, fcntl.LOCK_EX)
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
    _state["held"] = "exclusive"


def end_test() -> None:
    main = _file(".main")
    if main is not None and os.getpid() == _owner():
        fcntl.flock(main, fcntl.LOCK_UN)
    _state["held"] = ""


_OWNER = os.getpid()


def _owner() -> int:
    """The pytest process (a forked child inherits this module's state but never locks)."""
    return _OWNER
