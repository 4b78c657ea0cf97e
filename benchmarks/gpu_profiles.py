"""Profile the recipe models on one device; time a training step next to the 1-stage prediction.

    python benchmarks/gpu_profiles.py --out DIR [--cpu] [--models gpt2,bert_base,resnet50]
                                      [--precisions fp32,bf16] [--micro-batch N] [--budget-s S]

For each model of ``conf/model/<name>.yaml`` (GPT-2 124M, BERT-base, ResNet-50: the recipes'
sizes, read from the YAML without Hydra; dropout off, as export-traced models keep it) at its
recipe's batch per replica (``data.batch_size`` of ``conf/train_<task>.yaml``'s data config: the
micro-batch of a one-GPU run), and for each precision (``fp32``; ``bf16`` under
``torch.autocast``, as ``precision="bf16-mixed"`` runs):

* the model is traced and cut as the strategy does (``split_model`` of the recipe's task) and
  profiled on the device with its training loss on the last block
  (``profile_blocks``); the profile is written to ``DIR/profiles/<model>.<precision>.profile.json``
  with the device named in its ``device`` field;
* the simulator predicts a step of the 1-stage, 1-micro-batch plan on that device
  (``make_plan`` pinned, the profile on a one-device ``Cluster.local``);
* one training step of the whole traced model on the device is timed (median of ``--steps``
  after ``--warmup-steps``; CUDA events on a GPU): forward + loss + backward, the part the
  prediction covers, and the optimizer step (AdamW) next to it, with the peak memory.

Rows go to ``DIR/steps.json`` (rewritten after every row, so a run cut short keeps what it
measured) and ``DIR/steps.md``; the software and device to ``DIR/env.json``. ``--cpu`` runs the
same steps on the CPU at tiny sizes (2 layers of width 64, 32 tokens, 16-pixel images, 2
samples). Needs torch, Lightning and transformers (torchvision for ResNet); not Hydra.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_autopipe.cluster import Cluster  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner import make_plan  # noqa: E402
from lightning_autopipe.profile import Profile  # noqa: E402
from lightning_autopipe.runtime.profiler import profile_blocks  # noqa: E402
from lightning_autopipe.runtime.units import slice_batch  # noqa: E402
from lightning_autopipe.zoo import tasks  # noqa: E402
from lightning_autopipe.zoo.datasets import IGNORE_INDEX  # noqa: E402

COMMAND = "bash benchmarks/gpu_check.sh"
MODELS = ("gpt2", "bert_base", "resnet50")
PRECISIONS = ("fp32", "bf16")
#: schema of a model config -> (recipe config, network builder, task)
FAMILIES = {
    "gpt_schema": ("train_gpt", tasks.build_gpt, tasks.CausalLMTask),
    "bert_schema": ("train_bert", tasks.build_bert, tasks.MaskedLMTask),
    "resnet_schema": ("train_resnet", tasks.build_resnet, tasks.ImageClassificationTask),
}
#: --cpu: the same models at sizes two CPU cores profile in seconds
TINY = {
    "gpt_schema": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 264, "max_seq_len": 32},
    "bert_schema": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 264,
                    "max_seq_len": 32},
    "resnet_schema": {"image_size": 16, "num_classes": 10},
}
TINY_BATCH = 2


def _yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def recipe_model(name: str, tiny: bool) -> tuple[str, dict[str, Any], int]:
    """``(schema, build_* arguments, recipe batch per replica)`` of ``conf/model/<name>.yaml``."""
    cfg = _yaml(ROOT / "conf" / "model" / f"{name}.yaml")
    schema = next(d for d in cfg.pop("defaults", []) if isinstance(d, str) and d in FAMILIES)
    recipe = _yaml(ROOT / "conf" / f"{FAMILIES[schema][0]}.yaml")
    data = next(d["data"] for d in recipe["defaults"] if isinstance(d, dict) and "data" in d)
    batch = int(_yaml(ROOT / "conf" / "data" / f"{data}.yaml")["batch_size"])
    if "dropout" in cfg:
        cfg["dropout"] = 0.0
    if tiny:
        cfg.update(TINY[schema])
        batch = TINY_BATCH
    return schema, cfg, batch


def build(schema: str, cfg: dict[str, Any], batch: int, seed: int = 0) -> tuple[Any, tuple]:
    """The recipe's task around the network, and one training batch of ``batch`` samples."""
    _, builder, task_cls = FAMILIES[schema]
    torch.manual_seed(seed)
    net = builder(**cfg)
    g = torch.Generator().manual_seed(seed)
    if schema == "resnet_schema":
        size = int(cfg["image_size"])
        task = task_cls(net, image_size=size)
        images = torch.randn(batch, 3, size, size, generator=g)
        return task, (images, torch.randint(0, int(cfg["num_classes"]), (batch,), generator=g))
    seq, vocab = int(cfg["max_seq_len"]), int(cfg["vocab_size"])
    task = task_cls(net, seq_len=seq)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if schema == "gpt_schema":
        return task, (ids, torch.randint(0, vocab, (batch, seq), generator=g))
    masked = torch.rand(batch, seq, generator=g) < 0.15
    masked[:, 0] = True  # every sample carries some loss
    labels = torch.where(masked, torch.randint(0, vocab, (batch, seq), generator=g), IGNORE_INDEX)
    return task, (ids, labels)


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stamp(device: torch.device) -> Any:
    """A point on ``device``'s stream: a recorded CUDA event, or the host clock on a CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _ms(a: Any, b: Any) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()}, {torch.get_num_threads()} threads"


def device_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def measure_profile(
    blocks: Any, task: Any, batch: tuple, device: torch.device, precision: str, name: str,
    repeats: int,
) -> Profile:
    """The strategy's profile of ``blocks`` on ``device``: the loss on the last block."""
    size = int(batch[0].shape[0])
    on_dev = tuple(t.to(device) for t in batch)

    def loss(outputs: tuple[Any, ...], n: int) -> torch.Tensor:
        part = slice_batch(on_dev, 0, n, size)
        return task.pipeline_loss(blocks.unflatten_outputs(outputs), part)

    with _autocast(device, precision):
        prof = profile_blocks(
            blocks, (batch[0],), device=str(device), warmup=1, repeats=repeats, model_name=name,
            loss_fn=loss,
        )
    prof.device = f"{device_name(device)} ({device}, {precision})"
    return prof


