"""Inline initialisation (``nn.Parameter(torch.zeros(T, D))`` in ``__init__``) on the meta device.

The model is built as ``configure_model`` builds it (inside the strategy's
``tensor_init_context``); each stage is then materialised on its own, as each rank does, for
1, 2 and 4 stages. The reference is the same build materialised whole from the same seed, and
the inline code itself (zeros stay zeros, ones times three are threes).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopipe import AutoPipeStrategy
from lightning_autopipe.graph import split_model
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime.materialize import Materializer
from lightning_autopipe.runtime.pipeline import build_local_pipeline

T, D, V, BATCH = 8, 16, 32, 8
SEED = 1234


class InlineGPT(nn.Module):
    """GPT-style code with its positions and gains made inline, as nanoGPT-like code does."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(T, D))  # inline: no initialiser writes it
        self.gain = nn.Parameter(torch.ones(D).mul_(3))  # inline, in place
        self.noise = nn.Parameter(torch.randn(D) * 0.02)  # inline, random
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.wte(ids) + self.pos + self.noise
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.gain
        return self.head(h)

    def pipeline_loss(self, outputs, batch):
        return F.cross_entropy(outputs.reshape(-1, V), batch[1].reshape(-1))


def _configure_model() -> InlineGPT:
    with AutoPipeStrategy().tensor_init_context():  # what configure_model runs under
        return InlineGPT()


def _example() -> tuple[torch.Tensor, ...]:
    return (torch.zeros(2, T, dtype=torch.long),)


def _whole() -> dict[str, torch.Tensor]:
    model = _configure_model()
    Materializer(model, SEED).materialize(list(model.parameters()), torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cuts(n: int, stages: int) -> list[int]:
    return [round(i * n / stages) for i in range(stages + 1)]


def test_inline_parameters_materialise_as_the_inline_code_makes_them():
    assert next(_configure_model().parameters()).device.type == "meta"
    want = _whole()
    assert torch.equal(want["pos"], torch.zeros(T, D))  # zeros stay zeros
    assert torch.equal(want["gain"], torch.full((D,), 3.0))
    assert 0.005 < float(want["noise"].std()) < 0.05  # randn * 0.02, drawn
    assert 0.0 < float(want["blocks.0.weight"].abs().max()) <= D ** -0.5  # reset_parameters
    with torch.random.fork_rng():
        torch.manual_seed(0)
        other = _configure_model()
        Materializer(other, SEED + 1).materialize(list(other.parameters()),
                                                  torch.device("cpu"))
    assert not torch.equal(other.noise.detach(), want["noise"])  # the seed decides the draw


def test_the_same_weights_under_1_2_and_4_stages():
    want = _whole()
    for stages in (1, 2, 4):
        gathered: dict[str, torch.Tensor] = {}
        for s in range(stages):  # each "rank" builds, traces and materialises its stage only
            model = _configure_model()
            blocks = split_model(model, _example())
            cuts = _cuts(len(blocks), stages)
            stage = blocks.stage(cuts[s], cuts[s + 1])
            Materializer(model, SEED).materialize(list(stage.parameters()),
                                                  torch.device("cpu"))
            names = stage.param_names
            for key, value in stage.state_dict().items():
                gathered[names.get(key, key)] = value.detach().clone()
            assert any(p.device.type == "meta" for p in model.parameters()) or stages == 1
        assert set(gathered) == set(want), stages
        for name, value in gathered.items():
            assert torch.equal(value, want[name]), (stages, name)


def test_the_inline_initialised_model_trains_as_its_one_process_reference():
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, V, (BATCH, T + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    model = _configure_model()
    n = len(split_model(_configure_model(), _example()))
    plan = Plan("given", BATCH, 2, 1, [StagePlan((0, n), ["local:0"])])
    with torch.random.fork_rng():
        torch.manual_seed(SEED)  # the run's seed: rank 0's torch.initial_seed()
        pipe = build_local_pipeline(model, _example(), BATCH, AutoPipeOptions(plan=plan),
                                    rank=0, world_size=1, device=torch.device("cpu"),
                                    broadcast=lambda obj, src: obj, measure_memory=False)
    assert torch.equal(model.pos.detach(), torch.zeros(T, D))
    reference = InlineGPT()
    reference.load_state_dict(_whole())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses, ref_losses = [], []
    for step in range(4):
        losses.append(float(pipe.executor.train_step(batch(step), step=step)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ids, targets = batch(step)
        loss = reference.pipeline_loss(reference(ids), (ids, targets))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(float(loss.detach()))
    pipe.executor.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    assert losses[-1] < losses[0]
    assert not torch.equal(model.pos.detach(), torch.zeros(T, D))  # the positions trained
