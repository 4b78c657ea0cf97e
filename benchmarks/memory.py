"""Memory benchmark: a GPT whose fp32 weights exceed 2 GB on 4 gloo ranks, 4 stages.

    .venv/bin/python benchmarks/memory.py [--out FILE] [--d-model 2048] [--layers 11]

The GPT (``TinyGPT``: vocab 8192, seq 16, d_model 2048, 11 layers, tied embeddings) has 571 M
parameters, 2.28 GB (2.13 GiB) of fp32 weights. Three setups, one after another, each on 4
fresh gloo ranks (one thread each), each rank's peak resident set growth measured from just
before the model is built to the end of the pipeline build (``VmHWM`` after a reset through
``/proc/self/clear_refs``):

* **eager (whole model)**: every rank builds the whole model for real, traces it and keeps its
  stage (a given 4-stage plan, so nothing is profiled);
* **meta, given plan**: the model is built under ``deferred_init()`` (what
  ``configure_model`` / ``trainer.init_module()`` get from the strategy); each rank
  materialises only its stage;
* **meta, planned**: the same, but the plan is made from every rank's block-by-block profile
  (one block materialised at a time), 4 stages pinned; then two Adam steps train, and each
  rank's measured peak (tensor bytes: parameters, gradients, Adam state, saved activations)
  stands beside the plan's prediction.

Profiling the eagerly built model as the strategy does would hold the gradients of every block
as well (about twice the model per rank, 18 GB on this 23 GB machine's 4 ranks): that row is
left out here; ``tests/runtime/test_meta_lightning.py`` measures it on a smaller GPT.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._publish import publish  # noqa: E402
from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.options import AutoPipeOptions  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402
from lightning_autopipe.runtime.materialize import (  # noqa: E402
    _give_back_host_memory,
    deferred_init,
)
from lightning_autopipe.runtime.memory import reset_resident_peak, resident_peak_bytes  # noqa: E402
from lightning_autopipe.runtime.pipeline import build_local_pipeline  # noqa: E402
from lightning_autopipe.zoo.models import TinyGPT  # noqa: E402

WORLD = 4
BATCH = 4  # one replica's batch (the only replica): 4 micro-batches of 1 sample
SEQ = 16
VOCAB = 8192
COMMAND = ".venv/bin/python benchmarks/memory.py"
GiB = 2**30
SETUPS = ("eager", "meta-given", "meta-planned")


class GPTTask(nn.Module):
    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        self.net = TinyGPT(vocab=VOCAB, seq_len=SEQ, d_model=d_model, n_layers=layers,
                           n_heads=16)

    def forward(self, x):
        return self.net(x)

    def pipeline_loss(self, logits, batch):
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def _bcast(obj: Any, src: int) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _given_plan(layers: int) -> Plan:
    """Blocks: embeddings, (attention, MLP) per layer, LM head: the layers split evenly (the
    first stages take one more when they do not divide)."""
    per = [layers // WORLD + (1 if s < layers % WORLD else 0) for s in range(WORLD)]
    cuts, at = [0], 1
    for n in per[:-1]:
        at += 2 * n
        cuts.append(at)
    cuts.append(2 * layers + 2)
    names = [d.name for d in Cluster.local(WORLD).devices]
    return Plan("given", BATCH, 4, 1, [StagePlan((cuts[s], cuts[s + 1]), [names[s]])
                                       for s in range(WORLD)])


def _rank(rank: int, port: int, setup: str, d_model: int, layers: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=1800))
    try:
        torch.manual_seed(0)
        x, y = _data(0)
        base = reset_resident_peak()
        t0 = time.perf_counter()
        if setup == "eager":
            module = GPTTask(d_model, layers)
        else:
            with deferred_init():
                module = GPTTask(d_model, layers)
        if setup == "meta-planned":
            options = AutoPipeOptions(cluster=Cluster.local(WORLD, memory_gb=64),
                                      num_stages=WORLD, num_microbatches=4, startup_slices=1,
                                      drain_slices=1, schedule="1f1b", profile_repeats=1,
                                      timeout=1800)
        else:
            options = AutoPipeOptions(plan=_given_plan(layers), cluster=Cluster.local(WORLD),
                                      timeout=1800)
        pipe = build_local_pipeline(module, (x[:1],), BATCH, options, rank=rank,
                                    world_size=WORLD, device=torch.device("cpu"),
                                    broadcast=_bcast, example_batch=(x[:1], y[:1]))
        record: dict[str, Any] = {
            "setup_growth": resident_peak_bytes() - base,
            "setup_s": time.perf_counter() - t0,
            "stage": pipe.layout.stage,
            "blocks": list(pipe.plan.stages[pipe.layout.stage].blocks),
            "stage_bytes": sum(p.numel() * p.element_size() for p in pipe.stage.parameters()),
            "whole_bytes": sum(p.numel() * p.element_size() for p in _shapes(d_model, layers)),
        }
        if setup == "meta-planned":
            opt = torch.optim.Adam(module.parameters(), lr=1e-4)
            losses = []
            for step in range(2):
                losses.append(float(pipe.executor.train_step(_data(step), step=step)))
                opt.step()
                opt.zero_grad(set_to_none=True)
            record.update(losses=losses, readings=pipe.executor.memory.readings,
                          train_growth=resident_peak_bytes() - base, plan=pipe.plan.to_json())
        torch.save(record, Path(out) / f"{setup}.rank{rank}.pt")
        pipe.executor.close()
        del pipe, module
        _give_back_host_memory()
    finally:
        dist.destroy_process_group()


def _shapes(d_model: int, layers: int) -> list[nn.Parameter]:
    with deferred_init():
        return list(GPTTask(d_model, layers).parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(res: dict[str, list[dict]], d_model: int, layers: int) -> str:
    whole = res["eager"][0]["whole_bytes"]
    lines = [
        f"`{COMMAND}` (4 gloo ranks x 1 thread on this CPU machine; TinyGPT vocab {VOCAB}, "
        f"seq {SEQ}, d_model {d_model}, {layers} layers, tied embeddings: "
        f"{whole / 4:.3g} parameters, {whole / 1e9:.2f} GB = {whole / GiB:.2f} GiB fp32; "
        f"replica batch {BATCH} = 4 micro-batches of 1, Adam)",
        "",
        "Peak resident set growth per rank, from just before the model is built to the end of "
        "the pipeline build (VmHWM), GiB:",
        "",
        "| rank | stage | blocks | stage weights | eager (whole model) | meta, given plan | "
        "meta, planned | eager / meta given | setup s (eager / meta given / meta planned) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in range(WORLD):
        e, g, p = (res[s][r] for s in SETUPS)
        lines.append(
            f"| {r} | {g['stage']} | {g['blocks']} | {g['stage_bytes'] / GiB:.3f} | "
            f"{e['setup_growth'] / GiB:.3f} | {g['setup_growth'] / GiB:.3f} | "
            f"{p['setup_growth'] / GiB:.3f} | {e['setup_growth'] / g['setup_growth']:.2f}x | "
            f"{e['setup_s']:.0f} / {g['setup_s']:.0f} / {p['setup_s']:.0f} |"
        )
    lines += [
        "",
        "Meta, planned: the plan's predicted peak per stage beside the measured one in training "
        "step 2 (tensor bytes held: parameters + gradients + Adam state + peak saved "
        "activations, counted by saved-tensor hooks), and the rank's resident set growth from "
        "before the build to the end of step 2, GiB:",
        "",
        "| rank | stage | blocks | predicted | measured | measured / predicted | params | grads "
        "| Adam state | activations (meas.) | RSS growth |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in range(WORLD):
        p = res["meta-planned"][r]
        x = next(x for x in p["readings"] if x.rank == r)
        lines.append(
            f"| {r} | {x.stage} | {p['blocks']} | {x.predicted / GiB:.3f} | "
            f"{x.measured / GiB:.3f} | {x.ratio:.3f} | {x.params / GiB:.3f} | "
            f"{x.grads / GiB:.3f} | {x.optimizer / GiB:.3f} | {x.activations / GiB:.4f} | "
            f"{p['train_growth'] / GiB:.3f} |"
        )
    p0 = res["meta-planned"][0]
    lines += ["", f"losses of the two steps: {', '.join(f'{v:.4f}' for v in p0['losses'])}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory.md")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=11)
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"autopipe-memory-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, list[dict]] = {}
    for setup in SETUPS:
        print(f"running {setup} ...", flush=True)
        mp.spawn(_rank, args=(_free_port(), setup, args.d_model, args.layers, str(work)),
                 nprocs=WORLD, join=True)
        res[setup] = [torch.load(work / f"{setup}.rank{r}.pt", weights_only=False)
                      for r in range(WORLD)]
    publish(_report(res, args.d_model, args.layers), args.out)


if __name__ == "__main__":
    main()
