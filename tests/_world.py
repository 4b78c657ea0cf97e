"""One Lightning launch that runs the cases of many test modules in turn.

    python tests/_world.py OUT WORLD MODULE:CASE [MODULE:CASE ...]

torch and Lightning are imported once, and then every rank, for each spec in order, calls
``MODULE.run_case(CASE, WORLD, OUT / MODULE)``; a returned dict is saved as
``<that folder>/<CASE>.rank<r>.pt``. Every rank runs every case. The launching process is rank
0: it sets the environment Lightning's popen launcher would give the ranks (``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), imports torch and Lightning, then forks the
other ranks, and every rank waits until all are up before the first case, so the first case's
process-group timeout never has to cover the others' start-up on a busy machine. It ends with
a non-zero status when a rank did, and no rank outlives it. A case that raises is written to
``<folder>/<CASE>.error.rank<r>.txt`` and the next case runs (its peers end the case through
the strategy's failure handling or its timeout), so one broken case fails its own tests only.

The pytest side (which cases, one launch per world size, reading the results) is
:mod:`tests._worlds`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the script's own folder (tests/) would shadow packages by its subfolders' names (tests/lightning)
sys.path[0] = str(ROOT)

from tests._launch import free_port  # noqa: E402 - the checkout is importable now


def _import_the_stack() -> None:
    """torch and Lightning, once per rank, before the start barrier
    (:func:`tests._stack.import_the_stack`); then the heap they built is frozen
    (:func:`gc.freeze`): the strategy collects garbage at every fit to release earlier
    cases' pipelines alike on every rank, and a full collection that also walks those
    imported objects takes a fifth of a second per case."""
    global torch
    from tests._stack import import_the_stack

    import_the_stack()
    import torch

    gc.freeze()


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


#: Seconds every rank may take to start (interpreter, torch, Lightning) on a loaded machine.
_START_S = 600


def _become_rank_zero(world: int) -> None:
    """In the launching process: the environment of rank 0 of ``world``, before any import
    (the ranks forked from it later inherit it and change only ``LOCAL_RANK``)."""
    ports = {"MASTER_PORT": str(free_port()), "AUTOPIPE_WORLD_READY_PORT": str(free_port())}
    common = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(world), "NODE_RANK": "0", **ports}
    os.environ.update(common, LOCAL_RANK="0")


class _Forked:
    """A rank forked by the launching process: what the launch needs of a child process."""

    def __init__(self, pid: int, rank: int) -> None:
        self.pid, self.args, self.returncode = pid, f"rank {rank} (pid {pid})", None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _fork_others(world: int) -> list[_Forked]:
    """In the launching process, once torch and Lightning are imported: ranks 1.. as forked
    children, which start with the imports in memory instead of paying them again (an
    interpreter, torch and Lightning are about three CPU-seconds per rank here: a third of a
    4-rank world's start). A forked rank returns no children and goes on as rank r. Forked by
    :func:`os.fork`, not as a :mod:`multiprocessing` process, whose child leaves through
    ``os._exit``: a rank here ends as a launched one does, through the interpreter's exit and
    the atexit hooks the strategy registered (:mod:`lightning_autopipe.lightning.held_pipeline`)."""
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered is written twice
    children = []
    for r in range(1, world):
        pid = os.fork()
        if pid == 0:
            os.environ["LOCAL_RANK"] = str(r)
            return []
        children.append(_Forked(pid, r))
    return children


def _wait_for_every_rank(world: int, children: list[_Forked]) -> None:
    """A start barrier on its own store (the default process group is the cases' own); rank
    0 stops waiting as soon as one of the ranks it started has died (before the barrier),
    and keeps the store (its server) until every other rank has read the go."""
    local = int(os.environ["LOCAL_RANK"])
    store = torch.distributed.TCPStore(
        "127.0.0.1", int(os.environ["AUTOPIPE_WORLD_READY_PORT"]), world, local == 0,
        timeout=timedelta(seconds=_START_S), wait_for_workers=False)
    if local:
        store.add("ready", 1)
        store.wait(["go"])
        store.add("gone", 1)
    else:
        _await_count(store, "ready", world - 1, children)
        store.set("go", "1")
        _await_count(store, "gone", world - 1, children)
    del store


def _await_count(store: Any, key: str, count: int, children: list[_Forked]) -> None:
    """Rank 0: until ``count`` ranks have added to ``key``; raised when one it started died."""
    end = time.monotonic() + _START_S
    while store.add(key, 0) < count:
        dead = [c.args for c in children if c.poll() is not None]
        if dead or time.monotonic() > end:
            raise RuntimeError(f"a rank never started (exited: {dead})")
        time.sleep(0.02)


def _finish(children: list[_Forked]) -> int:
    """Rank 0, after its cases: the others' exit status (any still running after a grace
    period is killed)."""
    status = 0
    for child in children:
        try:
            status = status or child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
            status = status or 1
    return status


def main() -> None:
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    launcher = "LOCAL_RANK" not in os.environ
    if launcher:
        _become_rank_zero(world)
    children: list[_Forked] = []
    try:
        _import_the_stack()
        children = _fork_others(world) if launcher else []
        _wait_for_every_rank(world, children)
    except BaseException:  # rank 0 failed to start: its children must not wait out _START_S
        for child in children:
            child.kill()
        raise
    for spec in sys.argv[3:]:
        module_name, _, case = spec.partition(":")
        folder = out / module_name
        folder.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        print(f"[world {world}] rank {_rank()}: {spec} starts", file=sys.stderr, flush=True)
        environ = dict(os.environ)  # a case's seed_everything exports PL_GLOBAL_SEED, which
        try:  # would reseed every later case's DistributedSampler: each case starts afresh
            record = importlib.import_module(module_name).run_case(case, world, folder)
        except BaseException as exc:  # noqa: BLE001 - recorded for the case's own tests
            if isinstance(exc, KeyboardInterrupt):
                raise
            text = "".join(traceback.format_exception(exc))
            (folder / f"{case}.error.rank{_rank()}.txt").write_text(text)
            print(f"[world {world}] rank {_rank()}: {spec} raised {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            continue
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.use_deterministic_algorithms(False)  # Trainer(deterministic=True) sets it
        if isinstance(record, dict):
            torch.save(record, folder / f"{case}.rank{_rank()}.pt")
        print(f"[world {world}] rank {_rank()}: {spec} done in {time.monotonic() - start:.1f} s",
              file=sys.stderr, flush=True)
    # every rank at its exit before rank 0 waits for the others' exit: the strategy's exit
    # hook waits (up to its EXIT_WAIT_S) until every rank has reached it
    from lightning_autopipe.lightning.held_pipeline import leave

    leave()
    sys.exit(_finish(children))


if __name__ == "__main__":
    main()
