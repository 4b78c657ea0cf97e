"""Long-lived gloo worlds for the runtime tests: started once, running many tests' cases.

A runtime test that needs real process groups but no Lightning asks the session fixture
``gloo`` for a world (``gloo(2)``) and runs a module-level function on every rank of it:
``gloo(2).run(fn, *args)`` calls ``fn(rank, world, *args)`` in each process, the default group
already initialised (gloo, loopback, a timeout on every collective), and returns the ranks'
results in rank order. Starting a process costs an interpreter and torch (seconds of CPU on
this class of machine), so a world serves every test that asks for its size, and its ranks
are forked from a server that imported them once (:func:`forked_context`). A case that
raises on any rank fails its test with every rank's traceback, and the world is replaced
before the next case (a half-finished collective would poison it). Cases that kill processes
or test start-up itself launch their own processes instead.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from tests import _machine
from tests._launch import free_port, init_gloo

__all__ = ["TIMEOUT_S", "GlooWorld", "GlooWorlds", "forked_context", "run_forked"]

#: Seconds a case may run before its world is declared hung (collectives time out sooner).
_CASE_S = 300.0
#: Every collective's timeout in the worlds' cases: room for ranks that run at idle priority
#: beside the suite's launch lane (``ranks``, :mod:`tests._machine`), where two busy launch
#: ranks can keep a core from them for many seconds.
TIMEOUT_S = 120.0
_START_S = 300.0
#: Starts of a world tried before its test fails (each on a port found free just before).
_START_TRIES = 3


#: What the fork server imports once, so that a world's ranks start with it in memory.
_PRELOAD = ["torch", "torch.distributed", "lightning_autopipe.runtime.executor", "tests._gloo"]


@functools.cache
def forked_context() -> Any:
    """The multiprocessing context test ranks start in: forked from one server process per
    pytest process that has imported torch and the runtime (and started no thread, process
    group or device), instead of spawned as fresh interpreters that import them again: a
    world of 4 then starts in a tenth of a second instead of five, and a world replaced
    after a failed case costs nothing."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_forked(fn: Callable[..., None], *args: Any, nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from :func:`forked_context`'s server
    and joined, a failing one raised as ``torch.multiprocessing`` raises it: for a test whose
    ranks set up their own process group (a missing peer, pinned cores), not a gloo world's."""
    import torch.multiprocessing as tmp

    forked_context()  # the server, its imports preloaded, before the first start
    tmp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _serve(rank: int, world: int, port: int, timeout_s: float, conn: Any) -> None:
    import torch.distributed as dist

    init_gloo(rank, world, port, timeout_s=timeout_s)
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            break
        fn, args = job
        try:
            result = fn(rank, world, *args)
            dist.barrier()  # every rank finished the case before any starts the next
        except BaseException as exc:  # noqa: BLE001 - reported to the test, world replaced
            conn.send(("error", f"rank {rank}: " + "".join(traceback.format_exception(exc))))
            break
        conn.send(("ok", result))
    # no destroy_process_group(): its peers may be gone already, and tearing down gloo while they
    # are waits for timeouts; the parent is done with this process either way
    os._exit(0)


class GlooWorld:
    """``size`` spawned processes in one gloo group, serving cases until closed."""

    def __init__(self, size: int, timeout_s: float = TIMEOUT_S) -> None:
        self.size, self.timeout_s = size, timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def _start(self) -> None:
        """Start the ranks; a start that fails is closed (the next case starts afresh) and
        retried on another port: a port found free can be taken by another process before
        rank 0 binds its store to it (the loopback's ephemeral ports are shared by the whole
        machine), which killed rank 0 and, unclosed, failed every later case of the size."""
        ctx = forked_context()
        problem = ""
        for _ in range(_START_TRIES):
            port = free_port()
            for rank in range(self.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve,
                                   args=(rank, self.size, port, self.timeout_s, child),
                                   daemon=True)
                proc.start()
                self._procs.append(proc)
                self._conns.append(parent)
            problem, died = self._await_ready()
            if not problem:
                return
            self.close()
            if not died:  # a rank that never answered: another try would wait as long again
                break
        pytest.fail(f"gloo world of {self.size}: {problem}")

    def _await_ready(self) -> tuple[str, bool]:
        """Every rank's ready report: ``("", False)`` once all came, else what went wrong and
        whether a rank died (a failed start worth trying again) rather than never answered."""
        for rank, conn in enumerate(self._conns):
            if not conn.poll(_START_S):
                return f"rank {rank} did not start within {_START_S:.0f} s", False
            try:
                conn.recv()
            except EOFError:
                self._procs[rank].join(timeout=5)
                return (f"rank {rank} died while starting (exit {self._procs[rank].exitcode}; "
                        f"{_START_TRIES} tries)"), True
        return "", False

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; the results in rank order."""
        _machine.need_the_machine()  # the ranks run now: no other shard's test beside them
        if not self._procs:
            self._start()
        try:
            for conn in self._conns:
                conn.send((fn, args))
        except OSError as exc:  # a rank gone between cases: the next case starts afresh
            self.close()
            pytest.fail(f"gloo world of {self.size}: a rank was gone before {fn.__name__} "
                        f"({exc})", pytrace=False)
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(_CASE_S):
                errors.append(f"rank {rank}: no answer within {_CASE_S:.0f} s")
                continue
            try:
                kind, value = conn.recv()
            except EOFError:
                errors.append(f"rank {rank}: the process died (exit {self._procs[rank].exitcode})")
                continue
            (results if kind == "ok" else errors).append(value)
        if errors:
            self.close()
            pytest.fail(f"{fn.__name__} failed on the gloo world of {self.size}:\n"
                        + "\n".join(errors), pytrace=False)
        return results

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._conns = [], []


class GlooWorlds:
    """One :class:`GlooWorld` per size, created on first use (the ``gloo`` fixture)."""

    def __init__(self) -> None:
        self._worlds: dict[int, GlooWorld] = {}

    def __call__(self, size: int) -> GlooWorld:
        if size not in self._worlds:
            self._worlds[size] = GlooWorld(size)
        return self._worlds[size]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
