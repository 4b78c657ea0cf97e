"""Executor and groups against a single-process reference, on real gloo processes (no Lightning)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from datetime import timedelta

import pytest
import torch

from lightning_autopipe.errors import ClusterError, PipelineRuntimeError, PlanError
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.schedule import Action, Kind, lower_communication, units
from lightning_autopipe.runtime.comm import decode_header, encode_header
from lightning_autopipe.runtime.executor import PipelineExecutor, TiedParameter
from lightning_autopipe.runtime.groups import build_groups, destroy_groups, layout_for_rank
from lightning_autopipe.runtime.units import fit_units, slice_batch, unit_bounds
from tests._gloo import TIMEOUT_S
from tests.runtime._toy import (
    ToyChain,
    ToyStage,
    assert_norm_and_eval_match,
    toy_loss,
    toy_reference,
)


def _plan(
    cuts: list[int], replicas: int, m: int = 3, k: int = 2, batch: int = 12, j: int = 1,
    replica_batches: list[int] | None = None,
) -> Plan:
    devs = iter(f"cpu0:{i}" for i in range(100))
    stages = [
        StagePlan(blocks=(a, b), devices=[next(devs) for _ in range(replicas)])
        for a, b in zip(cuts, cuts[1:])
    ]
    return Plan(
        planner="pinned",
        global_batch_size=batch,
        num_microbatches=m,
        startup_slices=k,
        stages=stages,
        drain_slices=j,
        replica_batches=replica_batches or [],
    )


def _one_f_one_b(num_stages: int, m: int, k: int, j: int = 1) -> dict[int, list[Action]]:
    from lightning_autopipe.planner.schedule import one_f_one_b

    return one_f_one_b(num_stages, m, k, j)


def _forward_only(num_stages: int, m: int) -> dict[int, list[Action]]:
    try:
        from lightning_autopipe.planner.schedule import forward_only
    except ImportError:
        return {s: [Action(s, Kind.FORWARD, mb, 0) for mb in range(m)] for s in range(num_stages)}
    return forward_only(num_stages, m)


# ------------------------------------------------------------------------------ pure helpers
def test_unit_bounds_cover_the_batch_in_pipeline_order():
    b = unit_bounds(10, 3, 2)
    assert list(b) == units(3, 2)
    assert b == {(0, 0): (0, 2), (0, 1): (2, 4), (1, 0): (4, 7), (2, 0): (7, 10)}
    b = unit_bounds(10, 3, 2, 2)  # the last micro-batch (3 samples) in 2 drain slices
    assert list(b) == units(3, 2, 2)
    assert b == {(0, 0): (0, 2), (0, 1): (2, 4), (1, 0): (4, 7), (2, 0): (7, 9), (2, 1): (9, 10)}
    assert unit_bounds(4, 1, 2, 3) == {(0, 0): (0, 2), (0, 1): (2, 4)}  # one micro-batch: k only


def test_fit_units_shrinks_only_for_short_batches():
    assert fit_units(12, 3, 2) == (3, 2, 1)
    assert fit_units(12, 3, 2, 4) == (3, 2, 4)
    assert fit_units(2, 3, 2, 2) == (2, 1, 1)
    assert fit_units(4, 3, 4, 4) == (3, 2, 1)
    with pytest.raises(PipelineRuntimeError):
        fit_units(0, 3, 2)


def test_slice_batch_cuts_only_batch_tensors():
    x, y, w = torch.arange(6).view(6, 1), torch.arange(6), torch.ones(3)
    got = slice_batch({"x": x, "pair": (y, w), "name": "a"}, 2, 4, 6)
    assert torch.equal(got["x"], x[2:4])
    assert torch.equal(got["pair"][0], y[2:4])
    assert got["pair"][1] is w
    assert got["name"] == "a"


def test_slice_batch_keeps_namedtuples_and_mapping_types():
    Pair = namedtuple("Pair", ["x", "y"])
    x, y, w = torch.arange(6).view(6, 1), torch.arange(6), torch.ones(3)
    got = slice_batch(Pair(x, OrderedDict(y=y, w=w)), 1, 3, 6)
    assert type(got) is Pair
    assert type(got.y) is OrderedDict
    assert torch.equal(got.x, x[1:3])
    assert torch.equal(got.y["y"], y[1:3])
    assert got.y["w"] is w


def test_header_round_trip():
    a = torch.zeros(2, 3, requires_grad=True)
    b = torch.zeros(4, dtype=torch.bool)
    specs = decode_header(encode_header([a, None, b]))
    assert specs == [(torch.float32, (2, 3), True), None, (torch.bool, (4,), False)]


def test_layout_grid_and_neighbours():
    plan = _plan([0, 1, 3, 4], replicas=2)
    names = [f"cpu0:{i}" for i in range(6)]
    lay = layout_for_rank(plan, names, 3)
    assert lay.grid == ((0, 1), (2, 3), (4, 5))
    assert (lay.stage, lay.replica, lay.prev_rank, lay.next_rank) == (1, 1, 1, 5)
    assert lay.dp_ranks == (2, 3)
    assert lay.pipeline_ranks == (1, 3, 5)
    with pytest.raises(PlanError, match="launch exactly 6"):
        layout_for_rank(plan, [*names, "cpu0:6"], 0)
    with pytest.raises(ClusterError, match="not among the launched"):
        layout_for_rank(plan, ["gpu:0", *names[1:]], 0)


# ---------------------------------------------------------------------------- multi-process
# The cases run on the shared gloo worlds of tests/_gloo.py (the ``gloo`` fixture).


def _toy_executor(stage, lay, groups, m, k, j, gen, tied=(), replica_batches=()
                  ) -> PipelineExecutor:
    """An executor of the toy chain's ``stage`` under schedule generator ``gen``."""
    S = lay.num_stages
    return PipelineExecutor(
        stage,
        lay,
        groups,
        num_microbatches=m,
        startup_slices=k,
        drain_slices=j,
        train_schedule=lambda m_, k_, j_: lower_communication(gen(S, m_, k_, j_))[lay.stage],
        eval_schedule=lambda m_: lower_communication(_forward_only(S, m_))[lay.stage],
        inputs_fn=lambda b: b[0],
        flatten_inputs=lambda a: (a,),
        unflatten_outputs=lambda outs: outs[0],
        loss_fn=toy_loss,
        device=torch.device("cpu"),
        tied=tied,
        replica_batches=replica_batches,
    )


