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
"""

from __future__ import annotations

import fcntl
import os
from typing import IO

__all__ = ["LOCK_VARIABLE", "active", "begin_test", "claim", "configure", "end_test",
           "need_the_machine"]

LOCK_VARIABLE = "AUTOPIPE_SUITE_LOCK"

_files: dict[str, IO[bytes]] = {}
_state = {"held": "", "base": "", "beside": ""}  # held: "", "shared" or "exclusive"


def configure() -> None:
    """Take the lock's name out of the environment (pytest_configure): a pytest that a test
    starts (``benchmarks/gpu_check.sh`` runs one) is not a shard and must not claim files."""
    _state["base"] = os.environ.pop(LOCK_VARIABLE, "")


def active() -> bool:
    return bool(_state["base"])


def _file(suffix: str) -> IO[bytes] | None:
    base = _state["base"]
    if not base:
        return None
    if suffix not in _files:
        _files[suffix] = open(base + suffix, "ab")  # noqa: SIM115 - held for the session
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


def begin_test(beside: bool = False) -> None:
    """Hold the machine shared for one test (after any writer already waiting); ``beside``:
    the test starts one single-threaded child at a time (a fresh interpreter, a CLI run), no
    ranks, so it keeps the shared hold while its child runs."""
    _state["beside"] = "yes" if beside else ""
    main, gate = _file(".main"), _file(".gate")
    if main is None or gate is None or os.getpid() != _owner():
        return
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(gate, fcntl.LOCK_UN)
    fcntl.flock(main, fcntl.LOCK_SH)
    _state["held"] = "shared"


def need_the_machine() -> None:
    """The running test starts processes: hold the machine exclusive until the test ends."""
    main, gate = _file(".main"), _file(".gate")
    if (main is None or gate is None or _state["held"] == "exclusive" or _state["beside"]
            or os.getpid() != _owner()):
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
