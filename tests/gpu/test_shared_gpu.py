"""Two pipeline ranks sharing one GPU over gloo train as one process does; their checkpoint
loads into a CPU model.

NCCL refuses two ranks on one device, so the two processes talk through gloo, whose
send/recv move host memory: activations and gradients are staged through the CPU
(``runtime/comm.py``) while both stages compute on ``cuda:0``. Two SGD steps of a 2-stage plan
(micro-batch 0 in two startup slices, the last in two drain slices, the tied embedding summed
across the stages) must give the losses and weights of plain single-process training on the
same device, and the consolidated checkpoint the ranks write must load strictly into the model
on the CPU with those weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._launch import free_port, init_gloo
from tests.gpu._common import Model, batch, close

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"
WORLD, REPLICA_BATCH, STEPS, LR = 2, 8, 2, 0.1




def _broadcast(obj, src: int):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _rank(rank: int, port: int, out: str, device: str) -> None:
    """One rank: build its stage from a pinned 2-stage plan, train, write its part."""
    from lightning_autopipe.checkpoint import PipelineCheckpoint
    from lightning_autopipe.graph import split_model
    from lightning_autopipe.options import AutoPipeOptions
    from lightning_autopipe.planner.plan import Plan, StagePlan
    from lightning_autopipe.runtime.comm import transport_device
    from lightning_autopipe.runtime.groups import destroy_groups
    from lightning_autopipe.runtime.pipeline import build_local_pipeline

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    init_gloo(rank, WORLD, port, timeout_s=60)
    try:
        dev = torch.device(device)
        x, y = batch(REPLICA_BATCH * STEPS)
        module = Model()
        param_order = [name for name, _ in module.named_parameters()]
        state_order = list(module.state_dict())
        n = len(split_model(Model(), (x[:2],)))
        plan = Plan(
            planner="manual",
            global_batch_size=REPLICA_BATCH,
            num_microbatches=4,
            startup_slices=2,
            drain_slices=2,
            stages=[StagePlan((0, n // 2), ["local:0"]), StagePlan((n // 2, n), ["local:1"])],
        )
        pipe = build_local_pipeline(
            module,
            (x[:2],),
            REPLICA_BATCH,
            AutoPipeOptions(plan=plan, timeout=60),
            rank=rank,
            world_size=WORLD,
            device=dev,
            broadcast=_broadcast,
            backend="gloo",
        )
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            part = slice(step * REPLICA_BATCH, (step + 1) * REPLICA_BATCH)
            opt.zero_grad()
            loss = pipe.executor.train_step((x[part].to(dev), y[part].to(dev)), step=step)
            losses.append(loss.detach().cpu())
            opt.step()
        checkpoint = PipelineCheckpoint(pipe.layout, param_order, state_order)
        state = checkpoint.model_state(module)  # collective: rank 0 gets the whole model
        record = {
            "losses": torch.stack(losses),
            "stage_devices": sorted({str(p.device) for p in pipe.stage.parameters()}),
            "transport": str(transport_device(dist.get_backend(), dev)),
            "trace": [str(a) for a in pipe.executor.trace],
        }
        torch.save(record, f"{out}.rank{rank}")
        if rank == 0:
            torch.save(state, f"{out}.ckpt")
        pipe.executor.close()
        if pipe.groups is not None:
            destroy_groups(pipe.groups)
    finally:
        dist.destroy_process_group()


def _reference(device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same steps in one process: whole batch, plain forward, loss and backward."""
    model = Model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch(REPLICA_BATCH * STEPS)
    losses = []
    for step in range(STEPS):
        part = slice(step * REPLICA_BATCH, (step + 1) * REPLICA_BATCH)
        xb, yb = x[part].to(device), y[part].to(device)
        opt.zero_grad()
        loss = model.pipeline_loss(model(xb), (xb, yb))
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    return torch.stack(losses), {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    out = str(Path(tmp_path_factory.mktemp("shared")) / "run")
    mp.spawn(_rank, args=(free_port(), out, DEVICE), nprocs=WORLD, join=True)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(WORLD)]
    return {"ranks": ranks, "ckpt": f"{out}.ckpt", "reference": _reference(torch.device(DEVICE))}


def test_two_ranks_sharing_one_gpu_over_gloo_equal_one_process(shared):
    device = torch.device(DEVICE)
    ref_losses, _ = shared["reference"]
    for r, rec in enumerate(shared["ranks"]):
        # both stages computed on the GPU; their messages travelled through host memory
        assert rec["stage_devices"] == [str(device)], rec["stage_devices"]
        assert rec["transport"] == "cpu"
        close(rec["losses"], ref_losses, f"rank {r} losses")
    sliced = [a for a in shared["ranks"][0]["trace"] if a.startswith("0F0.")]
    assert len(sliced) == 2  # micro-batch 0 ran as its two startup slices


def test_a_checkpoint_written_from_gpu_stages_loads_strictly_into_a_cpu_model(shared):
    _, ref_state = shared["reference"]
    saved = torch.load(shared["ckpt"])
    assert list(saved) == list(Model().state_dict())  # every key, in the model's order
    assert {str(v.device) for v in saved.values()} == {"cpu"}
    model = Model()
    model.load_state_dict(saved, strict=True)
    for name, value in model.state_dict().items():
        close(value, ref_state[name], f"checkpointed {name}")
