"""A module put in evaluation mode while the model trains (a frozen BatchNorm, as fine-tuning
code freezes a backbone's) keeps that mode in the pipeline's stages; a hook that clips by the
norm of ``self.parameters()`` is told that they are its stage's; layers unfrozen during the run
train from then on, as in one process.

Cases ``frozen`` and ``frozen-export`` of ``tests/lightning/_capture_run.py`` run in the shared
2-rank world: a BatchNorm CNN whose ``on_train_epoch_start`` puts its first BatchNorm in
evaluation mode. Captured by torch.fx, the stages call the model's modules and follow their
modes: the run equals one process doing the same (the frozen statistics unchanged, the other
BatchNorm's updated); before, the stage's ``train()`` put the module back in training mode at
every step. Captured by torch.export, the graph follows the whole model's mode only, and the
rank holding that BatchNorm warns so. Tolerance: the suite's float32 ``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.lightning import _capture_run as R

pytestmark = pytest.mark.slow

MODULE = "tests.lightning._capture_run"
WORLD_CASES = {2: [f"{MODULE}:frozen", f"{MODULE}:frozen-export", f"{MODULE}:clipnorm",
                   f"{MODULE}:unfreeze", f"{MODULE}:finetune", f"{MODULE}:finetune-head",
                   f"{MODULE}:stop",
                   f"{MODULE}:warmup", f"{MODULE}:anneal", f"{MODULE}:onecycle"]}
RTOL, ATOL = 1e-5, 1e-6


def test_a_module_in_evaluation_mode_stays_so_in_a_torch_fx_stage(worlds):
    ranks = worlds.results(2, MODULE, "frozen", weights_only=False)
    torch.set_num_threads(1)
    net = R.PlainCNN()
    start = {k: v.clone() for k, v in net.bn1.named_buffers()}  # its running statistics
    opt = torch.optim.SGD(net.parameters(), lr=R.LR)
    losses = []
    for x, y in ranks[0]["batches"]:
        net.bn1.eval()
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    state = {f"net.{k}": v for k, v in net.state_dict().items()}
    for name, value in start.items():  # the reference did freeze it
        assert torch.equal(state[f"net.bn1.{name}"], value), name
    assert int(state["net.bn2.num_batches_tracked"]) == len(losses)
    R.assert_like_one_process(ranks, losses, net, RTOL, ATOL)
    for rank in ranks:
        assert not any("evaluation mode" in w for w in rank["warnings"]), rank["warnings"]


def test_a_torch_export_stage_that_cannot_keep_it_warns_on_the_rank_holding_it(worlds):
    ranks = worlds.results(2, MODULE, "frozen-export", weights_only=False)
    for rank in ranks:
        said = [w for w in rank["warnings"] if "in evaluation mode while the model trains" in w]
        holds = "net.bn1.running_mean" in rank["state"]  # its stage holds the BatchNorm
        assert bool(said) == holds, (rank["stage"], said)
        if said:
            assert said[0].startswith("net.bn1 is in evaluation mode")
            assert "torch.fx" in said[0]


def test_a_hook_clipping_by_the_norm_of_self_parameters_is_warned_once_on_every_rank(worlds):
    """Each rank holds its stage's parameters only: the norm the hook clips by is the stage's,
    not the model's (no error otherwise); the warning names the Trainer option that clips by
    the model's norm."""
    ranks = worlds.results(2, MODULE, "clipnorm", weights_only=False)
    for rank in ranks:
        said = [w for w in rank["warnings"] if "self.parameters()" in w]
        assert len(said) == 1, rank["warnings"]  # once, though every step's hook reads them
        assert said[0].startswith("on_before_optimizer_step calls self.parameters()")
        assert "gradient_clip_algorithm" in said[0]


def test_layers_unfrozen_during_the_run_train_from_then_on_like_one_process(worlds):
    """The first stage held nothing to train when it was built; from the step its layers are
    unfrozen they take gradients and the optimizer moves them (before, the lists kept from
    the build handed Lightning's backward no gradient for them: they never trained)."""
    ranks = worlds.results(2, MODULE, "unfreeze", weights_only=False)
    torch.set_num_threads(1)
    net = R.PlainCNN()
    frozen = (net.conv1, net.bn1)
    for layer in frozen:
        layer.requires_grad_(False)
    start = net.conv1.weight.detach().clone()
    opt = torch.optim.SGD(net.parameters(), lr=R.LR)
    losses = []
    for step, (x, y) in enumerate(ranks[0]["batches"]):
        if step == R.UNFROZEN_FROM:
            for layer in frozen:
                layer.requires_grad_(True)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert not torch.equal(net.conv1.weight, start)  # the reference did unfreeze it
    R.assert_like_one_process(ranks, losses, net, RTOL, ATOL)


