"""Workers of tests/runtime/test_meta.py: pipelines of models built on the meta device.

Every rank builds the model under ``deferred_init()`` (no weights), builds its pipeline with
``build_local_pipeline`` on a real gloo group and writes what the test compares to
``OUT/<case>.rank<r>.pt``: its stage's initial tensors by original name, the losses of a few
Adam steps, which tensors it ever materialised, its memory reading.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.runtime import materialize as mat
from lightning_autopipe.runtime.groups import destroy_groups
from lightning_autopipe.runtime.pipeline import LocalPipeline, build_local_pipeline
from lightning_autopipe.zoo.models import TinyGPT
from tests.runtime import _cases as C

BATCH = 8  # one replica's batch
STEPS = 3
LR = 1e-2


class Task(nn.Module):
    """``net`` with the pipeline loss; ``net`` is built by ``build`` (deferred or not)."""

    def __init__(self, build: Callable[[], nn.Module], kind: str = "gpt") -> None:
        super().__init__()
        self.kind = kind
        self.net = build()

    def forward(self, x, attention_mask=None):
        if attention_mask is not None:
            return self.net(x, attention_mask)
        return self.net(x)

    def pipeline_inputs(self, batch):
        if self.kind == "hfbert":
            return {"x": batch[0], "attention_mask": batch[1]}
        return batch[0]

    def pipeline_loss(self, outputs, batch):
        return C.loss_fn(outputs, batch)


def gpt(d: int = 16, layers: int = 2, seq: int = C.SEQ) -> nn.Module:
    return TinyGPT(vocab=C.VOCAB, seq_len=seq, d_model=d, n_layers=layers, n_heads=2)


def build(kind: str, d: int = 16, layers: int = 2, seq: int = C.SEQ) -> nn.Module:
    """The test model of ``kind``: ``gpt``, or a model of ``tests.runtime._cases.build_net``."""
    if kind == "gpt":
        return gpt(d, layers, seq)
    return C.build_net(kind)


def deferred(kind: str, **sizes: Any) -> Task:
    with mat.deferred_init():
        return Task(lambda: build(kind, **sizes), kind)


def data(kind: str, num: int, seed: int = 7) -> tuple[torch.Tensor, ...]:
    return C.dataset(kind, num, seed)


def example(kind: str, batch: tuple[torch.Tensor, ...]) -> Any:
    if kind == "hfbert":
        return {"x": batch[0], "attention_mask": batch[1]}
    return (batch[0],)


def broadcast(obj: Any, src: int) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def given_plan(cuts: list[int], replicas: int, world: int, m: int = 2) -> Plan:
    """A fixed plan over the ``Cluster.local`` device names of ``world`` ranks."""
    names = [f"local:{i}" for i in range(world)]
    stages = [StagePlan((cuts[s], cuts[s + 1]), names[s * replicas:(s + 1) * replicas])
              for s in range(len(cuts) - 1)]
    return Plan("given", BATCH * replicas, m, 1, stages)


def pipeline(module: Task, kind: str, options: AutoPipeOptions, rank: int, world: int,
             **kw: Any) -> LocalPipeline:
    batch = data(kind, BATCH)
    return build_local_pipeline(
        module, example(kind, batch), BATCH, options, rank=rank, world_size=world,
        device=torch.device("cpu"), broadcast=broadcast, **kw,
    )


def stage_state(pipe: LocalPipeline) -> dict[str, torch.Tensor]:
    """This rank's stage tensors by original name (initial values, cloned)."""
    names = pipe.stage.param_names
    return {names[k]: v.detach().clone() for k, v in pipe.stage.state_dict().items()}


