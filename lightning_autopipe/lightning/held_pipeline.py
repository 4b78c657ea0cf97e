"""The pipeline a strategy keeps between Trainer calls, and the modules pipelines have split.

Building a pipeline binds the module's parameters to this rank's stage and releases the rest, so
the module can no longer be traced: ``validate`` / ``test`` / ``predict`` / ``fit`` again after
``fit`` must run on the pipeline already built. :class:`HeldPipeline` keeps it past Lightning's
teardown and releases it (executor hooks first, then the process groups) exactly once: when the
strategy builds another, after a failed run, when the strategy is collected, or at exit (a
gloo group that outlives ``destroy_process_group`` can abort the interpreter as it exits).

Releasing closes the executor at once but only queues its process groups: every rank destroys
the queued groups together, between two barriers, when the next pipeline is built
(:func:`destroy_released_groups`), or at exit (:func:`leave`: after every rank reached its own
exit, then the default group too; Lightning destroys it at exit only for NCCL, and a gloo group
left to the interpreter's finalisation, or closed while a peer still reads its last message,
aborts that peer: "terminate called without an active exception"). Destroying a gloo group
is not safe at an arbitrary moment: a strategy is usually collected by the cyclic garbage
collector, at a different time on every rank, and a rank that destroyed its groups while the
others were already in the next ``fit``'s first collective broke the default group (every rank
timed out in Lightning's ``log_dir`` broadcast).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.failure import LAUNCHER_PID_ENV
from lightning_autopipe.runtime.groups import destroy_groups

__all__ = ["HeldPipeline", "destroy_pipeline_groups", "destroy_released_groups", "leave",
           "mark_in_run"]

# Modules whose parameters a pipeline has bound to one stage (the others released).
_SPLIT: weakref.WeakSet[Any] = weakref.WeakSet()
# Process groups of released pipelines, waiting for every rank to destroy them together.
_RELEASED: list[Any] = []
_EXIT_HOOK: list[bool] = []
# A run failed on this rank: at exit its peers may be gone, so it does not wait for them.
_FAILED: list[bool] = []
#: Seconds a rank waits at exit for the others to reach theirs (a rank still writing files
#: after ``fit`` delays its peers' exit by at most this; then they leave anyway).
EXIT_WAIT_S = 60.0
_EXIT_KEY = "autopipe/exit"
_IN_RUN_KEY = "autopipe/in_run/"


class HeldPipeline:
    """One strategy's pipeline (a ``LocalPipeline``), the module it split and its step runner."""

    def __init__(self) -> None:
        self._box: list[Any] = []  # the finalizer holds the box, not the strategy
        self.module: Any = None
        self.runner: Any = None
        self._finalizer: Any = None

    @property
    def pipe(self) -> Any:
        """The held ``LocalPipeline``, or None."""
        return self._box[0] if self._box else None

    def serves(self, module: Any) -> bool:
        """The held pipeline was built from ``module`` (so it can run it again)."""
        return self.pipe is not None and self.module is module

    @staticmethod
    def is_split(module: Any) -> bool:
        """Some pipeline has bound ``module`` to one stage."""
        return module in _SPLIT

    def check_splittable(self, module: Any) -> None:
        """A module another pipeline split cannot be traced again (every rank raises)."""
        if module in _SPLIT:
            raise PlanError(
                f"this {type(module).__name__} was already split into pipeline stages (each "
                "rank released the other stages' weights) by another Trainer, or its pipeline "
                "was released after a failed run, so it cannot be traced again; run validate / "
                "test / predict / fit again on the Trainer that split it, or load a checkpoint "
                "into a new module (e.g. Model.load_from_checkpoint(path))"
            )

    def hold(self, owner: Any, pipe: Any, module: Any, runner: Any) -> None:
        """Keep ``pipe`` (built from ``module``) for ``owner``, the strategy, after release of
        any earlier one. Call after the process group exists: the exit hook registered here
        then runs before Lightning's."""
        self.release()
        _SPLIT.add(module)
        self._box.append(pipe)
        self.module, self.runner = module, runner
        if not _EXIT_HOOK:  # registered before the finalizers, so it runs after them
            _EXIT_HOOK.append(True)
            atexit.register(leave)
        if self._finalizer is None:
            self._finalizer = weakref.finalize(owner, _release, self._box)
            atexit.register(self._finalizer)

    def release(self, failed: bool = False) -> None:
        """Close the executor (its hooks hold the groups) and queue its process groups;
        ``failed``: after a failed run (at exit this rank then does not wait for its peers)."""
        if failed:
            _FAILED.append(True)
        _release(self._box)
        self.module = self.runner = None


