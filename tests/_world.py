"""One Lightning launch that runs the cases of many test modules in turn.

    python tests/_world.py OUT WORLD MODULE:CASE [MODULE:CASE ...]

Every rank imports torch and Lightning once and then, for each spec in order, calls
``MODULE.run_case(CASE, WORLD, OUT / MODULE)``; a returned dict is saved as
``<that folder>/<CASE>.rank<r>.pt``. Every rank runs every case. The launching process starts
the other ranks itself, as Lightning's popen launcher would (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` set), and every rank waits until all have imported torch and
Lightning before the first case, so the first case's process-group timeout never has to cover
the others' start-up on a busy machine. It ends with a non-zero status when a rank did, and no
rank outlives it. A case that raises is written to
``<folder>/<CASE>.error.rank<r>.txt`` and the next case runs (its peers end the case through
the strategy's failure handling or its timeout), so one broken case fails its own tests only.

The pytest side (which cases, one launch per world size, reading the results) is
:mod:`tests._worlds`.
"""

from __future__ import annotations

import gc
import importlib
import os
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


def _start_others(world: int) -> list[subprocess.Popen]:
    """In the launching process: become rank 0 of ``world`` and start ranks 1.. as children."""
    ports = {"MASTER_PORT": str(free_port()), "AUTOPIPE_WORLD_READY_PORT": str(free_port())}
    common = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(world), "NODE_RANK": "0", **ports}
    os.environ.update(common, LOCAL_RANK="0")
    return [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, **common,
                                                               "LOCAL_RANK": str(r)})
            for r in range(1, world)]


def _wait_for_every_rank(world: int, children: list[subprocess.Popen]) -> None:
    """A start barrier on its own store (the default process group is the cases' own); rank
    0 stops waiting as soon as one of the ranks it started has died (an import that failed),
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


def _await_count(store: Any, key: str, count: int, children: list[subprocess.Popen]) -> None:
    """Rank 0: until ``count`` ranks have added to ``key``; raised when one it started died."""
    end = time.monotonic() + _START_S
    while store.add(key, 0) < count:
        dead = [c.args for c in children if c.poll() is not None]
        if dead or time.monotonic() > end:
            raise RuntimeError(f"a rank never started (exited: {dead})")
        time.sleep(0.02)


def _finish(children: list[subprocess.Popen]) -> int:
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
    # the other ranks start before this one imports anything heavy: the imports overlap
    children = _start_others(world) if "LOCAL_RANK" not in os.environ else []
    try:
        _import_the_stack()
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
