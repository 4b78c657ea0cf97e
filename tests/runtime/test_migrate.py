"""In-memory migration between pipeline layouts equals one process across the switch.

Two gloo worlds (2 and 4 ranks) each run every case of theirs in turn
(:mod:`tests.runtime._migrate_world`): train a few steps under a layout, migrate, train on under
the next; every step's loss and the final weights, buffers and scaler scales must equal one
process training the same model on the same global batches (rtol 1e-5). A migration that lost
or mixed up any tensor, optimizer state, buffer or scaler state changes the weights after the
switch; one that copied a kept tensor or moved a name twice shows in the transfer statistics.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_autopipe.errors import PlanError
from lightning_autopipe.graph import split_model
from lightning_autopipe.runtime.migrate import StateLayout, plan_transfers, transfer_bytes
from lightning_autopipe.runtime.optim_state import named_optimizer_state
from lightning_autopipe.runtime.rebind import load_stage_tensors, rebind_optimizer, stage_tensors
from tests._gloo import forked_context
from tests._launch import free_port
from tests.runtime import _migrate_world as W
from tests.runtime._migrate_world import Case, Layout

# the world cases start ranks and assert nothing on time: they may run beside the launch lane
pytestmark = pytest.mark.ranks

RTOL, ATOL = 1e-5, 1e-6

CASES2 = [
    # stages move to other cuts, then the two stages swap ranks: everything moves but the tied
    # embedding / LM head, which both ranks hold (as wte.weight, lm_head.weight) and keep
    Case("gpt-adam-cuts-swap", "gpt", "adam",
         (Layout((0, 3, 7)), Layout((0, 5, 7)), Layout((0, 5, 7), reverse=True)),
         scheduler=True),
    # pipeline to data parallel: BatchNorm statistics and SGD momentum move with the layers;
    # and back: rank 1 (replica 1) holds the last layers' statistics of its own replica, and
    # takes replica 0's, which it now continues
    Case("cnn-bn-pp-to-dp", "cnn_bn", "sgd",
         (Layout((0, 3, 6)), Layout((0, 6), replicas=2), Layout((0, 3, 6)))),
    # loss scaling across two switches; an overflow after the first backs the scale off and
    # a growth interval of 2 makes the growth tracker count too
    Case("gpt-scaler-pp-dp-pp", "gpt", "sgd",
         (Layout((0, 2, 7)), Layout((0, 7), replicas=2), Layout((0, 4, 7))),
         steps=3, scaler=True, overflow_step=4),
    Case("bad-input", "gpt", "sgd", (Layout((0, 3, 7)), Layout((0, 5, 7))), steps=1,
         failure="bad-input"),
    Case("raise", "gpt", "sgd", (Layout((0, 5, 7)), Layout((0, 3, 7))), steps=1,
         failure="raise"),
    Case("die", "gpt", "sgd", (Layout((0, 3, 7)), Layout((0, 3, 7), reverse=True)), steps=1,
         failure="die"),  # last: it ends the world
]
CASES4 = [
    # 2 stages x 2 replicas to 4 stages and back to 2 x 2: the tied weight moves to new ranks
    Case("gpt-adam-2x2-4x1-2x2", "gpt", "adam",
         (Layout((0, 3, 7), replicas=2), Layout((0, 2, 4, 5, 7)), Layout((0, 4, 7), replicas=2))),
]


# ------------------------------------------------------------------------------ pure parts
def _layout(*ranks: tuple[str, ...], replicas: tuple[int, ...] | None = None) -> StateLayout:
    return StateLayout(tuple(ranks), replicas or (0,) * len(ranks))


def test_a_rank_moving_to_another_replica_takes_that_replicas_buffers():
    # data parallel to a pipeline: rank 1 holds everything, but as replica 1
    old = StateLayout((("w", "bn"), ("w", "bn")), (0, 1), frozenset({"bn"}))
    new = StateLayout((("w",), ("w", "bn")), (0, 0), frozenset({"bn"}))
    assert plan_transfers(old, new) == {(0, 1): ["bn"]}  # the weight is the same everywhere


def test_transfers_keep_what_a_rank_holds_and_take_each_name_from_one_holder():
    old = _layout(("a", "b"), ("a", "b"), ("c", "t"), ("c", "t"), replicas=(0, 1, 0, 1))
    new = _layout(("a",), ("b", "c"), ("c", "t"), ("a", "t"))
    moves = plan_transfers(old, new)
    # rank 1 keeps b, takes c from the first replica's holder; rank 3 takes a from rank 0
    assert moves == {(0, 3): ["a"], (2, 1): ["c"]}
    # a data-parallel replica takes from its own replica when it exists
    new2 = _layout(("c",), ("c",), ("a", "b"), ("a", "b"), replicas=(0, 1, 0, 1))
    assert plan_transfers(old, new2) == {(0, 2): ["a", "b"], (1, 3): ["a", "b"],
                                         (2, 0): ["c"], (3, 1): ["c"]}
    with pytest.raises(PlanError, match="no rank holds"):
        plan_transfers(old, _layout(("a", "z"), ("b",), ("c",), ("t",)))
    with pytest.raises(PlanError, match="keeps the ranks"):
        plan_transfers(old, _layout(("a", "b", "c", "t")))


def test_state_layout_names_a_tied_weight_once_on_every_stage():
    net = W.build("gpt")
    blocks = split_model(net, (W.batch("gpt", 0)[0][:2],))
    lay = StateLayout.from_plan(W.plan_of(Layout((0, 3, 7), reverse=True)), blocks,
                                ["cpu0:0", "cpu0:1"])
    assert "wte.weight" in lay.ranks[0]
    assert "wte.weight" in lay.ranks[1]
    assert all("lm_head.weight" not in r for r in lay.ranks)
    assert "ln_f.weight" in lay.ranks[0]
    assert "h.0.attn.qkv.weight" in lay.ranks[1]
    every = {n for n, _ in net.named_parameters()}
    assert set(lay.ranks[0]) | set(lay.ranks[1]) == every


def test_rebind_keeps_the_optimizer_and_continues_as_the_reference():
    """A live Adam (with a scheduler) moved from one half of a model to the other half with
    migrated state continues exactly as an Adam that held that half all along (after the
    switch only the second half gets gradients, on both sides)."""
    torch.manual_seed(0)
    ref_net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net.load_state_dict(ref_net.state_dict())
    ref_opt = torch.optim.Adam(ref_net.parameters(), lr=0.05)
    first = list(net[0].parameters())
    opt = torch.optim.Adam(first, lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    x, h = torch.randn(5, 4), torch.randn(5, 4)
    for _ in range(2):
        for o in (opt, ref_opt):
            o.zero_grad()
        ref_net(x).square().sum().backward()
        net(x).square().sum().backward()
        ref_opt.step(), opt.step(), sched.step(), ref_sched.step()
    names = {id(p): n for n, p in ref_net.named_parameters()}
    whole = named_optimizer_state(ref_opt, names)
    second = dict(net[1].named_parameters(prefix="1"))
    load_stage_tensors(net[1], {k.removeprefix("1."): v.detach().clone()
                                for k, v in ref_net[1].state_dict().items()})
    moved = {"state": copy.deepcopy({n: whole["state"][n] for n in second}),  # as if received
             "param_groups": [{**opt.state_dict()["param_groups"][0], "param_names":
                               list(second)}]}
    del moved["param_groups"][0]["params"]
    rebind_optimizer(opt, second, moved)
    assert opt.param_groups[0]["params"] == list(second.values())
    for _ in range(2):
        for o in (opt, ref_opt):
            o.zero_grad()
        ref_net[1](h).square().sum().backward()
        net[1](h).square().sum().backward()
        ref_opt.step(), opt.step(), sched.step(), ref_sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 * 0.5**4
    for (name, p), q in zip(ref_net[1].named_parameters(), net[1].parameters()):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=ATOL, msg=name)
    with pytest.raises(PlanError, match="does not hold"):
        rebind_optimizer(opt, {}, moved)


def test_rebind_keeps_the_optimizers_own_state_dtypes():
    """torch's ``load_state_dict`` casts state to the parameter's dtype; NAdam keeps its
    ``mu_product`` in float32 for a float64 model, and after a rebind it still does, so the
    run continues exactly as one process's."""
    torch.manual_seed(0)
    net = nn.Linear(4, 4).double()
    ref = copy.deepcopy(net)
    opt, ref_opt = (torch.optim.NAdam(m.parameters(), lr=0.01) for m in (net, ref))
    x = torch.randn(8, 4, dtype=torch.float64)

    def step(o, m):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()

    step(opt, net), step(ref_opt, ref)
    names = {id(p): n for n, p in net.named_parameters()}
    rebind_optimizer(opt, dict(net.named_parameters()),
                     copy.deepcopy(named_optimizer_state(opt, names)))
    assert opt.state[net.weight]["mu_product"].dtype == torch.float32
    for _ in range(5):
        step(opt, net), step(ref_opt, ref)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_stage_tensors_are_the_objects_and_loading_keeps_them():
    lin = nn.Linear(3, 2)
    got = stage_tensors(lin)
    assert got["weight"] is lin.weight
    w = lin.weight
    assert load_stage_tensors(lin, {"weight": torch.ones(2, 3), "bias": lin.bias}) == 1
    assert lin.weight is w
    assert torch.equal(w, torch.ones(2, 3))
    with pytest.raises(PlanError, match="shape"):
        load_stage_tensors(lin, {"weight": torch.ones(3, 3), "bias": lin.bias})


