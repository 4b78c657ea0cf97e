"""The step runner in one process: a module's own steps over slices equal one whole-batch step.

No processes: a one-stage, one-replica layout needs no collective, so :meth:`StepRunner.finish`
combines the slices' records exactly as the last stage of a pipeline does.
"""

from __future__ import annotations

import warnings
from collections import namedtuple

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from lightning_autopipe.errors import StepContractError
from lightning_autopipe.lightning.stage_parameters import gradient_hooks_warned
from lightning_autopipe.lightning.step_outputs import join_slices
from lightning_autopipe.lightning.steps import StepRunner
from lightning_autopipe.runtime.groups import RankLayout

LAYOUT = RankLayout(rank=0, stage=0, replica=0, grid=((0,),))
CPU = torch.device("cpu")
SLICES = [(0, 2), (2, 4), (4, 5), (5, 10)]  # micro-batch 0 in startup slices, then the rest


class Module(pl.LightningModule):
    """Logs a mean, a sum, a max and a min, as a DDP module might."""

    def __init__(self, mistake: str | None = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.mistake = mistake

    def forward(self, x):
        return self.lin(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mistake == "early bug":
            raise KeyError("a bug of the step itself")
        if self.mistake == "submodule":  # as self.net(x) does with another stage's weights
            raise TypeError("linear(): argument 'weight' must be Tensor, not NoneType")
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss)
        self.log_dict({"hits": (logits.argmax(-1) == y).float().sum()}, reduce_fx="sum")
        self.log("worst", F.cross_entropy(logits, y, reduction="none").max(), reduce_fx="max")
        self.log("best", F.cross_entropy(logits, y, reduction="none").min(), reduce_fx="min")
        self.log("count", len(y), batch_size=2 * len(y))  # a Python number, own weights
        self.log("loss_c", loss, batch_size=10)  # the batch size as a constant (hparams)
        if self.mistake == "shape":
            self(x[:1])
        if self.mistake == "vector":
            self.log("vector", logits[0])
        if self.mistake == "custom":
            self.log("median", loss, reduce_fx=torch.median)
        if self.mistake == "bug":
            raise KeyError("a bug of the step itself")
        if self.mistake == "skip":  # skipping a batch, as one may under strategy="auto"
            return None
        if self.mistake == "stored":  # an auxiliary loss the forward kept on the module
            return {"loss": loss + self.stored}
        if self.mistake == "penalty":  # a hand-written L2 penalty over the parameters
            return loss + 0.1 * sum(p.pow(2).sum() for p in self.parameters())
        return {"loss": loss}


def _batch(n: int = 10):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _run(module: Module, hook: str = "training_step"):
    runner = StepRunner(module)
    x, y = _batch()
    runner.begin(hook, (0,))
    losses = []
    for lo, hi in SLICES:
        with torch.no_grad():
            outputs = module.lin(x[lo:hi])  # what the last stage hands over
        losses.append(runner(outputs, (x[lo:hi], y[lo:hi])))
    return runner, losses


def test_slices_log_what_one_whole_batch_step_logs():
    module = Module()
    runner, losses = _run(module)
    outcome = runner.finish(LAYOUT, None, CPU)
    x, y = _batch()
    with torch.no_grad():
        logits = module.lin(x)
        per_sample = F.cross_entropy(logits, y, reduction="none")
    logged = {name: (value, options) for name, options, value, _ in outcome.logs}
    assert list(logged) == ["loss", "hits", "worst", "best", "count", "loss_c"]
    torch.testing.assert_close(logged["loss"][0], float(per_sample.mean()), rtol=1e-6, atol=0)
    assert logged["loss"][1]["batch_size"] == 10  # the whole batch, for on_epoch means
    # one batch_size in every slice of 2, 2, 1 and 5 samples: the batch's size, as one
    # process logs it; the slices weigh by their samples (not equally) and the step logs 10
    torch.testing.assert_close(logged["loss_c"][0], float(per_sample.mean()), rtol=1e-6, atol=0)
    assert logged["loss_c"][1]["batch_size"] == 10
    assert logged["hits"][0] == float((logits.argmax(-1) == y).sum())
    torch.testing.assert_close(logged["worst"][0], float(per_sample.max()))
    torch.testing.assert_close(logged["best"][0], float(per_sample.min()))
    # weighted by the given batch_size (2 x slice size): sum(2 n_i * n_i) / sum(2 n_i)
    sizes = [hi - lo for lo, hi in SLICES]
    assert logged["count"][0] == pytest.approx(sum(n * n for n in sizes) / sum(sizes))
    assert logged["count"][1]["batch_size"] == 20
    # a plain mean of the slices' means would differ: the slices hold 2, 2, 1 and 5 samples
    assert abs(float(torch.stack(losses).mean()) - logged["loss"][0]) > 1e-3
    for loss in losses:  # the executor back-propagates the module's own loss per slice
        assert loss.dim() == 0
    assert outcome.returned is None  # training returns the executor's loss, not this


def test_evaluation_returns_the_sample_weighted_loss():
    module = Module()
    module.validation_step = module.training_step
    runner, losses = _run(module, "validation_step")
    assert all(float(t) == 0.0 for t in losses)  # forward only: no loss to back-propagate
    x, y = _batch()
    with torch.no_grad():
        whole = F.cross_entropy(module.lin(x), y)
    outcome = runner.finish(LAYOUT, None, CPU)
    assert list(outcome.returned) == ["loss"]  # the step's own dict, as one call returns it
    torch.testing.assert_close(outcome.returned["loss"], whole, rtol=1e-6, atol=0)


@pytest.mark.parametrize("hook", ["validation_step", "test_step"])
def test_an_evaluation_step_returns_to_its_batch_end_hook_what_one_whole_batch_call_returns(
        hook):
    """``on_validation_batch_end`` / ``on_test_batch_end`` receive the step's return value:
    per-sample tensors concatenated in batch order, a one-element mean weighted by the slices'
    samples, values alike in every slice kept (not only a scalar loss, the rest dropped)."""
    module = Module()

    def step(batch, batch_idx):
        x, y = batch
        logits = module(x)
        loss = F.cross_entropy(logits, y)
        return {"loss": loss, "preds": logits.argmax(-1), "logits": logits,
                "acc": float((logits.argmax(-1) == y).float().mean()), "batch_idx": batch_idx,
                "pair": (loss.reshape(1), y)}

    setattr(module, hook, step)
    runner, _ = _run(module, hook)
    got = runner.finish(LAYOUT, None, CPU).returned
    x, y = _batch()
    module.__dict__.pop(hook)
    with torch.no_grad():
        want = step((x, y), 0)
    assert list(got) == list(want)
    for key in ("loss", "preds", "logits"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)
    assert got["acc"] == pytest.approx(want["acc"], rel=1e-6)  # float32 means
    assert got["batch_idx"] == 0
    assert isinstance(got["batch_idx"], int)
    torch.testing.assert_close(got["pair"][0], want["pair"][0], rtol=1e-6, atol=0)
    assert torch.equal(got["pair"][1], y)


@pytest.mark.parametrize("value", ["matrix", "count", "ragged"])
def test_an_evaluation_return_that_cannot_be_joined_is_warned_once_and_given_as_none(value):
    """A per-batch statistic of another shape (a confusion matrix) or a count (an integer:
    summed or averaged?) cannot be joined from slices, nor per-sample tensors whose trailing
    sizes differ between slices (torch.cat raised on the last stage alone): ``None`` with a
    warning, and the validation itself goes on (its logs are unaffected)."""
    module = Module()

    def step(batch, batch_idx):
        logits = module(batch[0])
        if value == "count":
            return (logits.argmax(-1) == batch[1]).sum()
        if value == "ragged":
            return logits[:, : len(logits) % 3 + 1]
        return torch.zeros(3, 3) + logits.sum()

    module.validation_step = step
    runner, _ = _run(module, "validation_step")
    with pytest.warns(UserWarning, match=r"on_validation_batch_end receives outputs=None"):
        assert runner.finish(LAYOUT, None, CPU).returned is None


def test_evaluation_outputs_too_large_to_send_each_step_stay_on_the_last_stage(monkeypatch):
    """A language model's logits returned from validation_step would be pickled and sent to
    every other stage every step (gigabytes): over ``SHIP_MAX_BYTES`` they stay on the last
    stage, which keeps them, and the others are told they get None."""
    from lightning_autopipe.lightning import steps

    last = RankLayout(rank=1, stage=1, replica=0, grid=((0,), (1,)))
    module = Module()
    module.validation_step = lambda batch, batch_idx: {"logits": module(batch[0])}
    for cap, shipped in ((10**6, True), (64, False)):
        monkeypatch.setattr(steps, "SHIP_MAX_BYTES", cap)
        runner, _ = _run(module, "validation_step")
        if shipped:
            payload = runner._payload(last)
        else:
            with pytest.warns(UserWarning, match="too much to send.*other stages' ranks"):
                payload = runner._payload(last)
        assert (payload["joined"] is not None) == shipped
        assert runner._joined["logits"].shape == (10, 3)  # the last stage's own, either way


@pytest.mark.parametrize(
    ("mistake", "phrase"),
    [
        ("shape", r"called self\(\.\.\.\) twice"),
        ("vector", r"got a tensor of shape \(3,\)"),
        ("custom", r"only 'mean', 'sum', 'max' and 'min'"),
        ("submodule", r"raised TypeError: linear\(\).*before calling self"),
        ("skip", r"training_step returned None.*cannot be skipped"),
    ],
)
def test_mistakes_are_raised_after_the_step_naming_pipeline_loss(mistake, phrase):
    module = Module(mistake)
    runner, losses = _run(module)
    assert all(t.requires_grad or mistake == "submodule" for t in losses)
    with pytest.raises(StepContractError, match=phrase) as info:
        runner.finish(LAYOUT, None, CPU)
    assert "pipeline_loss" in str(info.value)
    assert "forward" not in module.__dict__  # self(...) and self.log are the module's again
    assert "log" not in module.__dict__


def test_a_value_the_forward_stored_while_traced_is_named_as_that():
    """The forward stored an auxiliary loss on the module (``self.aux_loss = ...``) while
    torch.fx traced it: the attribute holds the trace's Proxy, and the step's loss computed
    from it was reported as "training_step returned a Proxy", pointing at the return."""
    module = Module("stored")
    module.stored = torch.fx.Proxy(torch.fx.Graph().placeholder("aux_loss"))
    runner, _ = _run(module)
    with pytest.raises(StepContractError, match=r"stored on the module .*self\.aux_loss.*"
                                                r"return it from forward"):
        runner.finish(LAYOUT, None, CPU)


@pytest.mark.parametrize("partial", [True, False])
def test_a_step_reading_the_parameters_of_a_split_model_is_warned_once(partial):
    """An L2 penalty over ``self.parameters()`` in training_step silently covered the last
    stage only (its rank holds no other stage's parameters); one stage of one (data parallel
    alone) holds them all: nothing to say."""
    import warnings

    module = Module("penalty")
    runner = StepRunner(module)
    runner.partial = partial
    x, y = _batch()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            runner.begin("training_step", (step,))
            for lo, hi in SLICES:
                runner(module.lin(x[lo:hi]), (x[lo:hi], y[lo:hi]))
            runner.finish(LAYOUT, None, CPU)
    said = [str(w.message) for w in seen if "self.parameters()" in str(w.message)]
    assert len(said) == (1 if partial else 0)
    assert all("weight_decay" in m for m in said)
    assert "parameters" not in module.__dict__


@pytest.mark.parametrize("hook", ["training_step", "validation_step"])
def test_a_logged_metric_object_is_refused_with_a_way_out_that_works_for_the_hook(hook):
    """Training: pipeline_loss (the strategy's own loop); evaluation, where pipeline_loss runs
    no step at all: update the metric in the step, log compute() at the epoch's end."""
    from torchmetrics import MeanMetric

    module = Module()
    module.metric = MeanMetric()

    def step(batch, batch_idx):
        loss = F.cross_entropy(module(batch[0]), batch[1])
        module.metric(loss)
        module.log("mean", module.metric)
        return loss

    setattr(module, hook, step)
    runner, _ = _run(module, hook)
    with pytest.raises(StepContractError) as info:
        runner.finish(LAYOUT, None, CPU)
    way_out = ("pipeline_loss" if hook == "training_step"
               else "log metric.compute() from on_validation_epoch_end")
    assert way_out in str(info.value)


@pytest.mark.parametrize("mistake", ["bug", "early bug"])
def test_an_error_of_the_step_itself_is_raised_as_it_is(mistake):
    """Also before the step calls self(...): only an error on a released (None) weight is
    told as running a submodule, the rest kept (it was told so, with the wrong advice)."""
    runner, _ = _run(Module(mistake))
    with pytest.raises(KeyError, match="a bug of the step itself"):
        runner.finish(LAYOUT, None, CPU)


def test_self_must_be_called_on_the_slice_inputs():
    module = Module()
    runner = StepRunner(module)
    runner.begin("training_step", (0,))
    x, y = _batch(4)

    def step(batch, batch_idx):
        return F.cross_entropy(module(batch[0][:, :2]), batch[1])

    module.training_step = step
    runner(module.lin(x), (x, y))
    with pytest.raises(StepContractError, match=r"shapes \[\(4, 2\)\].*\[\(4, 4\)\].*"
                                                r"pipeline_inputs"):
        runner.finish(LAYOUT, None, CPU)


class Scaled(Module):
    def forward(self, x, scale=1.0, mask=None):
        return self.lin(x) * scale


@pytest.mark.parametrize(("call", "refused"), [
    ({"scale": 2.0}, "scale=2.0"),  # the graph computes scale=1.0
    ({"scale": 1}, None),  # equal to the default it was traced with
    ({"mask": None}, None),
    ({"mask": True}, None),  # a default of None may mean "as configured": warned of
])
def test_a_non_tensor_argument_other_than_the_traced_default_is_refused(call, refused):
    """Only tensors reach the stages: ``self(x, scale=2.0)`` would be answered with outputs
    computed at ``forward``'s default ``scale=1.0`` and train another model, silently."""
    module = Scaled()
    runner = StepRunner(module)
    runner.begin("training_step", (0,))
    x, y = _batch(4)

    def step(batch, batch_idx):
        return F.cross_entropy(module(batch[0], **call), batch[1])

    module.training_step = step
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        runner(module.lin(x), (x, y))
    assert [str(w.message) for w in warned if "default mask=None" in str(w.message)] == (
        ["training_step calls self(...) with mask=True, but the pipeline's graph was captured "
         "with forward's default mask=None: only tensors reach the pipeline's stages, so the "
         "outputs are those of the default; where the two compute differently, make "
         "mask=True forward's default"] if call == {"mask": True} else [])
    if refused is None:
        runner.finish(LAYOUT, None, CPU)
        return
    with pytest.raises(StepContractError, match=rf"self\(...\) with {refused}, .* forward's "
                                                r"default scale=1.0.*attribute"):
        runner.finish(LAYOUT, None, CPU)


@pytest.mark.parametrize("hook", ["training_step", "validation_step"])
def test_a_step_gathering_over_the_ranks_is_refused_instead_of_waiting(hook):
    """A contrastive loss or a metric gathering with ``self.all_gather`` in its step: the step
    runs on the last stage alone, so the others would never join and the job would wait until
    the timeout, naming a send or receive of the schedule."""
    module = Module()
    runner = StepRunner(module)
    runner.begin(hook, (0,))
    x, y = _batch(4)

    def step(batch, batch_idx):
        out = module(batch[0])
        return F.cross_entropy(out, batch[1]) + 0 * module.all_gather(out).sum()

    setattr(module, hook, step)
    runner(module.lin(x), (x, y))
    with pytest.raises(StepContractError, match=rf"{hook} called self.all_gather.*epoch-end"):
        runner.finish(LAYOUT, None, CPU)
    assert "all_gather" not in module.__dict__  # Lightning's own again after the step


def test_a_pipeline_loss_module_keeps_its_pipeline_loss():
    module = Module()
    module.pipeline_loss = lambda outputs, batch: F.cross_entropy(outputs, batch[1])
    runner = StepRunner(module)
    assert runner.uses_pipeline_loss
    x, y = _batch(4)
    torch.testing.assert_close(runner(module.lin(x), (x, y)), F.cross_entropy(module.lin(x), y))


def test_join_slices_restores_batch_order():
    parts = [torch.arange(2), torch.arange(2, 5)]
    assert join_slices(parts, [2, 3]).tolist() == [0, 1, 2, 3, 4]
    dicts = [{"a": torch.ones(2, 1), "b": ["x", "y"]}, {"a": torch.zeros(1, 1), "b": ["z"]}]
    joined = join_slices(dicts, [2, 1])
    assert joined["a"].flatten().tolist() == [1, 1, 0]
    assert joined["b"] == ["x", "y", "z"]  # one entry per sample: concatenated
    pair = namedtuple("pair", "p q")
    tuples = [pair(torch.ones(1), torch.ones(1, 2)), pair(torch.zeros(1), torch.zeros(1, 2))]
    out = join_slices(tuples, [1, 1])
    assert isinstance(out, pair)
    assert out.q.shape == (2, 2)
    assert join_slices([None, None], [1, 1]) is None
    # a value alike in every slice (Lightning's own DDP predict returns it once per batch)
    assert join_slices([{"i": 7, "p": torch.ones(1)}] * 2, [1, 1])["i"] == 7
    with pytest.raises(StepContractError, match=r"shapes \[\(\)\].*per-sample values"):
        join_slices([torch.tensor(1.0), torch.tensor(2.0)], [1, 1])
    with pytest.raises(StepContractError, match="cannot be joined"):
        join_slices(["a", "b"], [1, 1])


def test_an_unknown_step_or_a_missing_pipeline_loss_is_an_option_error():
    from lightning_autopipe.errors import OptionError

    runner = StepRunner(Module())
    with pytest.raises(OptionError, match=r"unknown step 'train_step'"):
        runner.begin("train_step", (0,))
    with pytest.raises(OptionError, match=r"asked of Module, which has no pipeline_loss"):
        runner.begin("pipeline_loss", (0,))


def test_an_epoch_end_hook_failing_where_no_step_runs_is_told_why():
    """Lightning 2's way to aggregate at epoch end (collect outputs on ``self`` in the step,
    reduce them in ``on_validation_epoch_end``) finds an empty list on a rank whose stage
    runs no step: the error gets a note saying so and what to do instead."""
    from types import SimpleNamespace

    from lightning_autopipe.lightning.step_hooks import epoch_end_note

    class Collects(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.outputs = []

        def on_validation_epoch_end(self):
            torch.stack(self.outputs).mean()

    module = Collects()
    with pytest.raises(RuntimeError) as info:
        module.on_validation_epoch_end()
    first = SimpleNamespace(is_last=False, stage=0, num_stages=2)
    note = epoch_end_note(info.value, module, first)
    assert note is not None
    assert "on_validation_epoch_end raised on a rank holding stage 0 of 0..1" in note
    assert "metric.compute()" in note
    assert epoch_end_note(info.value, module, SimpleNamespace(is_last=True, stage=1,
                                                              num_stages=2)) is None
    assert epoch_end_note(RuntimeError("elsewhere"), module, first) is None


def test_uneven_replica_batches_log_synced_means_of_the_global_batch():
    """Two replicas training 6 and 2 samples of an even 4: combined with their weights, what
    Lightning makes of the ranks' logs (the step's synced mean over ranks, the epoch's
    batch-weighted mean) is the global batch's mean, for a mean weighted by samples or by a
    constant batch_size (the loader's or the global batch's); a token-weighted mean keeps its
    own weights."""
    from lightning_autopipe.lightning.step_logs import SliceLogs, bind_log

    values = {0: torch.tensor([0.0, 1, 2, 3, 4, 5]), 1: torch.tensor([10.0, 20])}
    tokens = {0: torch.tensor([1.0, 2, 3, 1, 2, 3]), 1: torch.tensor([4.0, 6])}
    slices = {0: [(0, 4), (4, 6)], 1: [(0, 1), (1, 2)]}
    logged = {}
    for r in (0, 1):
        logs = SliceLogs()
        for lo, hi in slices[r]:
            v, t = values[r][lo:hi], tokens[r][lo:hi]
            calls = (("loss", {}, v.mean()), ("loss_c", {"batch_size": 4}, v.mean()),
                     ("loss_g", {"batch_size": 8}, v.mean()),
                     ("tok", {"batch_size": float(t.sum())}, (v * t).sum() / t.sum()))
            for name, kw, value in calls:
                got = bind_log("training_step", (name, value), {"sync_dist": True, **kw})
                logs.merge(got[0], got[1], got[2], hi - lo, got[3])
        logged[r] = {name: (value, opts["batch_size"])
                     for name, opts, value, _ in logs.combined(len(values[r]) / 4, 2)}
    every = torch.cat(list(values.values()))
    for name in ("loss", "loss_c", "loss_g"):  # no batch_size, the loader's, the global one
        step = sum(logged[r][name][0] for r in (0, 1)) / 2  # sync_dist: ranks alike
        epoch = (sum(v * b for v, b in (logged[r][name] for r in (0, 1)))
                 / sum(b for _, b in (logged[r][name] for r in (0, 1))))
        assert step == pytest.approx(float(every.mean()))
        assert epoch == pytest.approx(float(every.mean()))
    weights = torch.cat(list(tokens.values()))
    epoch = (sum(v * b for v, b in (logged[r]["tok"] for r in (0, 1)))
             / sum(b for _, b in (logged[r]["tok"] for r in (0, 1))))
    assert epoch == pytest.approx(float((every * weights).sum() / weights.sum()))
    # one slice per step (m = 1): a token count is still a count, not the batch's size
    one = {}
    for r in (0, 1):
        logs = SliceLogs()
        v, t = values[r], tokens[r]
        got = bind_log("training_step", ("tok", (v * t).sum() / t.sum()),
                       {"sync_dist": True, "batch_size": float(t.sum())})
        logs.merge(got[0], got[1], got[2], len(v), got[3])
        one[r] = [(value, opts["batch_size"]) for _, opts, value, _ in
                  logs.combined(len(v) / 4, 2)][0]
    epoch = sum(v * b for v, b in one.values()) / sum(b for _, b in one.values())
    assert epoch == pytest.approx(float((every * weights).sum() / weights.sum()))


class LogsBeforeStepping(Module):
    """Reads its parameters in its step (a device lookup) and in its optimizer-step hook."""

    def training_step(self, batch, batch_idx):
        next(self.parameters())
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


class ClipsAfterBackward(LogsBeforeStepping):
    """Clips in ``on_after_backward`` instead (Lightning calls it inside the closure)."""

    def on_after_backward(self):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


@pytest.mark.parametrize("hook", ["on_before_optimizer_step", "on_after_backward"])
@pytest.mark.parametrize("split", [True, False])
def test_only_the_optimizer_step_hooks_reading_parameters_are_warned_of(split, hook):
    """Lightning's optimizer step runs the step's closure (``training_step``) too: only the
    hook's own reading is the clipping the warning is about, and only on a split model."""
    module = LogsBeforeStepping() if hook == "on_before_optimizer_step" else ClipsAfterBackward()
    warned: set[str] = set()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gradient_hooks_warned(module, split, warned):
            module.training_step(_batch(), 0)
            for _ in range(2):
                getattr(module, hook)(*([None] if hook == "on_before_optimizer_step" else []))
    said = [str(w.message) for w in seen if "self.parameters()" in str(w.message)]
    assert len(said) == (1 if split else 0)
    if split:
        assert said[0].startswith(f"{hook} calls self.parameters()")
        assert "global_grad_norm" in said[0]
    assert hook not in module.__dict__  # the hook is the class's again
    assert "parameters" not in module.__dict__
