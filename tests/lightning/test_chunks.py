"""Several chunks per rank (ZB-V, interleaved 1F1B) through the Trainer vs one process.

The cases (tests/lightning/_chunks_run.py) train the tiny GPT with its LM head tied to its
embedding under a fixed plan of two chunks per rank, with startup and drain slices and Adam,
at 2x1, 4x1 and 2x2 (pipeline depth x data-parallel replicas), and once under
``schedule="auto"`` on a cluster where the planner must choose chunks; here one process
trains the same model on the same global batches. Losses and every rank's weights must agree to the
suite's float32 tolerance for sums taken in another order. In V placement the tied weight
lives on rank 0 in both the first and the last chunk, as one Parameter; in looped placement
the first and the last chunk are on different ranks and the tie group sums the copies.
``zbvside-2x1`` adds a branch that a middle chunk starts from the token ids (as an
encoder-decoder's decoder embedding): its weights meet no input path in that chunk, and their
gradients must still be computed (``B`` does it).
"""

from __future__ import annotations

import pytest
import torch

from lightning_autopipe.graph import split_model
from lightning_autopipe.planner.generators import build_schedule
from lightning_autopipe.planner.plan import Plan
from lightning_autopipe.planner.schedule import lower_communication
from tests.lightning import _chunks_run as R

# weights in float64 (see _chunks_run.build_net): sums in another order only; the step loss is
# summed in float32 by the executor
RTOL, ATOL, LOSS_RTOL = 1e-9, 1e-11, 1e-6
CASES = {2: ["zbv-2x1", "interleaved-2x1", "auto-2x1", "zbvside-2x1"],
         4: ["zbv-4x1", "interleaved-4x1", "zbv-2x2", "interleaved-2x2", "resume-4x1"]}

MODULE = "tests.lightning._chunks_run"
WORLD_CASES = {w: [f"{MODULE}:{c}" for c in cases] for w, cases in CASES.items()}


def _global_batches(ranks: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the replicas' batches joined in replica order (the first chunk's ranks)."""
    firsts = sorted((r for r in ranks if 0 in r["chunks"]), key=lambda r: r["replica"])
    return [tuple(torch.cat([r["rows"][i]["batch"][j] for r in firsts]) for j in (0, 1))
            for i in range(len(firsts[0]["rows"]))]


def _reference(batches, net=None, opt=None):
    """One process, Adam, the whole global batch per step: losses and weights per step."""
    net = net if net is not None else R.build_net()
    opt = opt if opt is not None else torch.optim.Adam(net.parameters(), lr=R.LR, eps=R.EPS)
    losses, states = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = R.loss_fn(net(x), (x, y))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        states.append({f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()})
    return losses, states, net, opt


def _check(ranks: list[dict], losses, states) -> None:
    plan = Plan.from_json(ranks[0]["plan"])
    lowered = lower_communication(build_schedule(plan))
    held: set[str] = set()
    for rec in ranks:
        rows = rec["rows"]
        torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]),
                                   torch.tensor(losses), rtol=LOSS_RTOL, atol=0)
        assert rec["trace"] == [str(a) for a in lowered[rec["stage"]]]
        state = rows[-1]["state"]
        assert state, "the rank holds no weights"
        held |= set(state)
        for name, value in state.items():
            torch.testing.assert_close(value, states[-1][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name, r=rec["stage"]: f"row {r} {n}: {s}")
    assert held == set(states[-1])  # together the ranks hold the whole model


@pytest.fixture(scope="module")
def zbv2(worlds):
    return worlds.results(2, MODULE, "zbv-2x1", weights_only=False)


@pytest.mark.parametrize("case", [c for w in CASES.values() for c in w if c != "resume-4x1"])
def test_chunks_per_rank_through_the_trainer_equal_one_process(worlds, case):
    world = 2 if case in CASES[2] else 4
    ranks = worlds.results(world, MODULE, case, weights_only=False)
    plan = Plan.from_json(ranks[0]["plan"])
    if case.startswith("auto"):  # the planner chose chunks, and kept the pinned micro-batches
        assert plan.chunks_per_rank > 1, plan.search_notes
        assert (plan.num_ranks, plan.num_microbatches) == (2, R.AUTO_MICROBATCHES)
    else:
        assert plan.chunks_per_rank == 2
    assert sorted(c for r in ranks if r["replica"] == 0 for c in r["chunks"]) == list(
        range(plan.num_stages))
    if plan.placement == "v":  # the tied embedding and head: both on the first row
        assert all({0, plan.num_stages - 1} <= set(r["chunks"]) for r in ranks
                   if r["stage"] == 0)
    side = case.startswith("zbvside")
    if side:  # the side branch starts inside a middle chunk (one whose inputs take gradients)
        names = split_model(R.build_net(side=True),
                            (torch.zeros(2, R.SEQ, dtype=torch.long),)).names
        first = next(i for i, n in enumerate(names) if n.startswith("side"))
        assert plan.cuts[1] <= first < plan.cuts[-2], (plan.cuts, names)
    losses, states, _, _ = _reference(_global_batches(ranks), R.build_net(side=side))
    _check(ranks, losses, states)


def test_a_checkpoint_of_chunks_loads_into_the_plain_model(worlds, zbv2):
    """Rank 0's checkpoint holds the whole model under its own names: the plain model loads it
    strictly and has the trained weights."""
    path = worlds.folder(2, MODULE) / "zbv-2x1.ckpt"
    saved = torch.load(path, weights_only=True)
    net = R.build_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in saved["state_dict"].items()},
                        strict=True)
    assert net.lm_head.weight is net.wte.weight
    _, states, _, _ = _reference(_global_batches(zbv2))
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, states[-1][f"net.{name}"], rtol=RTOL, atol=ATOL)


def test_training_resumes_in_another_chunked_layout(worlds, zbv2):
    """ZB-V on 2 ranks, then from its checkpoint interleaved 1F1B on 4 (Adam's state moved by
    name): the same as one process that never stopped."""
    resumed = worlds.results(4, MODULE, "resume-4x1", weights_only=False)
    _, _, net, opt = _reference(_global_batches(zbv2))
    losses, states, _, _ = _reference(_global_batches(resumed), net, opt)
    assert len(losses) == R.RESUME_STEPS
    _check(resumed, losses, states)