def predict(profile: Profile, device: torch.device, batch: int) -> tuple[float, int]:
    """``(step ms, peak bytes)`` the simulator predicts for the 1-stage, 1-micro-batch plan."""
    cluster = Cluster.local(1, device_name="measured", memory_gb=device_memory_gb(device))
    plan = make_plan(
        profile, cluster, batch, num_stages=1, replicas=1, num_microbatches=1,
        startup_slices=1, drain_slices=1, memory_check=False,
    )
    return plan.iteration_ms, int(max(plan.peak_memory_bytes.values(), default=0))


def time_step(
    blocks: Any, task: Any, batch: tuple, device: torch.device, precision: str, steps: int,
    warmup: int = 2,
) -> dict[str, Any]:
    """Median ms of forward + loss + backward and of the optimizer step of the whole traced
    model as one stage on ``device``, and the peak memory those steps allocated (CUDA only)."""
    stage = copy.deepcopy(blocks.stage(0, len(blocks))).to(device)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    inputs = [t.to(device) for t in blocks.flatten_inputs((batch[0],))]
    on_dev = tuple(t.to(device) for t in batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compute, update = [], []
    for r in range(warmup + steps):
        opt.zero_grad(set_to_none=True)
        _sync(device)
        start = _stamp(device)
        with _autocast(device, precision):
            loss = task.pipeline_loss(blocks.unflatten_outputs(stage(*inputs)), on_dev)
        loss.backward()
        mid = _stamp(device)
        opt.step()
        end = _stamp(device)
        _sync(device)
        if r >= warmup:
            compute.append(_ms(start, mid))
            update.append(_ms(mid, end))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "forward_backward_ms": statistics.median(compute),
        "optimizer_ms": statistics.median(update),
        "peak_bytes": peak,
        "loss": float(loss.detach().float()),
    }


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "device": device_name(device), "device_index": str(device)}
    for mod in ("lightning", "transformers", "torchvision"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["memory_gb"] = round(device_memory_gb(device), 1)
    return env


def table(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        "# Recipe models on one device: measured step vs the simulator's 1-stage prediction",
        "",
        f"Reproduce: `{COMMAND}` (on a CPU: `{COMMAND} --cpu`, tiny sizes)",
        "",
        f"Device: {env['device']}; torch {env['torch']}, CUDA {env.get('cuda')}. `F+B ms` is one "
        "forward + loss + backward of the whole traced model (median), `predicted` the "
        "simulator's step of the 1-stage, 1-micro-batch plan from the profile taken just "
        "before; `opt ms` the AdamW step next to it; peak memory as allocated by torch vs "
        "predicted (weights, gradients, optimizer state, activations).",
        "",
        "| model | precision | micro-batch | blocks | F+B ms | predicted ms | measured/pred "
        "| opt ms | samples/s | peak GiB | pred. GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['precision']} | | | {r['skipped']} | | | | | | |")
            continue
        step = r["forward_backward_ms"] + r["optimizer_ms"]
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] is not None else ""
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['micro_batch']} | {r['blocks']} | "
            f"{r['forward_backward_ms']:.1f} | {r['predicted_ms']:.1f} | "
            f"{r['forward_backward_ms'] / r['predicted_ms']:.3f} | {r['optimizer_ms']:.1f} | "
            f"{r['micro_batch'] / step * 1e3:.1f} | {peak} | "
            f"{r['predicted_peak_bytes'] / 2**30:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _write(out: Path, rows: list[dict[str, Any]], env: dict[str, Any]) -> None:
    (out / "steps.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    (out / "steps.md").write_text(table(rows, env))


def run(args: argparse.Namespace) -> int:
    device = torch.device("cpu" if args.cpu else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --cpu", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "profiles").mkdir(parents=True, exist_ok=True)
    env = environment(device)
    (out / "env.json").write_text(json.dumps(env, indent=1))
    print(json.dumps(env))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        schema, cfg, batch = recipe_model(name, args.cpu)
        batch = args.micro_batch or batch
        if args.budget_s and time.perf_counter() - t0 > args.budget_s:
            rows += [{"model": name, "precision": p, "skipped": "out of time"}
                     for p in args.precisions.split(",")]
            _write(out, rows, env)
            continue
        try:
            task, data = build(schema, cfg, batch)
        except ImportError as exc:  # e.g. no torchvision on the machine
            rows += [{"model": name, "precision": p, "skipped": f"cannot build: {exc}"}
                     for p in args.precisions.split(",")]
            _write(out, rows, env)
            continue
        start = time.perf_counter()
        blocks = split_model(task, (data[0][: min(2, batch)],))
        traced_s = time.perf_counter() - start
        print(f"{name}: {len(blocks)} blocks traced by {blocks.tracer} in {traced_s:.1f} s",
              flush=True)
        for precision in args.precisions.split(","):
            if args.budget_s and time.perf_counter() - t0 > args.budget_s:
                rows.append({"model": name, "precision": precision, "skipped": "out of time"})
                _write(out, rows, env)
                continue
            start = time.perf_counter()
            prof = measure_profile(blocks, task, data, device, precision, name, args.repeats)
            path = out / "profiles" / f"{name}.{precision}.profile.json"
            prof.save(path)
            predicted, predicted_peak = predict(prof, device, batch)
            timed = time_step(
                blocks, task, data, device, precision, args.steps, args.warmup_steps
            )
            row = {
                "model": name, "precision": precision, "device": prof.device,
                "micro_batch": batch, "blocks": len(blocks), "tracer": blocks.tracer,
                "traced_s": traced_s, "profile": str(path.relative_to(out)),
                "profile_sum_ms": prof.total_ms,
                "predicted_ms": predicted, "predicted_peak_bytes": predicted_peak, **timed,
                "seconds": time.perf_counter() - start,
            }
            rows.append(row)
            _write(out, rows, env)
            print(f"{name} {precision}: F+B {row['forward_backward_ms']:.1f} ms measured, "
                  f"{predicted:.1f} predicted (x{row['forward_backward_ms'] / predicted:.3f}); "
                  f"optimizer {row['optimizer_ms']:.1f} ms; {row['seconds']:.0f} s", flush=True)
        del task, blocks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _write(out, rows, env)
    print(table(rows, env))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for profiles/, steps.json/md, env")
    ap.add_argument("--cpu", action="store_true", help="the same steps on the CPU, tiny sizes")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default=",".join(MODELS), help="names under conf/model/")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="fp32 and/or bf16")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per block (median)")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (median)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new model or precision after this many seconds")
    args = ap.parse_args(argv)
    bad = set(args.precisions.split(",")) - set(PRECISIONS)
    if bad:
        ap.error(f"unknown precision {sorted(bad)}; use {', '.join(PRECISIONS)}")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