def _check_rank(
    rank: int, world: int, cuts: list[int], replicas: int, k: int, drain: int,
    schedule: str = "1f1b", shares: list[int] | None = None,
) -> None:
    from lightning_autopipe.planner.generators import SCHEDULES

    gen = SCHEDULES[schedule]
    m, batch = 3, 12 * replicas
    plan = _plan(cuts, replicas, m=m, k=k, batch=batch, j=drain, replica_batches=shares)
    lay = layout_for_rank(plan, [f"cpu0:{i}" for i in range(world)], rank)
    S = lay.num_stages
    groups = build_groups(lay, [(0, S - 1)], timeout=timedelta(seconds=TIMEOUT_S))

    ref, x, y, ref_loss = toy_reference(batch)
    chain = ToyChain()
    i, j = plan.stages[lay.stage].blocks
    stage = ToyStage(chain, i, j)
    tied = [TiedParameter(0, chain.E, counted=lay.is_first)] if (i == 0 or j == 4) else []
    ex = _toy_executor(stage, lay, groups, m, k, drain, gen, tied, plan.replica_batches)
    per = batch // replicas  # what each replica loads (uneven shares: dealt by the executor)
    shard = (
        x[lay.replica * per : (lay.replica + 1) * per],
        y[lay.replica * per : (lay.replica + 1) * per],
    )
    asks = world - 1  # the one rank that reports a nonzero flag
    ex.report = lambda: (float(rank), float(rank == asks))
    loss = ex.train_step(shard)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-7)
    _check_notes(ex.notes, plan, world, lay, asks)
    mine = plan.replica_batch(lay.replica)
    assert ex.trace == lower_communication(gen(S, *fit_units(mine, m, k, drain)))[lay.stage]
    used = {"E"} if (i == 0 or j == 4) else set()
    used |= {f"l{b}" for b in (1, 2) if i <= b < j}
    for name, p in chain.named_parameters():
        if name.split(".")[0] in used:
            torch.testing.assert_close(
                p.grad,
                dict(ref.named_parameters())[name].grad,
                rtol=1e-5,
                atol=1e-7,
                msg=lambda s, n=name: f"{n}: {s}",
            )
    # global norm over the pipeline == single-process norm (tied E counted once)
    for p in chain.parameters():  # unused copies on this stage must not count
        if p.grad is not None and p.grad.abs().sum() == 0:
            p.grad = None
    assert_norm_and_eval_match(ex, ref, x, y, shard)
    if shares:  # an epoch's short last batch, 2 per replica: dealt in the plan's proportions
        short = [slice(r * per, r * per + 2) for r in range(replicas)]
        xj, yj = torch.cat([x[s] for s in short]), torch.cat([y[s] for s in short])
        got = ex.train_step((x[short[lay.replica]], y[short[lay.replica]]))
        with torch.no_grad():
            torch.testing.assert_close(got, toy_loss(ref(xj), (xj, yj)), rtol=1e-5, atol=1e-7)
    ex.close()
    destroy_groups(groups)