def _plain_finetuning(root, head: bool) -> tuple[dict, dict]:
    """One process (Lightning's own strategy) running case ``finetune``: the checkpoint after
    the first fit, and the state after the resumed epoch."""
    path = root / "plain.ckpt"
    for epochs, resume in ((R.FINETUNE_EPOCHS, None), (R.FINETUNE_EPOCHS + 1, path)):
        task = R.Finetunes(head)
        trainer = R.single_or_split_trainer(root, epochs, [R.finetuning()])
        trainer.fit(task, R.images(R.STEPS, seed=1), ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True), task.state_dict()


@pytest.mark.parametrize("case", ["finetune", "finetune-head"])
def test_backbone_finetuning_saves_and_resumes_in_another_layout_like_one_process(worlds,
                                                                                   tmp_path,
                                                                                   case):
    """The backbone's group is added on its rank alone; the other rank gets it too (empty), so
    the checkpoint's optimizer and the callback's record hold the groups one process holds, and
    a resume whose cut differs puts each rank's part of them back (before, saving failed on the
    ranks' unequal group counts, and a resume failed with a KeyError in Lightning's code). With
    the last stage's layer unfrozen and a sharded checkpoint, rank 0 holds that group empty."""
    ranks = worlds.results(2, MODULE, case, weights_only=False)
    torch.set_num_threads(1)
    plain, final = _plain_finetuning(tmp_path, case == "finetune-head")
    if case == "finetune":  # a sharded checkpoint is a directory, read by the resume alone
        saved = torch.load(ranks[0]["checkpoint"], weights_only=True)
        assert len(plain["optimizer_states"][0]["param_groups"]) == 2  # the backbone's added
        assert saved["optimizer_states"][0]["param_groups"] == plain["optimizer_states"][0][
            "param_groups"]
        assert saved["callbacks"] == plain["callbacks"]
        for name, value in plain["state_dict"].items():
            torch.testing.assert_close(saved["state_dict"][name], value, rtol=RTOL, atol=ATOL)
    for rank in ranks:
        assert set(rank["states"][0]) != set(rank["states"][1])  # another cut on resume
        for name, value in rank["states"][1].items():
            torch.testing.assert_close(value, final[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.parametrize("case", ["stop", "warmup"])
def test_what_a_training_step_does_to_the_trainer_holds_on_every_rank(worlds, tmp_path, case):
    """The module's steps run on the last stage: its ``self.trainer.should_stop = True`` stops
    every rank after that step, and a learning rate it sets is every stage's, as in one process
    (before, the last stage stopped alone and the first waited for its next step until the
    timeout; the first stage trained on at the old learning rate with no error)."""
    ranks = worlds.results(2, MODULE, case, weights_only=False)
    torch.set_num_threads(1)
    task = R.Stops() if case == "stop" else R.WarmsUp()
    trainer = R.single_or_split_trainer(tmp_path, 2, [])
    trainer.fit(task, R.images(R.STEPS, seed=1))
    assert trainer.global_step == (R.STOP_AT + 1 if case == "stop" else 2 * R.STEPS)
    for rank in ranks:
        assert rank["steps"] == trainer.global_step
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, task.state_dict()[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")


def test_a_python_number_changed_during_the_run_is_warned_of_once_on_every_rank(worlds):
    """The captured graph keeps the temperature it was traced with: after the first epoch the
    run no longer trains what one process would, and every rank says so, once, with the fix."""
    ranks = worlds.results(2, MODULE, "anneal", weights_only=False)
    for rank in ranks:
        said = [w for w in rank["warnings"] if "when the model's graph was captured" in w]
        assert len(said) == 1, rank["warnings"]
        assert said[0].startswith("net.temperature was 1.0 when the model's graph was "
                                  "captured and is 2.0 now")
        assert "register_buffer('temperature', torch.tensor(1.0))" in said[0]


def test_a_schedule_sized_by_the_estimated_stepping_batches_trains_like_one_process(worlds,
                                                                                      tmp_path):
    """``configure_optimizers`` reading ``estimated_stepping_batches`` loads the training data;
    the strategy's early call of it (measuring the optimizer's state for the plan) had it load
    the data sampled for one replica per rank: the stages of the one replica were given
    different batches (refused at the first step) and the schedule half its length."""
    ranks = worlds.results(2, MODULE, "onecycle", weights_only=False)
    torch.set_num_threads(1)
    task = R.OneCycle()
    trainer = R.single_or_split_trainer(tmp_path, 2, [])
    trainer.fit(task, R.shuffled_images(R.STEPS, seed=1))
    assert trainer.lr_scheduler_configs[0].scheduler.total_steps == 2 * R.STEPS
    for rank in ranks:
        assert (rank["steps"], rank["total"]) == (2 * R.STEPS, 2 * R.STEPS)
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, task.state_dict()[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, n=name: f"{n}: {s}")
