"""Models built on the meta device: each rank materialises only its stage, on real gloo ranks.

The references are computed here, in one process: the same model materialised whole from the
same seed, or built for real and loaded with the same weights, trained on the same batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import PlanError
from lightning_autopipe.graph import split_model
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.search import finish_plan, make_plan
from lightning_autopipe.runtime.materialize import Materializer
from lightning_autopipe.runtime.profiler import profile_blocks
from tests.runtime import _meta as M

SIZES = {"d": 16, "layers": 2}


@pytest.fixture
def spawn_case(gloo):
    """``spawn_case(case, world, tmp_path, arg)``: every rank's result of ``case``."""
    return lambda case, world, tmp_path, arg: gloo(world).run(M.on_rank, case, arg)


def _whole(seed: int) -> M.Task:
    """The model materialised whole in this process from ``seed`` (1 stage, 1 rank)."""
    module = M.deferred("gpt", **SIZES)
    Materializer(module, seed).materialize([*module.parameters(), *module.buffers()],
                                           torch.device("cpu"))
    return module


def test_the_same_seed_gives_the_same_weights_under_1_2_and_4_stages(tmp_path, spawn_case):
    """4 ranks as 1 stage x 4 replicas, 2 x 2 and 4 x 1 (given plans): every parameter each
    rank materialised equals the one-process materialisation, and no rank materialised
    anything but its own stage (nothing was profiled)."""
    seed = 1234
    layouts = [([0, 7], 4), ([0, 4, 7], 2), ([0, 2, 4, 6, 7], 1)]
    ranks = spawn_case("layouts", 4, tmp_path, {"seed": seed, "sizes": SIZES, "layouts": layouts})
    want = _whole(seed).state_dict()
    blocks = split_model(M.deferred("gpt", **SIZES), M.example("gpt", M.data("gpt", 8)))
    for cuts, replicas in layouts:
        key = f"{cuts}x{replicas}"
        gathered: dict[str, torch.Tensor] = {}
        for r in ranks:
            got = r[key]
            local = set(blocks.stage(cuts[got["stage"]], cuts[got["stage"] + 1])
                        .param_names.values())
            # nothing of another stage (a tied weight is materialised under its first name)
            assert all(set(aliases) & local for aliases in got["materialized"]), key
            assert got["only_stage_real"], key
            gathered.update(got["state"])
        assert set(gathered) == set(want), key
        for name, value in gathered.items():
            assert torch.equal(value, want[name]), (key, name)
    # the initialisers ran: LayerNorm weights are ones, Linear biases zero, weights N(0, 0.02)
    assert torch.equal(want["net.h.0.ln_1.weight"], torch.ones(16))
    assert torch.equal(want["net.h.0.attn.qkv.bias"], torch.zeros(48))
    assert 0.015 < float(want["net.h.0.mlp.fc.weight"].std()) < 0.025
    other = _whole(seed + 1).state_dict()
    assert not torch.equal(other["net.wte.weight"], want["net.wte.weight"])


def test_training_from_a_checkpoint_loaded_into_the_meta_model_equals_one_process(
        tmp_path, spawn_case):
    """A consolidated file (memory-mapped) and a sharded directory, 2 stages: each rank asks
    the sharded reader for its stage's names only, and both runs' losses equal one process
    training the checkpointed model."""
    torch.manual_seed(5)
    eager = M.Task(lambda: M.build("gpt"))
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    torch.save(state, tmp_path / "model.pt")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"model.{k}": v for k, v in state.items()},
                 storage_writer=dcp.FileSystemWriter(tmp_path / "sharded"), no_dist=True)
    cuts = [0, 4, 7]
    ranks = spawn_case("checkpoint", 2, tmp_path,
                   {"file": str(tmp_path / "model.pt"), "dir": str(tmp_path / "sharded"),
                    "cuts": cuts})
    want = M.reference_losses(eager, "gpt", replicas=1)
    for r in ranks:
        asked = set(r["asked"])
        assert asked <= set(r["local"])  # its stage's keys, nothing else
        assert len(asked) == len(r["sharded"]["state"])  # each of its tensors, once
        for source in ("consolidated", "sharded"):
            for name, value in r[source]["state"].items():
                assert torch.equal(value, state[name]), (source, name)
            torch.testing.assert_close(r[source]["losses"], want, rtol=1e-5, atol=0)


def test_hugging_face_models_built_on_meta_train_as_built_eagerly(tmp_path, spawn_case):
    """GPT-2, BERT, Llama and ResNet, traced with torch.export on the meta device, split on 2
    stages (planned), initialised by their own _init_weights: 2 steps equal the eagerly built
    model given the same weights. Llama's attention makes an empty tensor per call, a constant
    of the traced graph that no module holds: it gets storage with its stage. ResNet takes
    images (a meta weight meets a real input) and holds BatchNorm statistics (real buffers
    meet meta activations): both are on the meta device while it is exported."""
    ranks = spawn_case("hf", 2, tmp_path, {"seed": 3})
    for kind in M.HF_KINDS:
        state: dict[str, torch.Tensor] = {}
        for r in ranks:
            state.update(r[kind]["state"])
        torch.manual_seed(0)
        eager = M.Task(lambda k=kind: M.build(k), kind)
        eager.net.eval()
        missing, unexpected = eager.load_state_dict(state, strict=False)
        assert not unexpected, (kind, unexpected)
        # what is not given: BERT's buffers (re-created by _init_weights), a tied alias
        tied = {n for n, t in eager.state_dict(keep_vars=True).items()
                if any(t is u for k, u in eager.state_dict(keep_vars=True).items()
                       if k != n and k in state)}
        assert all("position_ids" in m or "token_type_ids" in m or m in tied
                   for m in missing), (kind, missing)
        want = M.reference_losses(eager, kind, replicas=1, steps=2)
        for r in ranks:
            torch.testing.assert_close(r[kind]["losses"], want, rtol=1e-5, atol=0)
        assert {r[kind]["stage"] for r in ranks} == {0, 1}