# ---------------------------------------------------------------------------- the worlds
def _launch(size: int, cases: list[Case], out: Path, died: dict[int, int]) -> dict:
    ctx = forked_context()
    port = free_port()
    procs = [ctx.Process(target=W.world, args=(r, size, port, str(out), cases))
             for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not alive, f"ranks {alive} hung"
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    assert codes == {r: died.get(r, 0) for r in range(size)}, codes
    results = {}
    for case in cases:
        files = [out / f"{case.name}.rank{r}.pt" for r in range(size)]
        results[case.name] = [torch.load(f, weights_only=False) if f.exists() else None
                              for f in files]
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    torch.set_num_threads(1)
    return _launch(2, CASES2, tmp_path_factory.mktemp("migrate2"), died={1: 17})


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    torch.set_num_threads(1)
    return _launch(4, CASES4, tmp_path_factory.mktemp("migrate4"), died={})


def _check_equal_to_one_process(case: Case, ranks: list[dict]) -> dict:
    ref = W.reference(case)
    for rec in ranks:
        assert rec is not None
        assert "crash" not in rec, rec["crash"]
        assert "error" not in rec, rec["error"]
        r = rec["rank"]
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]),
                                   rtol=RTOL, atol=ATOL, msg=lambda s, r=r: f"rank {r}: {s}")
        assert rec["scales"] == ref["scales"]
        want = ref["states"][rec["replica"]]
        assert rec["state"]
        for name, value in rec["state"].items():
            torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name, r=r: f"rank {r} {n}: {s}")
    return ref