def _check_notes(notes: dict, plan, world: int, lay, asks: int) -> None:
    """What each rank reported with the step's loss (its global rank, and a flag raised by
    rank ``asks`` alone): every rank of this replica's pipeline is heard, by global rank, each
    value the mean over the replicas of that stage's ranks, so the flag reaches every rank."""
    everyone = [layout_for_rank(plan, [f"cpu0:{i}" for i in range(world)], r)
                for r in range(world)]
    assert sorted(notes) == [r.rank for r in everyone if r.replica == lay.replica]
    for r, (value, flag) in notes.items():
        stage = [x.rank for x in everyone if x.stage == everyone[r].stage]
        assert value == pytest.approx(sum(stage) / len(stage))
        assert (flag > 0) == (asks in stage), (r, flag)


@pytest.mark.parametrize(
    ("cuts", "replicas", "k", "j", "schedule", "shares"),
    [([0, 2, 4], 1, 2, 1, "1f1b", None), ([0, 1, 2, 3, 4], 1, 1, 2, "1f1b", None),
     ([0, 1, 4], 2, 3, 4, "1f1b", None), ([0, 2, 4], 1, 1, 3, "1f1b", None),
     ([0, 2, 4], 1, 2, 2, "zb-h1", None), ([0, 2, 4], 1, 1, 1, "zb-h1", None),
     ([0, 1, 2, 3, 4], 1, 2, 1, "zb-h1", None), ([0, 1, 4], 2, 3, 2, "zb-h1", None),
     ([0, 4], 2, 1, 1, "1f1b", [17, 7]), ([0, 1, 4], 2, 2, 1, "zb-h1", [6, 18]),
     ([0, 4], 4, 1, 1, "1f1b", [20, 4, 16, 8])],
    ids=["2x1-sliced", "4x1-drain", "2x2-both-ends", "2x1-drain", "zb-2x1-sliced",
         "zb-2x1-plain", "zb-4x1-sliced", "zb-2x2-both-ends", "1x2-uneven", "zb-2x2-uneven",
         "1x4-uneven"],
)
def test_pipeline_gradients_equal_single_process(gloo, cuts, replicas, k, j, schedule, shares):
    """Against one process on the whole global batch; with uneven replica batches the
    replicas load even batches and the executor deals each its share."""
    world = (len(cuts) - 1) * replicas
    gloo(world).run(_check_rank, cuts, replicas, k, j, schedule, shares)


def _clip_float64(rank: int, world: int) -> list[float]:
    """2 stages of the float64 toy chain: the step loss and ``clip_grad_norm_`` over the
    pipeline against one process's, to float64 precision (the tied E counted once)."""
    from lightning_autopipe.planner.generators import SCHEDULES

    plan = _plan([0, 2, 4], 1, m=2, k=1, batch=8, j=1)
    lay = layout_for_rank(plan, [f"cpu0:{i}" for i in range(world)], rank)
    groups = build_groups(lay, [(0, 1)], timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    ref = ToyChain().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    ref_loss = toy_loss(ref(x), (x, y))
    ref_loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.manual_seed(0)
    chain = ToyChain().double()
    i, j = plan.stages[lay.stage].blocks
    ex = _toy_executor(ToyStage(chain, i, j), lay, groups, 2, 1, 1, SCHEDULES["1f1b"],
                       [TiedParameter(0, chain.E, counted=lay.is_first)])
    loss = ex.train_step((x, y))  # the step loss of a float64 model stays float64
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    for p in chain.parameters():  # the other stage's layers: no gradient here
        if p.grad is not None and not p.grad.any():
            p.grad = None
    got = ex.clip_grad_norm_(0.01)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0, check_dtype=False)
    own = {f"l{b}" for b in (1, 2) if i <= b < j} | {"E"}
    for name, p in chain.named_parameters():
        if name.split(".")[0] in own:
            torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad,
                                       rtol=1e-12, atol=1e-15, msg=lambda s, n=name: f"{n}: {s}")
    ex.close()
    destroy_groups(groups)
    return float(got)


def test_a_float64_models_loss_and_clipping_equal_torch_to_float64_precision(gloo):
    norms = gloo(2).run(_clip_float64)
    assert norms[0] == norms[1]


