"""``PipelineGradScaler``: alone it is ``torch.amp.GradScaler``; over gloo ranks an overflow on
one rank skips the step and backs off the scale on every rank, a rank without gradients too."""

from __future__ import annotations

import torch

from lightning_autopipe.runtime.scaler import PipelineGradScaler

SETTINGS = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 2}


def _train(scaler: torch.amp.GradScaler, grads: list[torch.Tensor | None]) -> tuple[list, list]:
    """Per step: set the (scaled) gradient, unscale, step, update; the scales and weights."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    scales, weights = [], []
    for g in grads:
        p.grad = None if g is None else g * scaler.get_scale()
        scaler.scale(torch.ones(()))  # where backward would start: the scale now exists
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        weights.append(p.detach().clone())
    return scales, weights


def test_alone_it_decides_as_torch_grad_scaler():
    grads = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([float("inf"), 0.0, 0.0]),
             torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, float("nan"), 1.0]),
             torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2.0, 0.0, -1.0])]
    ours = _train(PipelineGradScaler("cpu", **SETTINGS), grads)
    torch_s = _train(torch.amp.GradScaler("cpu", **SETTINGS), grads)
    assert ours[0] == torch_s[0] == [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0]
    for a, b in zip(ours[1], torch_s[1]):
        assert torch.equal(a, b)


def _case(rank: int, world: int, out: str) -> None:
    finite = torch.tensor([0.5, 0.5, 0.5])
    inf = torch.tensor([float("inf"), 0.0, 0.0])
    # step 1: only rank 1 overflows; step 3: rank 0 has no gradient at all, rank 1 overflows
    mine = [finite, inf if rank == 1 else finite, finite, None if rank == 0 else inf, finite]
    scaler = PipelineGradScaler("cpu", **SETTINGS)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    rows = []
    for g in mine:
        p.grad = None if g is None else g * scaler.get_scale()
        scaler.unscale_(opt)  # no scale() on this rank: the scale starts from init_scale
        scaler.step(opt)
        scaler.update()
        rows.append((scaler.local_found_inf, scaler.found_inf, scaler.get_scale(),
                     p.detach().clone()))
    torch.save(rows, f"{out}.{rank}")


def test_one_rank_overflowing_skips_the_step_on_every_rank(tmp_path, gloo):
    out = str(tmp_path / "rows")
    gloo(2).run(_case, out)
    rows = [torch.load(f"{out}.{r}") for r in range(2)]
    assert [r[0] for r in rows[0]] == [False, False, False, False, False]
    assert [r[0] for r in rows[1]] == [False, True, False, True, False]
    for rank in rows:
        assert [r[1] for r in rank] == [False, True, False, True, False]
        assert [r[2] for r in rank] == [1024.0, 512.0, 512.0, 256.0, 256.0]
        weights = [r[3] for r in rank]
        assert torch.equal(weights[1], weights[0])  # skipped on the flag of the other rank
        assert not torch.equal(weights[2], weights[1])
        assert torch.equal(weights[3], weights[2])