@pytest.mark.parametrize("case", [c for c in CASES2 if c.failure is None], ids=lambda c: c.name)
def test_two_ranks_equal_one_process_across_switches(world2, case):
    _check_equal_to_one_process(case, world2[case.name])
    for rec in world2[case.name]:
        assert len(rec["stats"]) == len(case.layouts) - 1


def test_four_ranks_2x2_to_4x1_and_back_equal_one_process(world4):
    case = CASES4[0]
    ranks = world4[case.name]
    _check_equal_to_one_process(case, ranks)
    first = [rec["stats"][0] for rec in ranks]
    # 2x2 -> 4x1: ranks 0, 2 and 3 already hold their new stages; rank 1 (stage 0 of replica
    # 1 before, stage 1 now) takes block 3 from replica 0's holder (rank 2, not rank 3)
    assert [s.messages_sent for s in first] == [0, 0, 1, 0]
    assert [s.messages_received for s in first] == [0, 1, 0, 0]
    assert {s.total_bytes for s in first} == {sum(s.bytes_received for s in first)}
    assert sum(s.bytes_sent for s in first) == first[0].total_bytes


def test_what_moves_and_what_stays(world2):
    swap = [rec["stats"][1] for rec in world2["gpt-adam-cuts-swap"]]
    # swapping the stages moves every name but the tied weight, one message each way
    assert [s.names_kept for s in swap] == [1, 1]
    assert [(s.messages_sent, s.messages_received) for s in swap] == [(1, 1), (1, 1)]
    # the bytes predicted from the layouts are the bytes sent: Adam holds two tensors of each
    # parameter's size and a float32 step
    net = W.build("gpt")
    blocks = split_model(net, (W.batch("gpt", 0)[0][:2],))
    names = ["cpu0:0", "cpu0:1"]
    old, new = (StateLayout.from_plan(W.plan_of(lay), blocks, names)
                for lay in CASES2[0].layouts[1:])
    size = {n: 3 * p.numel() * p.element_size() + 4 for n, p in net.named_parameters()}
    predicted = transfer_bytes(plan_transfers(old, new), size)
    assert predicted == {(0, 1): swap[0].bytes_sent, (1, 0): swap[1].bytes_sent}
    assert swap[0].total_bytes == sum(predicted.values())
    to_pp = [rec["stats"][1] for rec in world2["gpt-scaler-pp-dp-pp"]]
    # from data parallel to a pipeline every rank already holds its stage: nothing travels
    assert [s.total_bytes for s in to_pp] == [0, 0]
    assert all(s.names_received == 0 for s in to_pp)


def test_a_rank_failing_mid_migration_stops_every_rank_with_its_error(world2):
    bad, raised, died = world2["bad-input"], world2["raise"], world2["die"]
    for rec in bad:
        assert rec["error"][0] == "PlanError"
        assert "rank 1" in rec["error"][1]
        assert "missing" in rec["error"][1]
    for rec in raised:
        assert rec["error"][0] == "PipelineRuntimeError"
        assert "rank 1 failed in assembling" in rec["error"][1]
        assert "injected failure while unpacking" in rec["error"][1]
    assert died[1] is None  # rank 1 died (exit code 17) before writing anything
    kind, text = died[0]["error"]
    assert kind == "PipelineRuntimeError"
    assert "rank 1" in text
    assert "died" in text
