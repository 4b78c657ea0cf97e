"""Several chunks per rank (looped and V placement) on real gloo ranks vs one process.

The executor runs hand-made action lists here: a global order of every chunk's actions that
respects the dependencies (forward of chunk c after chunk c - 1, backward after chunk c + 1)
projected onto each rank, then lowered with no transfer between two chunks of one rank. The
planner's own generators (interleaved 1F1B, ZB-V) are run through the Trainer elsewhere.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.planner.schedule import units as all_units
from lightning_autopipe.runtime.executor import PipelineExecutor, TiedParameter
from lightning_autopipe.runtime.groups import RankLayout, build_groups, destroy_groups
from tests._gloo import TIMEOUT_S
from tests.runtime._toy import (
    ToyChain,
    ToyStage,
    assert_norm_and_eval_match,
    toy_loss,
    toy_reference,
)


def placement(kind: str, p: int, v: int) -> tuple[int, ...]:
    """Row of each chunk: looped ``c % p``, V ``c`` then ``2p - 1 - c``."""
    if kind == "v":
        return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))
    return tuple(c % p for c in range(p * v))


def global_order(S: int, us: list[tuple[int, int]], warm: int, split: bool
                 ) -> list[Action]:
    """A sequential order of one step: ``warm`` units forward first, then one backward per
    forward (1F1B over units, each unit through every chunk); a split backward's ``W`` runs one
    backward later than its ``B``."""
    out: list[Action] = []
    pending_w: list[Action] = []

    def fwd(u):
        out.extend(Action(c, Kind.FORWARD, *u) for c in range(S))

    def bwd(u):
        for c in reversed(range(S)):
            out.append(Action(c, Kind.BACKWARD, *u))
            if split:
                pending_w.append(Action(c, Kind.WEIGHT, *u))
        if split:  # the W of the unit before this one
            while len(pending_w) > S:
                out.append(pending_w.pop(0))

    for u in us[:warm]:
        fwd(u)
    for i, u in enumerate(us):
        if i + warm < len(us):
            fwd(us[i + warm])
        bwd(u)
    out.extend(pending_w)
    return out


def lower(order: list[Action], rows: tuple[int, ...]) -> dict[int, list[Action]]:
    """Each row's actions with the transfers between chunks of different rows."""
    S = len(rows)
    out: dict[int, list[Action]] = {r: [] for r in sorted(set(rows))}
    for a in order:
        c, r, mb, sl = a.stage, rows[a.stage], a.microbatch, a.slice
        acts = out[r]
        if a.kind is Kind.FORWARD:
            if c > 0 and rows[c - 1] != r:
                acts.append(Action(c, Kind.RECV_F, mb, sl))
            acts.append(a)
            if c < S - 1 and rows[c + 1] != r:
                acts.append(Action(c, Kind.SEND_F, mb, sl))
        elif a.kind is Kind.BACKWARD:
            if c < S - 1 and rows[c + 1] != r:
                acts.append(Action(c, Kind.RECV_B, mb, sl))
            acts.append(a)
            if c > 0 and rows[c - 1] != r:
                acts.append(Action(c, Kind.SEND_B, mb, sl))
        else:
            acts.append(a)
    return out


def test_lowering_helper_hands_off_between_chunks_of_one_rank():
    rows = placement("v", 2, 2)  # rank 0: chunks 0, 3; rank 1: chunks 1, 2
    sched = lower(global_order(4, [(0, 0)], 1, split=False), rows)
    assert " ".join(map(str, sched[1])) == "1RF0.0 1F0.0 2F0.0 2SF0.0 2RB0.0 2B0.0 1B0.0 1SB0.0"
    assert " ".join(map(str, sched[0])) == "0F0.0 0SF0.0 3RF0.0 3F0.0 3B0.0 3SB0.0 0RB0.0 0B0.0"


def _layout(rank: int, p: int, replicas: int, rows: tuple[int, ...]) -> RankLayout:
    grid = tuple(tuple(s * replicas + r for r in range(replicas)) for s in range(p))
    stage, replica = divmod(rank, replicas)
    return RankLayout(rank=rank, stage=stage, replica=replica, grid=grid, placement=rows)