def train(pipe: LocalPipeline, module: Task, kind: str, steps: int = STEPS) -> list[float]:
    """Adam on this rank's stage; the replica's share of each step's global batch."""
    lay = pipe.layout
    opt = torch.optim.Adam(module.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        full = data(kind, BATCH * lay.num_replicas, seed=100 + step)
        lo = lay.replica * BATCH
        shard = tuple(t[lo:lo + BATCH] for t in full)
        losses.append(float(pipe.executor.train_step(shard, step=step)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def reference_losses(module: nn.Module, kind: str, replicas: int, steps: int = STEPS) -> list:
    """One process, whole global batch, the same Adam."""
    opt = torch.optim.Adam(module.parameters(), lr=LR)
    out = []
    for step in range(steps):
        full = data(kind, BATCH * replicas, seed=100 + step)
        inputs = example(kind, full)
        outputs = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
        loss = C.loss_fn(outputs, full)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def close(pipe: LocalPipeline) -> None:
    pipe.executor.close()
    if pipe.groups is not None:
        destroy_groups(pipe.groups)


def on_rank(rank: int, world: int, case: str, arg: Any) -> Any:
    """One rank of a shared gloo world (tests._gloo) running ``case``; what it found."""
    return CASES[case](rank, world, arg)


# --------------------------------------------------------------------------- the cases
def _recording(seen: list[str]) -> None:
    """Record the original names (every alias) of every tensor this process materialises."""
    real = mat.Materializer.materialize

    def materialize(self, tensors, device):
        tensors = list(tensors)
        seen.extend(tuple(self._names[id(t)]) for t in tensors if t.device.type == "meta")
        return real(self, tensors, device)

    mat.Materializer.materialize = materialize  # type: ignore[method-assign]


def _layouts(rank: int, world: int, arg: Any) -> dict[str, Any]:
    """Every layout of ``arg["layouts"]`` (cuts, replicas) with a given plan, the same seed:
    each rank's initial stage tensors and the names it materialised."""
    out: dict[str, Any] = {}
    seen: list[str] = []
    _recording(seen)
    for cuts, replicas in arg["layouts"]:
        seen.clear()
        torch.manual_seed(arg["seed"])
        module = deferred("gpt", **arg["sizes"])
        pipe = pipeline(module, "gpt", AutoPipeOptions(plan=given_plan(cuts, replicas, world)),
                        rank, world)
        out[f"{cuts}x{replicas}"] = {
            "state": stage_state(pipe),
            "materialized": list(seen),
            "stage": pipe.layout.stage,
            # every real parameter the module reaches is one of the stage's
            "only_stage_real": {id(p) for p in module.parameters() if p.device.type != "meta"}
            <= {id(p) for p in pipe.stage.parameters()},
        }
        close(pipe)
    return out


def _from_checkpoint(rank: int, world: int, arg: Any) -> dict[str, Any]:
    """Train from a consolidated file (memory-mapped) and, again, from a sharded directory."""
    from lightning_autopipe.checkpoint import ShardedModelState

    out: dict[str, Any] = {}
    asked: list[str] = []
    real = ShardedModelState.load_into

    def load_into(self, targets):
        asked.extend(targets)
        return real(self, targets)

    ShardedModelState.load_into = load_into  # type: ignore[method-assign]
    sources = {
        "consolidated": lambda: torch.load(arg["file"], mmap=True, weights_only=True),
        "sharded": lambda: ShardedModelState(arg["dir"], no_dist=True),
    }
    for name, source in sources.items():
        torch.manual_seed(999 + rank)  # the checkpoint, not the seed, decides the weights
        module = deferred("gpt")
        plan = given_plan(arg["cuts"], 1, world)
        pipe = pipeline(module, "gpt", AutoPipeOptions(plan=plan), rank, world,
                        initial_state=source())
        out[name] = {"state": stage_state(pipe), "losses": train(pipe, module, "gpt")}
        close(pipe)
    out["asked"] = asked
    out["local"] = sorted(stage_state_names(arg["cuts"], rank))
    return out


def stage_state_names(cuts: list[int], stage: int) -> set[str]:
    """Every original name (aliases of tied weights too) of stage ``stage``'s tensors, from a
    meta-device split (no weights)."""
    from lightning_autopipe.graph import split_model

    module = deferred("gpt")
    blocks = split_model(module, example("gpt", data("gpt", BATCH)))
    local = {id(t) for t in blocks.stage(cuts[stage], cuts[stage + 1]).state_dict(
        keep_vars=True).values()}
    return {n for n, t in module.state_dict(keep_vars=True).items() if id(t) in local}


def _hf(rank: int, world: int, arg: Any) -> dict[str, Any]:
    """Hugging Face GPT-2, BERT, Llama and ResNet from configs on the meta device: traced, split
    (planned on 2 stages), initialised by their own ``_init_weights``, trained 2 steps."""
    out: dict[str, Any] = {}
    for kind in HF_KINDS:
        torch.manual_seed(arg["seed"])
        module = deferred(kind)
        module.net.eval()  # export keeps train/eval; dropout is off in these configs anyway
        options = AutoPipeOptions(num_stages=2, num_microbatches=2, startup_slices=1,
                                  drain_slices=1, profile_repeats=1, cluster=_local(world))
        pipe = pipeline(module, kind, options, rank, world)
        state = stage_state(pipe)
        out[kind] = {"state": state, "losses": train(pipe, module, kind, steps=2),
                     "stage": pipe.layout.stage, "tracer": "export"}
        close(pipe)
    return out


#: the Hugging Face models of the ``hf`` case
HF_KINDS = ("hfgpt", "hfbert", "hfllama", "hfresnet")


def _local(world: int) -> Any:
    from lightning_autopipe.cluster import Cluster

    return Cluster.local(world)


def _memory(rank: int, world: int, arg: Any) -> dict[str, Any]:
    """Plan on 2 stages from the ranks' block-by-block profiles, train 2 Adam steps: the
    memory reading beside the prediction, and the most parameter bytes ever materialised."""
    from lightning_autopipe.runtime import profiler

    held: list[int] = []
    real = profiler._time_isolated

    def timing(run, *a, **kw):
        held.append(sum(p.numel() * p.element_size() for p in module.parameters()
                        if p.device.type != "meta"))
        return real(run, *a, **kw)

    profiler._time_isolated = timing
    torch.manual_seed(0)
    module = deferred("gpt", **arg["sizes"])
    options = AutoPipeOptions(num_stages=2, num_microbatches=2, startup_slices=1,
                              drain_slices=1, profile_repeats=1, cluster=_local(world),
                              schedule="1f1b")
    pipe = pipeline(module, "gpt", options, rank, world)
    blocks = pipe.profile.blocks
    train(pipe, module, "gpt", steps=2)
    result = {
        "readings": pipe.executor.memory.readings,
        "held_while_profiling": held,
        "largest_block": max(b.param_bytes for b in blocks),
        "plan": pipe.plan.to_json(),
        "profile": pipe.profile.to_json(),
    }
    close(pipe)
    return result


def _recompute(rank: int, world: int, arg: Any) -> dict[str, Any]:
    """A given plan whose stages recompute (chosen by the planner under a tight memory): the
    losses and the gradients of the first step."""
    torch.manual_seed(0)
    module = Task(lambda: build("gpt", **arg["sizes"]))  # eager: compared to itself unsplit
    plan = Plan.from_json(arg["plan"])
    pipe = pipeline(module, "gpt", AutoPipeOptions(plan=plan, cluster=arg["cluster"]),
                    rank, world)
    losses = train(pipe, module, "gpt")
    result = {"losses": losses, "stage": pipe.layout.stage,
              "recomputed": type(pipe.executor.stage).__name__}
    close(pipe)
    return result


CASES: dict[str, Callable[[int, int, Any], Any]] = {
    "layouts": _layouts,
    "checkpoint": _from_checkpoint,
    "hf": _hf,
    "memory": _memory,
    "recompute": _recompute,
}
