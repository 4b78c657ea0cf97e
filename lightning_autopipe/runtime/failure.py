"""Failure propagation: the failing rank posts its error; every peer names it instead of hanging.

Every point-to-point and collective call runs under the process group's timeout (gloo honours it
for ``recv`` too in torch 2.14: "Timed out waiting ...ms for recv operation"), and a peer that
exits closes its sockets, so a blocked rank fails within seconds ("Connection closed by peer").
What such a rank cannot see is *why*. So the first rank to fail posts one line (rank, stage,
step, action, original exception) to the c10d store every rank already shares; a rank whose
communication then fails waits briefly for that line and raises :class:`PipelineRuntimeError`
carrying it. When the failing rank died without posting (SIGKILL), the message names the peer
that went silent.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_autopipe.errors import PipelineRuntimeError

__all__ = [
    "GONE",
    "FailureBoard",
    "LauncherWatch",
    "describe",
    "is_communication_error",
    "pipeline_failure",
    "stop_everywhere",
    "watch_launcher",
]

_GENERATION = itertools.count()
_COMM_MARKERS = (
    "connection closed",
    "timed out",
    "broken pipe",
    "connection reset",
    "socket",
    "gloo",
    "nccl",
    "c10d",
    "process group",
)


def is_communication_error(exc: BaseException) -> bool:
    """A failure of the transport (peer gone, timeout) rather than of this rank's own work."""
    if isinstance(exc, PipelineRuntimeError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS)


