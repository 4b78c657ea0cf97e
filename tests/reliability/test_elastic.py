"""Elastic training under torchrun: lose a node, re-plan on the survivors, take the node back.

Two torchrun agents on this machine stand for two nodes (``AUTOPIPE_HOST`` tells them apart)
in one c10d rendezvous, ``--nnodes=1:2 --nproc-per-node=2 --max-restarts=3``. One scenario
runs three worlds (``_elastic_run.py`` says how the markers drive it):

1. 4 ranks (2 stages x 2 replicas) train steps 1-5; node-b is SIGKILLed (agent and workers) as
   step 6 starts. The last checkpoint is step 4.
2. node-a's agent restarts its workers: 2 ranks plan 2 stages x 1 replica, resume from step 4
   (steps 5-6 replayed) and are killed half-way through writing step 8's checkpoint; node-b
   is started again.
3. Both nodes: 4 ranks resume from step 6, the last *complete* checkpoint (the half-written
   one never replaced it), and train steps 7-12.

The final weights equal one process that trained the same global batches in the same order,
and every step's samples, as the attempt whose work counted saw them, are that global batch,
striped over that attempt's replicas. The suite's heaviest test: ten Lightning worker
starts and three rendezvous rounds; 216 s on the 2-core machine under a load of about 10
(414 s under about 35). The other tests here run in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from lightning_autopipe.checkpoint import safe_load
from lightning_autopipe.errors import InputError, PlanError
from lightning_autopipe.lightning import elastic
from lightning_autopipe.lightning.sampler import ElasticDataLoader, check_width
from tests._launch import free_port, launch_env
from tests.reliability import _elastic_run as W
from tests.reliability import _task as T

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 900  # the whole scenario; each wait below is bounded by what is left of it
RDZV_CONF = "last_call_timeout=4,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=120"
# torchrun's agent, started by a Python that waits for a gate file after the imports.
_BOOT = (
    "import os, sys, time\n"
    "from torch.distributed.run import main\n"
    "end = time.monotonic() + 600\n"
    "while sys.argv[1] and not os.path.exists(sys.argv[1]):\n"
    "    if time.monotonic() > end: sys.exit('gate never opened')\n"
    "    time.sleep(0.05)\n"
    "main(sys.argv[2:])\n"
)


class _Scenario:
    """Starts and kills the two agents; every wait is bounded, every process ends."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.port = free_port()
        self.deadline = time.monotonic() + DEADLINE_S
        self.agents: list[tuple[str, subprocess.Popen]] = []
        self.killed: set[int] = set()

    def start(self, host: str, *, hosts_store: bool, gate: Path | None = None) -> subprocess.Popen:
        """torchrun's agent for ``host``; with ``gate``, imported first and joining only once
        the gate file exists (a node that comes back at a chosen moment, not seconds later)."""
        log = open(self.out / f"agent.{host}.{len(self.agents)}.log", "w")  # noqa: SIM115
        conf = f"{RDZV_CONF},is_host={'true' if hosts_store else 'false'}"
        cmd = [
            sys.executable, "-c", _BOOT, str(gate or ""), "--nnodes=1:2",
            "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=elastic-test",
            f"--rdzv-conf={conf}", "--max-restarts=3", "--monitor-interval=0.2",
            str(ROOT / "tests" / "reliability" / "_elastic_run.py"), str(self.out),
        ]
        # torch's shared rendezvous store keeps the first round's MASTER_ADDR, which a node
        # joining a later round waits for in vain (pytorch#135712): one store per round.
        env = launch_env({"AUTOPIPE_HOST": host, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.agents.append((host, proc))
        return proc

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def wait_for(self, what: str, ready) -> None:
        while not ready():
            if self.left() <= 0:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            dead = [h for h, p in self.agents if p.poll() not in (None, 0)
                    and p.pid not in self.killed]
            if dead:
                raise AssertionError(f"agent {dead} failed waiting for {what}\n{self.logs()}")
            time.sleep(0.1)

    def marker(self, name: str) -> dict | None:
        path = self.out / name
        return json.loads(path.read_text()) if path.exists() else None

    def kill_tree(self, proc: subprocess.Popen) -> None:
        """SIGKILL an agent and its workers (torchrun starts each in a session of its own)."""
        self.killed.add(proc.pid)
        try:
            family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        except psutil.NoSuchProcess:
            family = []
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def logs(self, tail: int = 5000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(self.out.glob("agent.*.log"))
        )

    def close(self) -> None:
        for _, proc in self.agents:
            if proc.poll() is None:
                self.kill_tree(proc)


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, plain torch: the same global batches in the same order, Adam."""
    net = T.build_net(0.0, 16, 0)
    opt = torch.optim.Adam(net.parameters(), lr=T.LR, eps=T.ADAM_EPS)
    for x, y in T.global_batches(steps, W.STEPS_PER_EPOCH, W.GLOBAL_BATCH):
        opt.zero_grad()
        T.lm_loss(net(x), (x, y)).backward()
        opt.step()
    return net.state_dict()


def _global_order(steps: int) -> list[list[int]]:
    """Dataset indices of every global step of an uninterrupted run (DistributedSampler's)."""
    ds = W.dataset()
    out: list[list[int]] = []
    epoch = 0
    while len(out) < steps:
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
        sampler.set_epoch(epoch)
        idx = list(sampler)
        out += [idx[t * W.GLOBAL_BATCH:(t + 1) * W.GLOBAL_BATCH] for t in range(W.STEPS_PER_EPOCH)]
        epoch += 1
    return out[:steps]


def _counted_batches(out: Path) -> dict[int, dict]:
    """Per step: the world that trained it last (its work is what counted) and, per replica,
    the samples it saw. Attempts are told apart by the step they resumed from."""
    rows = [json.loads(line) for f in out.glob("batches.*.jsonl")
            for line in f.read_text().splitlines()]
    counted: dict[int, dict] = {}
    for row in rows:
        best = counted.get(row["step"])
        if best is None or row["start"] > best["start"]:
            counted[row["step"]] = best = {"start": row["start"], "world": row["world"],
                                           "replicas": row["replicas"], "idx": {}}
        if row["start"] == best["start"]:
            best["idx"].setdefault(row["replica"], row["idx"])
    return counted


# ------------------------------------------------------------------ the sampler, in-process
def _train_steps(loader: ElasticDataLoader, epoch: int, steps: int) -> list[list[int]]:
    """What Lightning does with the loader for ``steps`` steps from ``epoch``: set the epoch,
    iterate, move to the next epoch at the end of one. Returns each step's indices."""
    seen: list[list[int]] = []
    while len(seen) < steps:
        loader.elastic.set_epoch(epoch)
        for batch in loader:
            seen.append(batch[2].tolist())
            if len(seen) == steps:
                return seen
        epoch += 1
    return seen


def test_global_batches_and_their_order_survive_changes_of_width():
    order = _global_order(W.STEPS)
    # widths 2 -> 1 -> 4 replicas, each world resuming the previous one's state
    plan = [(2, 4), (1, 2), (4, 6)]
    state, step = None, 0
    for replicas, steps in plan:
        views = []
        for r in range(replicas):  # one loader per replica, as every rank builds its own
            loader = ElasticDataLoader(W.dataset(), W.GLOBAL_BATCH, seed=0)
            if state is not None:
                loader.load_state_dict(state)
            loader.elastic.stripe(r, replicas)
            views.append((loader, _train_steps(loader, loader.elastic.epoch, steps)))
        for t in range(steps):
            for r, (_, seen) in enumerate(views):
                assert seen[t] == order[step + t][r::replicas], (step + t + 1, r)
        state = views[0][0].state_dict()
        assert all(v[0].state_dict() == state for v in views)  # every replica agrees
        step += steps
    assert (state["epoch"], state["batches"], step) == (2, 2, W.STEPS)


def test_at_one_width_the_batches_are_distributed_samplers():
    ds = W.dataset()
    for r in range(2):
        loader = ElasticDataLoader(ds, W.GLOBAL_BATCH, seed=3)
        loader.elastic.stripe(r, 2)
        loader.elastic.set_epoch(1)
        ref = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=r, seed=3)
        ref.set_epoch(1)
        plain = torch.utils.data.DataLoader(ds, batch_size=W.GLOBAL_BATCH // 2, sampler=ref)
        assert [b[2].tolist() for b in loader] == [b[2].tolist() for b in plain]


def test_a_resume_that_would_change_the_training_is_refused():
    saved = ElasticDataLoader(W.dataset(), W.GLOBAL_BATCH).state_dict()
    other = ElasticDataLoader(W.dataset(), 2 * W.GLOBAL_BATCH)
    with pytest.raises(InputError, match=r"global_batch_size 16 \(now 32\)"):
        other.load_state_dict(saved)
    with pytest.raises(PlanError, match=r"over 3 data-parallel replicas.*\(1, 2, 4, 8, 16\)"):
        check_width(16, 3)
    with pytest.raises(InputError, match="chooses batch_size"):
        ElasticDataLoader(W.dataset(), 16, batch_size=4)


def test_the_attempt_and_the_resume_are_read_from_torchrun_and_the_checkpoint():
    env = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_MAX_RESTARTS": "3", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "GROUP_WORLD_SIZE": "1"}
    attempt = elastic.ElasticAttempt.from_env(env)
    assert attempt == elastic.ElasticAttempt("job", 2, 3, 1, 2)
    assert elastic.launched_nodes(2, env) == 1  # the Trainer said 2 nodes; torchrun has 1
    assert elastic.launched_nodes(2, {}) == 2
    assert elastic.ElasticAttempt.from_env({}) is None

    class Layout:
        num_stages, num_replicas = 2, 1

    class Old:
        num_stages, num_replicas = 2, 2

    loader = ElasticDataLoader(W.dataset(), W.GLOBAL_BATCH)
    loader.elastic.position = 4
    checkpoint = {"global_step": 4, elastic.RECORD_KEY: elastic.checkpoint_record(4, 2, Old(), 4),
                  "loops": {"fit_loop": {"state_dict": {"combined_loader": [loader.state_dict()]}}}}
    facts = elastic.resume_facts(checkpoint)
    text = elastic.resume_message("last.ckpt", facts, {"step": 6, "world_size": 4}, 2, 1,
                                  Layout(), attempt)
    assert text.splitlines() == [
        "elastic: torchrun run 'job', attempt 3 (restart 2 of at most 3): 2 ranks on 1 node; "
        "resuming from last.ckpt at step 4",
        "  lost: steps 5-6 had started since that checkpoint (on 4 ranks); their work is "
        "replayed from step 5",
        "  world: written by 4 ranks on 2 node(s), 2 stages x 2 replicas; now 2 ranks on 1 "
        "node(s), 2 stages x 1 replica",
        "  data: epoch 0 continues after global batch 4 (global batch 16 samples, now 16 per "
        "replica)",
    ]
    quiet = elastic.resume_message("last.ckpt", elastic.resume_facts({"global_step": 4}),
                                   {"step": 4}, 2, 1, None, None)
    assert "lost: nothing" in quiet
    assert "an unrecorded world" in quiet


def test_the_elastic_recipe_preset_resumes_last_and_checkpoints_every_n_steps(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from _common import _checkpointing, run_dir_for

    from lightning_autopipe.zoo.config import compose

    cfg = compose("train_gpt", ["experiment=gpt_elastic", "checkpoint_every_n_steps=3"])
    assert (cfg.ckpt_path, cfg.data.global_batch_size) == ("last", 16)
    saver = _checkpointing(cfg, tmp_path)
    assert (saver.dirpath, saver._every_n_train_steps, saver.save_top_k, saver.save_last) == (
        str(tmp_path / "checkpoints"), 3, 0, True)
    assert _checkpointing(compose("train_gpt", []), tmp_path) is None
    loader = __import__("hydra").utils.instantiate(
        compose("train_gpt", ["experiment=gpt_elastic", "data.max_bytes=20000",
                              "model.max_seq_len=16"]).data).train_dataloader()
    assert isinstance(loader, ElasticDataLoader)
    assert loader.elastic.global_batch_size == 16
    # every worker of every torchrun attempt finds the same folder (and its checkpoints)
    monkeypatch.setenv("AUTOPIPE_RUN_DIR", "")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert run_dir_for("train_gpt", None) == Path("outputs/train_gpt/torchrun-job7")
    # without --rdzv-id every torchrun job is "none": one job on one node is its agent's (two
    # jobs one after the other shared a folder, the second resuming the first's checkpoint)
    monkeypatch.setenv("AUTOPIPE_RUN_DIR", "")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert run_dir_for("train_gpt", None) == Path(f"outputs/train_gpt/torchrun-none-{os.getppid()}")


# ----------------------------------------------------------------- the torchrun scenario
@pytest.mark.slow
@pytest.mark.launch
def test_node_loss_and_rejoin_train_like_one_process(tmp_path):
    run = _Scenario(tmp_path)
    began = time.monotonic()
    try:
        node_a = run.start("node-a", hosts_store=True)
        node_b = run.start("node-b", hosts_store=False)
        run.wait_for("node-b's pause at step 6", lambda: run.marker("kill_node.json"))
        run.kill_tree(node_b)  # node lost
        gate = tmp_path / "rejoin"
        node_b = run.start("node-b", hosts_store=False, gate=gate)  # waits, imported
        run.wait_for("the 2-rank world's checkpoint write at step 8",
                     lambda: run.marker("paused_write.json"))
        os.kill(run.marker("paused_write.json")["pid"], signal.SIGKILL)  # killed mid-write
        gate.touch()  # the node comes back
        for proc in (node_a, node_b):
            proc.wait(timeout=max(run.left(), 1))
    finally:
        run.close()
    wall = time.monotonic() - began
    assert node_a.returncode == 0, run.logs()
    assert node_b.returncode == 0, run.logs()
    print(f"elastic scenario wall time {wall:.1f} s")
    _check_scenario(tmp_path, run.logs(tail=10**7))


def _check_scenario(tmp_path: Path, logs: str) -> None:
    """What the finished scenario left in ``tmp_path`` (its agents' ``logs``)."""

    # The half-written file is still there, beside the complete checkpoints it never replaced.
    strays = list((tmp_path / "ckpt").glob(".last.ckpt.*.tmp"))
    assert strays, sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(Exception):  # noqa: B017, PT011 (any unpickling error: it is truncated)
        torch.load(strays[0], weights_only=True)

    # What the log says: the step resumed from, what was lost, the old and the new world.
    said = [line.strip() for line in logs.splitlines()]
    expected = [
        [f"resuming from {tmp_path / 'ckpt' / 'last.ckpt'} at step 4",
         "lost: steps 5-6 had started since that checkpoint (on 4 ranks); their work is "
         "replayed from step 5",
         "world: written by 4 ranks on 2 node(s), 2 stages x 2 replicas; now 2 ranks on 1 "
         "node(s), 2 stages x 1 replica",
         "data: epoch 0 continues after global batch 4 (global batch 16 samples, now 16 per "
         "replica)"],
        [f"resuming from {tmp_path / 'ckpt' / 'last.ckpt'} at step 6",  # not 8: half-written
         "lost: steps 7-8 had started since that checkpoint (on 2 ranks); their work is "
         "replayed from step 7",
         "world: written by 2 ranks on 1 node(s), 2 stages x 1 replica; now 4 ranks on 2 "
         "node(s), 2 stages x 2 replicas",
         "data: epoch 1 continues after global batch 1 (global batch 16 samples, now 8 per "
         "replica)"],
    ]
    resumed = [i for i, line in enumerate(said) if "resuming from" in line]
    assert len(resumed) == 2, "\n".join(line for line in said if "elastic" in line)
    for i, lines in zip(resumed, expected):
        assert said[i].startswith("elastic: torchrun run 'elastic-test', attempt ")
        assert said[i].endswith(lines[0])
        assert said[i + 1 : i + 4] == lines[1:]

    final = json.loads((tmp_path / "final.json").read_text())
    assert final == {"world": 4, "step": W.STEPS}

    # Every step's samples: that global batch, striped over the replicas of its world.
    order = _global_order(W.STEPS)
    counted = _counted_batches(tmp_path)
    assert sorted(counted) == list(range(1, W.STEPS + 1))
    assert [counted[s]["world"] for s in (1, 4, 5, 6, 7, 12)] == [4, 4, 2, 2, 4, 4]
    for step, seen in counted.items():
        r = seen["replicas"]
        assert seen["idx"] == {k: order[step - 1][k::r] for k in range(r)}, step

    # The weights: one process on the same global batches, rtol 1e-5.
    state = safe_load(tmp_path / "final.ckpt")["state_dict"]
    ref = _reference(W.STEPS)
    for name, value in ref.items():
        torch.testing.assert_close(state[f"net.{name}"], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
