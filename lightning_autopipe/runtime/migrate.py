"""Move training state between two plans' layouts in memory, at a step boundary.

A re-plan changes which rank holds which parameters, buffers and optimizer state. Every rank
knows both layouts (:class:`StateLayout` in :mod:`.state_layout`: the names each global rank
holds under each plan), so every rank derives the same transfers (:func:`plan_transfers`): a
name a rank holds in both layouts stays where it is (the same tensor objects, no copy); any
other name a new holder needs comes from *one* old holder. Everything one rank sends to another
travels as one flat byte buffer, entries in sorted name order, so a switch costs one message
per (source, destination) pair, plus two small all-gathers (each rank's catalog: what it sends,
shapes and dtypes, its optimizer state's structure) and one all-reduce that ends it.

Failures: a rank whose own part fails (bad input, an unsupported optimizer state) reports it in
its catalog or in the closing all-reduce, so every rank raises the same error naming it; a rank
that dies or hangs makes its peers' waits fail (each bounded by ``timeout``), and they raise
naming it, or the error it posted first (:mod:`~lightning_autopipe.runtime.failure`).

The wire format (:mod:`.migrate_wire`) is a JSON catalog plus raw tensor bytes: nothing received
is unpickled. Over gloo the buffers live in host memory (a CUDA stage's tensors are staged);
over NCCL on the stage's device (``batch_isend_irecv``: the group's first NCCL call must then
involve every rank). Loading the result into a new stage and a live optimizer is
:mod:`.rebind`'s job. On every rank, at a step boundary after the optimizer step::

    aliases = tie_aliases(blocks, plan.cuts)
    tensors = stage_tensors(stage, aliases)           # the old stage, whole-model names
    named = named_optimizer_state(opt, {id(t): n for n, t in tensors.items()})
    executor.close(); destroy_groups(groups)
    got = migrate(tensors, StateLayout.from_plan(plan, blocks, names),
                  StateLayout.from_plan(new_plan, blocks, names),
                  optimizers=[named], scaler=scaler.state_dict(), device=device)
    new_aliases = tie_aliases(blocks, new_plan.cuts)
    new_stage = blocks.stage(*new_plan.stages[new_layout.stage].blocks)
    load_stage_tensors(new_stage, got.tensors, new_aliases)   # before the new executor
    rebind_optimizer(opt, {n: p for n, p in stage_tensors(new_stage, new_aliases).items()
                           if isinstance(p, nn.Parameter)}, got.optimizers[0])
    scaler.load_state_dict(got.scaler)
    # then the new groups and executor; release what the new stage does not hold
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_autopipe.errors import PipelineRuntimeError, PlanError
from lightning_autopipe.runtime import migrate_wire as wire
from lightning_autopipe.runtime.comm import transport_device
from lightning_autopipe.runtime.failure import FailureBoard, describe, pipeline_failure
from lightning_autopipe.runtime.optim_state import NAMES
from lightning_autopipe.runtime.state_layout import StateLayout, plan_transfers, transfer_bytes

__all__ = [
    "Migrated",
    "MigrationStats",
    "StateLayout",
    "migrate",
    "plan_transfers",
    "transfer_bytes",
]

_TAG = 7_340_033  # far above the executor's tags (2 * unit index * 64 + tensor index)


@dataclass(frozen=True)
class MigrationStats:
    """What one migration moved, seen from this rank and (totals) from the whole group."""

    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    names_kept: int
    names_received: int
    total_bytes: int
    total_messages: int
    seconds: float


@dataclass
class Migrated:
    """This rank's state under the new layout.

    Attributes:
        tensors: new-stage name -> tensor (kept names: the objects that were passed in).
        optimizers: per optimizer, its state in the named form
            (``{"state": {name: ...}, "param_groups": [{..., "param_names": [...]}]}``) over the
            new stage's names, groups' hyper-parameters as this rank had them.
        scaler: the gradient scaler's ``state_dict`` (rank 0's; every rank's must agree), or
            None when none was given.
        stats: bytes, messages and time.
    """

    tensors: dict[str, Tensor]
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    scaler: dict[str, Any] | None = None
    stats: MigrationStats | None = None


def migrate(
    tensors: Mapping[str, Tensor],
    old: StateLayout,
    new: StateLayout,
    *,
    optimizers: Sequence[Mapping[str, Any]] = (),
    scaler: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
    group: Any = None,
    timeout: timedelta = timedelta(seconds=60),
    failures: FailureBoard | None = None,
    step: int | None = None,
) -> Migrated:
    """Every rank sends what it holds and the new owners need; returns its new state.

    Collective over ``group`` (None: the default group), which must hold every rank of the
    layouts; ranks are global ranks. Call it on every rank at the same step boundary, after the
    optimizer step (no gradients in flight).

    Args:
        tensors: this rank's old stage: name -> parameter or buffer (``old.ranks[rank]``).
        old, new: the layouts before and after.
        optimizers: this rank's optimizers' states in the named form
            (:func:`~lightning_autopipe.runtime.optim_state.named_optimizer_state`); every rank
            passes the same number, with the same number of groups.
        scaler: the gradient scaler's ``state_dict()``, or None.
        device: where received tensors go (optimizer state that lived on the CPU, such as
            Adam's ``step``, stays there).
        timeout: bound on every wait; a peer that does not answer in time fails the migration.
        failures: the board this rank posts its failure to (default: a new one on the default
            group's store, created on every rank alike).
        step: the training step, quoted in failure messages.

    Raises:
        PlanError: the layouts disagree between ranks, or the state does not match them
            (raised on every rank, naming the rank at fault).
        PipelineRuntimeError: a rank failed or went silent during the migration.
    """
    start = time.perf_counter()
    device = torch.device(device)
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))
    transport = transport_device(dist.get_backend(group), device)
    board = failures if failures is not None else FailureBoard.for_current_group()
    ctx = _Context(rank, board, timeout, step)

    # 1. this rank's own part: check, pick the names it sends, describe them, pack them
    error, bad_input = None, False
    moves: dict[tuple[int, int], list[str]] = {}
    sends: dict[int, Tensor] = {}
    catalog: dict[str, Any] = {}
    try:
        if sorted(ranks) != list(range(old.world_size)):
            raise PlanError(
                f"the migration group holds ranks {ranks} but the layouts span "
                f"{old.world_size} ranks; migrate over a group of every rank"
            )
        moves = plan_transfers(old, new)
        _check_local(tensors, optimizers, old, rank)
        outgoing = sorted({n for (src, _), names in moves.items() if src == rank for n in names})
        catalog = {n: wire.describe_entry(n, tensors, optimizers, device) for n in outgoing}
        for (src, dst), names in moves.items():
            if src == rank:
                sends[dst] = wire.pack(names, catalog, tensors, optimizers, transport)
    except Exception as exc:
        error = f"rank {rank} could not prepare its part of the migration: {describe(exc)}"
        bad_input = isinstance(exc, PlanError)
    mine = {
        "error": error,
        "bad_input": error is not None and bad_input,
        "layouts": _fingerprint(old, new),
        "optimizers": len(optimizers),
        "groups": [len(o["param_groups"]) for o in optimizers],
        "scaler": dict(scaler) if scaler is not None else None,
        "catalog": catalog,
    }
    with ctx.watch("the exchange of catalogs", None):
        peers = wire.all_gather_json(mine, len(ranks), transport, group, timeout)
    _agree(peers, rank)

    # 2. the transfers: one flat buffer per (source, destination) pair
    recvs = {
        src: torch.empty(wire.payload_size(names, peers[src]["catalog"]), dtype=torch.uint8,
                         device=transport)
        for (src, dst), names in moves.items()
        if dst == rank
    }
    ops = [dist.P2POp(dist.isend, buf, dst, group=group, tag=_TAG) for dst, buf in sends.items()]
    ops += [dist.P2POp(dist.irecv, buf, src, group=group, tag=_TAG) for src, buf in recvs.items()]
    partners = set(sends) | set(recvs)
    with ctx.watch("the transfer of state", partners.pop() if len(partners) == 1 else None):
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait(timeout)

    # 3. this rank's new state, then every rank confirms (or learns who failed)
    out: Migrated | None = None
    failed = None
    try:
        out = _assemble(tensors, optimizers, old, new, rank, moves, recvs, peers, device)
    except Exception as exc:
        failed = exc
        if board is not None:
            board.post(f"rank {rank} failed in assembling its migrated state: {describe(exc)}")
    sent = sum(b.numel() for b in sends.values())
    totals = torch.tensor([float(failed is not None), float(sent), float(len(sends))],
                          dtype=torch.float64, device=transport)
    with ctx.watch("the closing all-reduce", None):
        dist.all_reduce(totals, group=group, async_op=True).wait(timeout)
    if failed is not None:
        raise PipelineRuntimeError(
            f"rank {rank} failed in assembling its migrated state: {describe(failed)}"
        ) from failed
    if totals[0] > 0:
        first = board.first(wait_s=2.0) if board is not None else None
        raise PipelineRuntimeError(
            f"rank {rank} stopped the migration because "
            + (first or "another rank failed assembling its state (see its log)")
        )
    assert out is not None
    out.scaler = peers[0]["scaler"]
    received = [n for (_, dst), names in moves.items() if dst == rank for n in names]
    held = set(old.ranks[rank]) - set(received)  # a received copy replaces the rank's own
    out.stats = MigrationStats(
        bytes_sent=sent,
        bytes_received=sum(b.numel() for b in recvs.values()),
        messages_sent=len(sends),
        messages_received=len(recvs),
        names_kept=sum(1 for n in new.ranks[rank] if n in held),
        names_received=len(received),
        total_bytes=int(totals[1]),
        total_messages=int(totals[2]),
        seconds=time.perf_counter() - start,
    )
    return out


# ------------------------------------------------------------------------------- internals
@dataclass
class _Context:
    rank: int
    board: FailureBoard | None
    timeout: timedelta
    step: int | None

    def watch(self, what: str, peer: int | None) -> Any:
        return _Watch(self, what, peer)


class _Watch:
    """A communication step: any failure becomes the error naming the first failing rank."""

    def __init__(self, ctx: _Context, what: str, peer: int | None) -> None:
        self.ctx, self.what, self.peer = ctx, what, peer

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, PipelineRuntimeError | PlanError):
            return False
        if not isinstance(exc, Exception):
            return False
        ctx = self.ctx
        raise pipeline_failure(
            ctx.board,
            exc,
            where=f"rank {ctx.rank}",
            what=f"{self.what} of a layout migration",
            when=f"step {ctx.step}" if ctx.step is not None else "a re-plan",
            peer=self.peer,
            communication=True,
            timeout_s=ctx.timeout.total_seconds(),
        ) from exc


def _fingerprint(old: StateLayout, new: StateLayout) -> str:
    text = json.dumps([old.to_json(), new.to_json()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_local(
    tensors: Mapping[str, Tensor], optimizers: Sequence[Mapping[str, Any]], old: StateLayout,
    rank: int,
) -> None:
    """The state given matches what the old layout says this rank holds."""
    want, got = set(old.ranks[rank]), set(tensors)
    if want != got:
        raise PlanError(
            f"the old layout says rank {rank} holds {len(want)} names but it was given "
            f"{len(got)} tensors (missing {sorted(want - got)[:4]}, extra "
            f"{sorted(got - want)[:4]}); pass the old stage's tensors under the whole model's "
            "names"
        )
    for i, opt in enumerate(optimizers):
        foreign = sorted(set(opt["state"]) - got)
        if foreign:
            raise PlanError(
                f"optimizer {i} holds state for {foreign[:4]}, which this rank's stage does "
                "not hold; pass named_optimizer_state of the stage's own optimizer"
            )


def _agree(peers: Sequence[Mapping[str, Any]], rank: int) -> None:
    """Raise, on every rank alike, the first problem any rank reported in its catalog."""
    for r, p in enumerate(peers):
        if p["error"] is not None:
            kind = PlanError if p["bad_input"] else PipelineRuntimeError
            raise kind(p["error"] if r == rank else f"rank {rank} stopped: {p['error']}")
    for key, what in (("layouts", "old and new layouts"), ("optimizers", "number of optimizers"),
                      ("groups", "optimizer groups"), ("scaler", "gradient scaler state")):
        values = [json.dumps(p[key], sort_keys=True) for p in peers]
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise PlanError(
                f"the ranks disagree on the {what} of the migration (ranks {differ} differ "
                f"from rank 0: {values[differ[0]][:200]} vs {values[0][:200]}); every rank must "
                "migrate between the same plans with the same optimizers and scaler"
            )


def _assemble(
    tensors: Mapping[str, Tensor], optimizers: Sequence[Mapping[str, Any]], old: StateLayout,
    new: StateLayout, rank: int, moves: Mapping[tuple[int, int], list[str]],
    recvs: Mapping[int, Tensor], peers: Sequence[Mapping[str, Any]], device: torch.device,
) -> Migrated:
    """The new stage's tensors and named optimizer states: kept ones plus received ones."""
    kept = set(old.ranks[rank])
    got: dict[str, Tensor] = {}
    got_state: dict[str, list[Any]] = {}
    got_groups: dict[str, list[int | None]] = {}
    for (src, dst), names in moves.items():
        if dst != rank:
            continue
        catalog, pos = peers[src]["catalog"], 0
        for name in names:
            got[name], got_state[name], pos = wire.unpack_entry(catalog[name], recvs[src], pos,
                                                            device)
            got_groups[name] = catalog[name]["groups"]
    kept -= set(got)  # a received copy replaces this rank's own (another replica's buffer)
    out_tensors = {n: tensors[n] if n in kept else got[n] for n in new.ranks[rank]}
    out_opts = []
    for i, opt in enumerate(optimizers):
        group_of = {n: g for g, grp in enumerate(opt["param_groups"]) for n in grp[NAMES]}
        state, names_per_group = {}, [[] for _ in opt["param_groups"]]
        for name in new.ranks[rank]:
            if name in kept:
                g, value = group_of.get(name), opt["state"].get(name)
            else:
                g, value = got_groups[name][i], got_state[name][i]
            if g is not None:
                names_per_group[g].append(name)
            if value is not None:
                state[name] = value
        groups = [{**{k: v for k, v in grp.items() if k != NAMES}, NAMES: names}
                  for grp, names in zip(opt["param_groups"], names_per_group)]
        out_opts.append({"state": state, "param_groups": groups})
    return Migrated(tensors=out_tensors, optimizers=out_opts)