def destroy_released_groups() -> None:
    """Destroy the process groups of every released pipeline: every rank calls it at the same
    point (before building a pipeline); a collective over the default group.

    A full garbage collection first releases the pipelines of strategies nothing refers to any
    more, alike on every rank (the program is the same everywhere), so every rank destroys the
    same groups; the barriers keep any rank from destroying while another still uses them or
    already runs the next collective.
    """
    gc.collect()
    if not (dist.is_available() and dist.is_initialized()):
        _RELEASED.clear()
        return
    dist.barrier()
    _destroy_released()
    dist.barrier()


def destroy_pipeline_groups(groups: Any) -> None:
    """Destroy one released pipeline's process groups on every rank at once, between two
    barriers (a live re-plan's old pipeline: every rank knows it, so no garbage collection is
    needed to agree on what to destroy, and a full one costs seconds on a loaded machine)."""
    if groups is None:
        return
    for i, queued in enumerate(_RELEASED):
        if queued is groups:
            del _RELEASED[i]
            break
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        destroy_groups(groups)
        dist.barrier()


def _release(box: list[Any]) -> None:
    while box:
        pipe = box.pop()
        pipe.executor.close()
        if pipe.groups is not None:
            _RELEASED.append(pipe.groups)


def _destroy_released() -> None:
    while _RELEASED:
        groups = _RELEASED.pop()
        if dist.is_available() and dist.is_initialized():
            destroy_groups(groups)


def mark_in_run(inside: bool) -> None:
    """Say in the default group's store whether this rank is inside a Trainer call (the
    strategy's setup to its teardown): at exit rank 0 tells a peer that never left its run
    from one doing its own work after it (:func:`leave`). Best effort, as the store allows."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_IN_RUN_KEY}{dist.get_rank()}", "1" if inside else "0")


def leave(wait_s: float = EXIT_WAIT_S,
          on_stuck: Callable[[str], None] | None = None) -> None:
    """At exit: wait until every rank reached its exit (unless a run failed here), then destroy
    the released pipelines' groups and the default group.

    The wait goes through the default group's store, not a gloo collective: a rank that left
    a collective may still have a peer reading its last message, while a rank that reached
    this point has finished every collective of its own. Best effort: a peer that never comes
    (or a store whose host already left) ends the wait, and the groups are destroyed anyway.
    A peer that rank 0 waited for in vain while it was still inside its run (:func:`mark_in_run`:
    hung, or failing after the run's last collective, in an epoch-end hook or a callback at
    the end of training) is told: ``on_stuck`` gets the message (default: under Lightning's
    launcher, whose exit ends that rank, printed with exit status 1, where the job ended with
    status 0 and that rank's error unseen; under torchrun or SLURM a warning).
    """
    if not (dist.is_available() and dist.is_initialized()):
        _RELEASED.clear()
        return
    stuck: list[int] = []
    if not _FAILED:
        try:
            _wait_for_every_rank(wait_s)
        except Exception:  # noqa: BLE001 - a wait that ran out, or a store already gone
            with contextlib.suppress(Exception):
                stuck = _stuck_in_run()
    _destroy_released()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    if stuck:
        (on_stuck or _fail_the_job)(
            f"rank(s) {stuck} never finished their run: {wait_s:g} s after rank 0 reached its "
            "exit they were still inside the Trainer call (hung, or failing after its last "
            "collective, e.g. in an epoch-end hook or a callback at the end of training); "
            "check their log")


def _fail_the_job(message: str) -> None:
    """Where this process started the other ranks (Lightning's launcher), its exit ends them
    and its status is the job's: status 1. Under torchrun or SLURM each rank's own status
    counts (a late rank may still finish its work): a warning."""
    if os.environ.get(LAUNCHER_PID_ENV) != str(os.getpid()):
        print(f"[rank 0] warning: {message}", file=sys.stderr, flush=True)
        return
    print(f"[rank 0] {message}; the job fails", file=sys.stderr, flush=True)
    sys.stdout.flush()
    logging.shutdown()
    os._exit(1)  # at exit: an exception raised here would be printed and the status kept 0


def _wait_for_every_rank(wait_s: float) -> None:
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{_EXIT_KEY}/{dist.get_rank()}", "1")
    arrived = store.add(_EXIT_KEY, 1)
    if arrived >= dist.get_world_size():
        store.set(_EXIT_KEY + "/all", "1")
    store.wait([_EXIT_KEY + "/all"], timedelta(seconds=wait_s))


def _stuck_in_run() -> list[int]:
    """On rank 0 (the store's host, and the job's status under Lightning's launcher): the
    ranks that have not reached their exit and are still inside their run."""
    if dist.get_rank() != 0:
        return []
    store = dist.distributed_c10d._get_default_store()
    out = []
    for r in range(1, dist.get_world_size()):
        if store.check([f"{_EXIT_KEY}/{r}"]):
            continue
        key = f"{_IN_RUN_KEY}{r}"
        if store.check([key]) and store.get(key) == b"1":
            out.append(r)
    return out

