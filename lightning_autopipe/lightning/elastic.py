"""Elastic runs under torchrun: which attempt this is, what a restart lost and what it replays.

torchrun's elastic agent restarts *every* worker, with a new world size inside
``--nnodes=MIN:MAX``, when a node is lost or joins; the script runs again from the top and
``fit(ckpt_path="last")`` resumes the newest checkpoint. What the strategy adds:

* the world is the one torchrun formed (:func:`launched_nodes`), not the ``num_nodes`` the
  Trainer was given, so a smaller cluster plans instead of failing Lightning's size check;
* every checkpoint records the world and layout that wrote it (:func:`checkpoint_record`), and
  rank 0 notes the step each training step starts (:class:`ProgressNote`, next to the
  checkpoints), so a resumed attempt logs the step it resumes from, the steps that had run
  since (lost, now replayed), the old and the new world and layout (:func:`resume_message`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PROGRESS_FILE",
    "RECORD_KEY",
    "ElasticAttempt",
    "ProgressNote",
    "checkpoint_record",
    "launched_nodes",
    "resume_facts",
    "resume_message",
]

RECORD_KEY = "autopipe_world"  # the checkpoint's record of the world that wrote it
PROGRESS_FILE = "autopipe-progress.json"  # next to the checkpoints: the last step started


@dataclass(frozen=True)
class ElasticAttempt:
    """One torchrun attempt, from the variables torchrun sets in every worker."""

    run_id: str
    restart: int  # 0 for the first attempt
    max_restarts: int
    nodes: int  # agents (nodes) in this attempt's rendezvous
    world_size: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ElasticAttempt | None:
        """This process's attempt, or None when torchrun did not start it."""
        env = os.environ if env is None else env
        if "TORCHELASTIC_RUN_ID" not in env or "WORLD_SIZE" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE", world) or world)
        return cls(
            run_id=env["TORCHELASTIC_RUN_ID"],
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0) or 0),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0) or 0),
            nodes=int(env.get("GROUP_WORLD_SIZE", 0) or 0) or max(1, world // max(local, 1)),
            world_size=world,
        )

    def describe(self) -> str:
        return (
            f"torchrun run {self.run_id!r}, attempt {self.restart + 1} (restart {self.restart} "
            f"of at most {self.max_restarts}): {self.world_size} ranks on {self.nodes} "
            f"node{'s' if self.nodes != 1 else ''}"
        )


def launched_nodes(configured: int, env: Mapping[str, str] | None = None) -> int:
    """The node count of this attempt under torchrun, else ``configured`` (the Trainer's).

    An elastic restart on fewer (or more) nodes keeps the script's ``num_nodes``; the world
    torchrun formed is the truth, so Lightning's ``devices x num_nodes == WORLD_SIZE`` check
    and the planner see the cluster that is really there.
    """
    attempt = ElasticAttempt.from_env(env)
    return attempt.nodes if attempt is not None else configured


def checkpoint_record(
    world_size: int, num_nodes: int, layout: Any, global_step: int
) -> dict[str, Any]:
    """What a checkpoint keeps of the world that wrote it (read back by :func:`resume_message`)."""
    attempt = ElasticAttempt.from_env()
    return {
        "world_size": int(world_size),
        "num_nodes": int(num_nodes),
        "num_stages": int(layout.num_stages) if layout is not None else 1,
        "num_replicas": int(layout.num_replicas) if layout is not None else int(world_size),
        "global_step": int(global_step),
        "restart": attempt.restart if attempt is not None else None,
    }


class ProgressNote:
    """Rank 0 of a torchrun run notes each step as it starts in ``<checkpoint dir>/PROGRESS_FILE``.

    A restart resumes from the last checkpoint; the note says how far the lost attempt had got,
    so the log can name the steps whose work was lost and is replayed. Written by a replace of
    a sibling (a reader never sees half a note); it is a hint, so it is not fsynced.
    """

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder) / PROGRESS_FILE if folder is not None else None

    def started(self, step: int, world_size: int) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"step": int(step), "world_size": int(world_size)}))
        os.replace(tmp, self.path)

    def read(self) -> dict[str, Any] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None


def _width(stages: int, replicas: int) -> str:
    return f"{stages} stage{'s' if stages != 1 else ''} x {replicas} replica" + (
        "s" if replicas != 1 else ""
    )


def resume_facts(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The little a resume message needs from a loaded checkpoint (not its tensors)."""
    return {
        "global_step": int(checkpoint.get("global_step", 0)),
        RECORD_KEY: dict(checkpoint.get(RECORD_KEY) or {}),
        "data": _loader_state(checkpoint),
    }


def resume_message(
    path: Any,
    facts: Mapping[str, Any],
    progress: Mapping[str, Any] | None,
    world_size: int,
    num_nodes: int,
    layout: Any,
    attempt: ElasticAttempt | None,
) -> str:
    """What rank 0 logs once a resumed attempt's pipeline is planned.

    Names the step resumed from (the checkpoint's, ``facts`` from :func:`resume_facts`), the
    steps started since by the attempt that wrote ``progress`` (their work is lost and they run
    again), the world and layout that wrote the checkpoint and this attempt's, and where the
    data order continues.
    """
    step = int(facts.get("global_step", 0))
    record = facts.get(RECORD_KEY) or {}
    head = f"elastic: {attempt.describe()}; " if attempt is not None else ""
    lines = [f"{head}resuming from {path} at step {step}"]
    last = int(progress["step"]) if progress and "step" in progress else None
    if last is not None and last > step:
        lost = f"step {step + 1}" if last == step + 1 else f"steps {step + 1}-{last}"
        lines.append(
            f"lost: {lost} had started since that checkpoint (on "
            f"{progress.get('world_size', '?')} ranks); their work is replayed from step "
            f"{step + 1}"
        )
    else:
        lines.append("lost: nothing (no step had started since that checkpoint)")
    if record:
        old = (
            f"{record.get('world_size')} ranks on {record.get('num_nodes')} node(s), "
            f"{_width(record.get('num_stages', 1), record.get('num_replicas', 1))}"
        )
    else:
        old = "an unrecorded world"
    new = f"{world_size} ranks on {num_nodes} node(s)"
    if layout is not None:
        new += f", {_width(layout.num_stages, layout.num_replicas)}"
    lines.append(f"world: written by {old}; now {new}")
    data = facts.get("data")
    if data is not None:
        lines.append(
            f"data: epoch {data['epoch']} continues after global batch {data['batches']} "
            f"(global batch {data['global_batch_size']} samples, now "
            f"{data['global_batch_size'] // max(getattr(layout, 'num_replicas', 1), 1)} per "
            "replica)"
        )
    return "\n  ".join(lines)


def _loader_state(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first elastic loader state Lightning saved with the fit loop, if any."""
    try:
        states = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    except (KeyError, TypeError):
        return None
    for state in states or ():
        if isinstance(state, Mapping) and "global_batch_size" in state and "batches" in state:
            return dict(state)
    return None