def _release_case(
    rank: int, stages: int, m: int, k: int, j: int, schedule: str
) -> list[tuple[str, int]]:
    """Each rank's receives, sends and the waits on its sends over two steps."""
    import lightning_autopipe.runtime.comm as ex_mod  # the stage runner sends through it
    from lightning_autopipe.planner.generators import SCHEDULES

    events: list[tuple[str, int]] = []

    class Tracked:
        def __init__(self, work, name, unit):
            self.work, self.name, self.unit = work, name, unit

        def wait(self):
            events.append((self.name, self.unit))
            return self.work.wait()

    def send(tensors, dst, tag, device, ack=0):
        works = ex_mod_send(tensors, dst, tag, device, ack)
        kind = "b" if tag % 2 else "f"
        events.extend([("send_" + kind, tag // 2)] * len(works))  # per work: header, tensors
        return [(Tracked(w, "wait_" + kind, tag // 2), buf) for w, buf in works]

    def recv(src, tag, device):
        got = ex_mod_recv(src, tag, device)
        events.append(("grad" if tag % 2 else "act", tag // 2))
        return got

    ex_mod_send, ex_mod_recv = ex_mod.send_tensors, ex_mod.recv_tensors
    ex_mod.send_tensors, ex_mod.recv_tensors = send, recv
    gen = SCHEDULES[schedule]
    try:
        cuts = [round(4 * i / stages) for i in range(stages + 1)]
        plan = _plan(cuts, 1, m=m, k=k, batch=8, j=j)
        lay = layout_for_rank(plan, [f"cpu0:{i}" for i in range(stages)], rank)
        groups = build_groups(lay, [], timeout=timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)
        a, b = plan.stages[lay.stage].blocks
        ex = _toy_executor(ToyStage(ToyChain(), a, b), lay, groups, m, k, j, gen)
        ex.train_step((torch.randn(8, 6), torch.randn(8, 6)))
        ex.train_step((torch.randn(8, 6), torch.randn(8, 6)))  # counts start afresh each step
        ex.close()
        destroy_groups(groups)
    finally:
        ex_mod.send_tensors, ex_mod.recv_tensors = ex_mod_send, ex_mod_recv
    return events


def _waits_after(events: list[tuple[str, int]], kind: str, wait: str) -> dict[int, set[int]]:
    """For each ``kind`` receive: the units whose ``wait`` sends were waited right after it."""
    got: dict[int, set[int]] = {}
    for pos, (k, unit) in enumerate(events):
        if k != kind:
            continue
        waits = got.setdefault(unit, set())
        for later, later_unit in events[pos + 1 :]:
            if not later.startswith("wait"):
                break
            if later == wait:
                waits.add(later_unit)
    return got


def _release_events(gloo, stages, m, k, j, schedule):
    steps = []
    for events in gloo(stages).run(_release_case, m, k, j, schedule):
        half = len(events) // 2
        assert events[:half] == events[half:]  # both steps alike
        steps.append(events[:half])
    return steps


def _check_waited_once(events):
    for kind in ("f", "b"):
        sent = sorted(u for k, u in events if k == "send_" + kind)
        assert sorted(u for k, u in events if k == "wait_" + kind) == sent


def test_sends_are_released_as_soon_as_they_are_proven_received(gloo):
    """1F1B's memory bound needs a unit's sent tensors freed by its backward, but a send holds
    its buffer until waited. Rank 0 (first of 2 stages, m = 4) waits each activation send when
    that unit's gradient arrives; rank 1 waits each gradient send when rank 0's next activation
    message acknowledges it: in 1F1B rank 0 sends unit 2 after receiving gradient 0 and unit 3
    after gradient 1, so gradient sends 0 and 1 are released there; 2 and 3 at the end."""
    first, last = _release_events(gloo, 2, 4, 1, 1, "1f1b")
    assert _waits_after(first, "grad", "wait_f") == {u: {u} for u in range(4)}
    assert _waits_after(last, "act", "wait_b") == {0: set(), 1: set(), 2: {0}, 3: {1}}
    for events in (first, last):
        _check_waited_once(events)


@pytest.mark.parametrize(
    ("stages", "m", "k", "j", "schedule"), [(3, 3, 2, 2, "1f1b"), (3, 4, 1, 1, "gpipe")]
)
def test_every_send_is_waited_once_and_only_when_proven_received(gloo, stages, m, k, j,
                                                                 schedule):
    """A middle stage both acknowledges and releases. Activation sends are waited right after
    their unit's gradient on every schedule; gradient sends are released early by 1F1B (units
    in order on both sides) and only at the end of the step by GPipe (reversed backwards)."""
    ranks = _release_events(gloo, stages, m, k, j, schedule)
    for rank, events in enumerate(ranks):
        _check_waited_once(events)
        grads = _waits_after(events, "grad", "wait_f")
        assert all(got == {u} for u, got in grads.items()), (rank, grads)
        last_recv = max(i for i, (kind, _) in enumerate(events) if kind in ("act", "grad"))
        early = [u for i, (kind, u) in enumerate(events) if kind == "wait_b" and i < last_recv]
        if rank == 0:
            assert not early  # the first stage sends no gradients
        elif schedule == "gpipe":
            assert not early, (rank, events)
        else:
            assert early, (rank, events)  # released before the step's last receive