def _chunk_case(rank: int, world: int, kind: str, p: int, v: int, k: int, j: int,
                split: bool) -> dict:
    replicas = world // p
    rows = placement(kind, p, v)
    S = len(rows)
    lay = _layout(rank, p, replicas, rows)
    tie_rows = sorted({rows[0], rows[-1]})  # E: the first and the last chunk
    groups = build_groups(lay, [tie_rows], timeout=timedelta(seconds=TIMEOUT_S))
    m, batch = 3, 12 * replicas

    ref, x, y, ref_loss = toy_reference(batch, layers=S - 2)
    chain = ToyChain(layers=S - 2)
    modules = {c: ToyStage(chain, c, c + 1) for c in lay.chunks}
    tied = []
    if len(tie_rows) > 1 and lay.stage in tie_rows:
        tied = [TiedParameter(0, chain.E, counted=lay.stage == tie_rows[0])]
    us = all_units(m, k, j)
    train = lower(global_order(S, us, warm=min(len(us), S), split=split), rows)
    evals: dict[int, dict[int, list[Action]]] = {}

    def eval_schedule(m_):
        if m_ not in evals:
            evals[m_] = lower([Action(c, Kind.FORWARD, mb, 0) for mb in range(m_)
                               for c in range(S)], rows)
        return evals[m_][lay.stage]

    ex = PipelineExecutor(
        modules, lay, groups, num_microbatches=m, startup_slices=k, drain_slices=j,
        train_schedule=lambda *_: train[lay.stage], eval_schedule=eval_schedule,
        inputs_fn=lambda b: b[0], flatten_inputs=lambda a: (a,),
        unflatten_outputs=lambda outs: outs[0], loss_fn=toy_loss,
        device=torch.device("cpu"), tied=tied,
    )
    per = batch // replicas
    shard = tuple(t[lay.replica * per:(lay.replica + 1) * per] for t in (x, y))
    loss = ex.train_step(shard)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-7)
    assert ex.trace == train[lay.stage]
    refs = dict(ref.named_parameters())
    held = {"E"} if {0, S - 1} & set(lay.chunks) else set()
    held |= {f"l{c}" for c in lay.chunks if 0 < c < S - 1}
    for name, param in chain.named_parameters():
        if name.split(".")[0] in held:
            torch.testing.assert_close(param.grad, refs[name].grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda s, n=name: f"{n}: {s}")
    assert_norm_and_eval_match(ex, ref, x, y, shard)
    ex.close()
    destroy_groups(groups)
    return {"chunks": lay.chunks}


@pytest.mark.parametrize(
    ("kind", "p", "v", "replicas", "k", "j", "split"),
    [("v", 2, 2, 1, 2, 2, False), ("v", 2, 2, 1, 2, 1, True), ("looped", 2, 2, 1, 1, 2, False),
     ("looped", 2, 3, 1, 2, 1, True), ("v", 4, 2, 1, 2, 2, True), ("looped", 4, 2, 1, 1, 1, False),
     ("v", 2, 2, 2, 2, 2, True), ("looped", 2, 2, 2, 2, 1, False)],
    ids=["v-2x1", "v-2x1-split", "looped-2x1", "looped3-2x1-split", "v-4x1-split", "looped-4x1",
         "v-2x2-split", "looped-2x2"],
)
def test_several_chunks_per_rank_equal_single_process(gloo, kind, p, v, replicas, k, j, split):
    """Loss, every gradient (the tied E: one Parameter in two local chunks under V placement,
    a tie group across ranks under looped placement), the global norm and an eval step equal
    one process; the executed trace is the lowered list, with no transfer between chunks of
    one rank."""
    got = gloo(p * replicas).run(_chunk_case, kind, p, v, k, j, split)
    rows = placement(kind, p, v)
    for rank, rec in enumerate(got):
        row = rank // replicas
        assert rec["chunks"] == tuple(c for c in range(len(rows)) if rows[c] == row)


def test_executor_refuses_modules_that_do_not_match_the_chunks():
    lay = _layout(0, 1, 1, placement("looped", 1, 3))  # one rank, chunks 0, 1, 2
    chain = ToyChain(layers=1)
    kw = dict(num_microbatches=1, startup_slices=1, train_schedule=lambda *_: [],
              eval_schedule=lambda _: [], inputs_fn=lambda b: b[0],
              flatten_inputs=lambda a: (a,), unflatten_outputs=lambda o: o[0],
              loss_fn=toy_loss, device=torch.device("cpu"))
    with pytest.raises(PipelineRuntimeError, match=r"holds chunks \[0, 1, 2\].*one module"):
        PipelineExecutor(ToyStage(chain, 0, 1), lay, None, **kw)
    with pytest.raises(PipelineRuntimeError, match=r"modules for chunks \[0\]"):
        PipelineExecutor({0: ToyStage(chain, 0, 1)}, lay, None, **kw)


def test_one_rank_with_two_chunks_equals_the_model():
    """p = 1: every chunk local, every hand-off in memory; no process group at all."""
    rows = placement("looped", 1, 3)
    lay = _layout(0, 1, 1, rows)
    ref, x, y, _ = toy_reference(8, layers=1)
    chain = ToyChain(layers=1)
    us = all_units(2, 2, 1)
    train = lower(global_order(3, us, 2, split=True), rows)
    ex = PipelineExecutor(
        {c: ToyStage(chain, c, c + 1) for c in range(3)}, lay, None, num_microbatches=2,
        startup_slices=2, train_schedule=lambda *_: train[0], eval_schedule=lambda _: [],
        inputs_fn=lambda b: b[0], flatten_inputs=lambda a: (a,),
        unflatten_outputs=lambda o: o[0], loss_fn=toy_loss, device=torch.device("cpu"))
    loss = ex.train_step((x, y))
    torch.testing.assert_close(loss, toy_loss(ref(x), (x, y)).detach())
    assert not any(a.kind not in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT) for a in ex.trace)
    for (name, got), want in zip(chain.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=lambda s, n=name: f"{n}: {s}")