def describe(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line, shortened (gloo messages carry long source paths)."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


#: :meth:`FailureBoard.first` when the board cannot be read any more: rank 0, its store's host,
#: died, or read a posted failure and exited before this rank could
GONE = ("rank 0, which holds the job's failure board, is gone: it died, or it exited on "
        "another rank's failure (its log says which)")


class FailureBoard:
    """The first failure of one pipeline run, kept in the job's shared c10d store.

    Every rank creates its board at the same point of the same run, so the per-process
    generation counter gives all of them the same keys; a later run in the same process group
    starts clean.
    """

    def __init__(self, store: Any, prefix: str) -> None:
        self._store = store
        self._count_key = f"{prefix}/count"
        self._text_key = f"{prefix}/text"
        self.posted: str | None = None

    @classmethod
    def for_current_group(cls) -> FailureBoard | None:
        """A board on the default group's store; None without torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception:  # a backend without a reachable store: peers still time out
            return None
        return cls(store, f"autopipe/failure/{next(_GENERATION)}")

    def post(self, message: str) -> bool:
        """Record ``message`` unless a failure was posted first; True when this one was first."""
        if self.posted is not None:
            return False
        self.posted = message
        try:
            if self._store.add(self._count_key, 1) == 1:
                self._store.set(self._text_key, message)
                return True
        except Exception:  # the store's host (rank 0) is gone; the local error still stands
            pass
        return False

    def first(self, wait_s: float = 1.0) -> str | None:
        """The first posted failure, waiting up to ``wait_s`` for one to appear; :data:`GONE`
        when the board cannot be read (its host, rank 0, has exited)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._store.check([self._text_key]):
                    return self._store.get(self._text_key).decode()
            except Exception:
                return GONE
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def pipeline_failure(
    board: FailureBoard | None,
    exc: BaseException,
    *,
    where: str,
    what: str,
    when: str,
    peer: int | None = None,
    communication: bool = False,
    timeout_s: float | None = None,
) -> PipelineRuntimeError:
    """The error this rank raises for ``exc``; posts it when this rank is the first to fail.

    Args:
        where: this rank, e.g. ``"rank 1 (stage 1, replica 0)"``.
        what: the action or operation, e.g. ``"forward 1F0.1"`` or ``"gradient all-reduce"``.
        when: e.g. ``"training step 2"``.
        peer: the rank this operation talks to, when there is one.
        communication: the operation is a send/receive/collective (a failure there usually
            means another rank failed first).
    """
    if not (communication or is_communication_error(exc)):
        message = f"{where} failed in {what} of {when}: {describe(exc)}"
        if board is not None:
            board.post(message)
        return PipelineRuntimeError(message)
    first = board.first(wait_s=2.0) if board is not None else None
    if first is GONE and peer == 0:  # the peer is the board's host: it is the one gone
        first = None
    if first is not None and first != (board.posted if board is not None else None):
        return PipelineRuntimeError(f"{where} stopped in {what} of {when} because {first}")
    other = f"rank {peer}" if peer is not None else "a peer rank"
    limit = f" (timeout {timeout_s:g} s)" if timeout_s else ""
    message = (
        f"{where}: {what} with {other} failed in {when}: {describe(exc)}; {other} has probably "
        f"died or hung{limit} without reporting an error: check its log"
    )
    if board is not None:
        board.post(message)
    return PipelineRuntimeError(message)


class LauncherWatch:
    """Ends this process when the process that launched it exits while a run is in progress.

    Lightning's popen launcher re-runs the script for ranks > 0 and watches *them* (a child
    that dies takes the job down), but nothing ends a child when the launching rank 0 exits
    with an error while the child is stuck outside any communication (a hang, a long compute):
    it would live on, holding the terminal and the devices. A daemon thread polls the parent
    pid; once it is gone and the run is still *armed* (between the strategy's setup and
    teardown) after ``grace_s`` more seconds, the process ends with exit code 1. A rank that
    is merely finishing (its teardown disarms the watch) is never cut short.
    """

    def __init__(self, rank: int, interval_s: float = 0.5, grace_s: float = 5.0) -> None:
        self.rank = rank
        self.parent = os.getppid()
        self.armed = False
        self._interval = interval_s
        self._grace = grace_s
        threading.Thread(target=self._poll, name="autopipe-launcher-watch", daemon=True).start()

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def _poll(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(self._interval)
        deadline = time.monotonic() + self._grace
        while self.armed and time.monotonic() < deadline:
            time.sleep(self._interval)
        if not self.armed:
            return
        sys.stderr.write(
            f"[rank {self.rank}] the launching process (pid {self.parent}) has exited while "
            "this rank is still in the run; ending this rank (see the launching process's "
            "error above)\n"
        )
        sys.stderr.flush()
        os._exit(1)


_WATCH: LauncherWatch | None = None


def watch_launcher(rank: int) -> LauncherWatch | None:
    """The process-wide :class:`LauncherWatch` (created once; None for an orphan already)."""
    global _WATCH
    if _WATCH is None and os.getppid() > 1:
        _WATCH = LauncherWatch(rank)
    return _WATCH


@contextmanager
def ending_with_launcher() -> Iterator[None]:
    """Inside the block this process is killed as soon as the process that launched it ends.

    While the process group forms, torch's store connects holding the interpreter lock, so the
    :class:`LauncherWatch` thread cannot run: a rank 0 that failed to bind its port left its
    children waiting on that port for as long as anything listened there. The kernel's
    parent-death signal needs no thread. It is cleared after the block (a rank merely
    finishing after its launcher is never cut short). Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    launcher = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher ended before the signal was set
        sys.stderr.write("the launching process has exited before this rank joined the process "
                         "group; ending this rank (see the launching process's error)\n")
        sys.stderr.flush()
        os._exit(1)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_PDEATHSIG, 0)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
#: The pid of the rank that started this one (set by the strategy's launcher for the ranks it
#: starts): a launcher that has ended is told apart from one that is process 1 itself.
LAUNCHER_PID_ENV = "AUTOPIPE_LAUNCHER_PID"


def stop_everywhere(exc: BaseException | None, doing: str) -> None:
    """Collective: when any rank's ``exc`` is set, every rank raises with that rank's error.

    For a step every rank takes on its own between collectives (profiling its blocks, making
    its optimizers): a rank that fails alone would leave the others waiting in the next
    collective until its timeout, with a message that names no one. So every rank says how
    the step went and all stop on the first failure: the failing rank re-raises its own
    exception, the others a :class:`PipelineRuntimeError` naming it and what it was ``doing``.
    """
    said = None if exc is None else f"{type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, said)
    failed = [(r, msg) for r, msg in enumerate(everyone) if msg is not None]
    if not failed:
        return
    if exc is not None:
        raise exc
    first, msg = failed[0]
    raise PipelineRuntimeError(f"rank {first} failed {doing}: {msg}")
