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
no-op, as in a plain ``pytest`` run). A writer first takes the turnstile, so a shard running
one short test after another cannot starve the other shard's process test.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO

__all__ = ["LOCK_VARIABLE", "begin_test", "claim", "end_test", "need_the_machine"]

LOCK_VARIABLE = "AUTOPIPE_SUITE_LOCK"

_files: dict[str, IO[bytes]] = {}
_state = {"held": ""}  # "", "shared" or "exclusive"


def _file(suffix: str) -> IO[bytes] | None:
    base = os.environ.get(LOCK_VARIABLE)
    if not base:
        return None
    if suffix not in _files:
        _files[suffix] = open(base + suffix, "ab")  # noqa: SIM115 - held for the session
    return _files[suffix]


def claim(name: str) -> bool:
    """True for the first shard to ask for ``name`` (a test file), False for every other."""
    base = os.environ.get(LOCK_VARIABLE)
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


def begin_test() -> None:
    """Hold the machine shared for one test (after any writer already waiting)."""
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
    if main is None or gate is None or _state["held"] == "exclusive" or os.getpid() != _owner():
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