def test_measured_peak_memory_per_stage_is_within_20_percent_of_the_prediction(
        tmp_path, spawn_case):
    """2 ranks plan from block-by-block profiles of a meta-device GPT (no more than one block's
    parameters ever materialised while profiling) and train 2 Adam steps; each rank's
    measured peak (tensor bytes: parameters, gradients, Adam state, saved activations) is
    within 20% of the plan's, and so is its activation part."""
    sizes = {"d": 64, "layers": 2, "seq": 32}
    ranks = spawn_case("memory", 2, tmp_path, {"sizes": sizes})
    for r in ranks:
        assert r["held_while_profiling"]
        assert max(r["held_while_profiling"]) <= r["largest_block"]
    from lightning_autopipe.planner.plan import Plan
    from lightning_autopipe.profile import Profile

    plan = Plan.from_json(ranks[0]["plan"])
    profile = Profile.from_json(ranks[0]["profile"])
    readings = ranks[0]["readings"]
    assert [x.rank for x in readings] == [0, 1]
    for x in readings:
        i, j = plan.stages[x.stage].blocks
        params = sum(b.param_bytes for b in profile.blocks[i:j])
        assert x.params == params  # the stage holds what the profile priced
        assert x.optimizer == pytest.approx(2 * params, rel=1e-3)  # Adam: 2 moments + steps
        assert x.grads == params
        predicted_activations = x.predicted - 4 * params
        assert 0.8 <= x.ratio <= 1.2, x
        assert 0.8 <= x.activations / predicted_activations <= 1.2, (x, predicted_activations)


def test_recomputation_is_chosen_only_when_memory_requires_it_and_equals_one_process(
        tmp_path, spawn_case):
    """The planner recomputes a stage only under a memory limit that nothing fits otherwise;
    the 2-rank run of that plan trains exactly as one process."""
    sizes = {"d": 32, "layers": 2, "seq": 16}
    torch.manual_seed(0)
    eager = M.Task(lambda: M.build("gpt", **sizes))
    batch = M.data("gpt", M.BATCH)
    blocks = split_model(eager, M.example("gpt", batch))
    profile = profile_blocks(blocks, M.example("gpt", batch[:4]), repeats=1)

    def plan_on(memory_gb: float):
        cluster = Cluster.local(2, memory_gb=memory_gb)
        return make_plan(profile, cluster, M.BATCH, num_stages=2, replicas=1,
                         num_microbatches=4, startup_slices=1, drain_slices=1,
                         schedules=("gpipe",)), cluster

    roomy, cluster = plan_on(16.0)
    assert not any(roomy.recompute)
    # the least any 2-stage split needs without recomputation; 10% less fits none of them
    devices = [d.name for d in cluster.devices]
    least = min(
        max(finish_plan(Proposal([[devices[0]], [devices[1]]], [0, c, len(blocks)], 4,
                                 schedule="gpipe"), "t", profile, cluster, M.BATCH)
            .peak_memory_bytes.values())
        for c in range(1, len(blocks))
    )
    tight, cluster = plan_on(0.9 * least / 2**30)
    assert any(tight.recompute)
    assert max(tight.peak_memory_bytes.values()) <= 0.9 * least
    ranks = spawn_case("recompute", 2, tmp_path,
                   {"sizes": sizes, "plan": tight.to_json(), "cluster": cluster})
    torch.manual_seed(0)
    reference = M.reference_losses(M.Task(lambda: M.build("gpt", **sizes)), "gpt", replicas=1)
    for r in ranks:
        torch.testing.assert_close(r["losses"], reference, rtol=1e-5, atol=0)
        stage = r["stage"]
        assert r["recomputed"] == ("Recomputed" if tight.recomputes(stage) else "StageModule")


def test_a_meta_tensor_that_no_module_holds_is_refused_naming_the_fix() -> None:
    """An empty one (a constant the trace lifted out of the forward) just gets storage; one
    with values to give cannot be initialised or loaded by name, and the error says so."""
    module = M.deferred("gpt")
    lifted = torch.empty(0, device="meta")
    stray = torch.empty(3, device="meta")
    materializer = Materializer(module, seed=0)
    assert materializer.materialize([lifted], torch.device("cpu")) == 0
    assert lifted.device.type == "cpu"
    with pytest.raises(PlanError, match="register it as a buffer of its module"):
        materializer.materialize([stray], torch.device("cpu"))
