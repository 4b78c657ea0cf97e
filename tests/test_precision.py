"""Which precisions the strategy runs (the rest refused with the list), and how 16-mixed's scaler
is taken over: same settings and state, scaling the executor's loss, kept across fits."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
)

from lightning_autopipe import AutoPipeStrategy
from lightning_autopipe.errors import PlanError
from lightning_autopipe.lightning.precision import check_precision, install_loss_scaling
from lightning_autopipe.lightning.prelaunch import check_trainer
from lightning_autopipe.runtime.scaler import PipelineGradScaler

SUPPORTED = r"use one of \['32-true', 'bf16-mixed', '16-mixed'\]"


def _transformer_engine() -> TransformerEnginePrecision:
    """Lightning's plugin as it reports itself; building it needs transformer_engine, which
    this machine lacks, and the check reads only what the plugin says its precision is."""
    return object.__new__(TransformerEnginePrecision)


@pytest.mark.parametrize(
    ("plugin", "name"),
    [(lambda: HalfPrecision("16-true"), "16-true"), (lambda: HalfPrecision("bf16-true"),
     "bf16-true"), (DoublePrecision, "64-true"), (_transformer_engine, "transformer-engine")],
    ids=["16-true", "bf16-true", "64-true", "transformer-engine"],
)
def test_unsupported_precisions_are_refused_with_the_supported_list(plugin, name):
    with pytest.raises(PlanError, match=rf"precision '{name}' is not supported .*{SUPPORTED}"):
        check_precision(plugin())


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_the_trainer_setup_check_refuses_them(precision):
    """What the Trainer builds for the flag, through the check ``AutoPipeStrategy.setup`` runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(strategy=AutoPipeStrategy(), accelerator="cpu", devices=1,
                             precision=precision, logger=False, enable_progress_bar=False)
    with pytest.raises(PlanError, match=rf"'{precision}' is not supported .*{SUPPORTED}"):
        check_trainer(trainer, trainer.strategy.precision_plugin)


def test_supported_precisions_pass_and_16_mixed_needs_the_amp_plugin():
    assert check_precision(Precision()) == "32-true"
    assert check_precision(MixedPrecision("bf16-mixed", "cpu")) == "bf16-mixed"
    assert check_precision(MixedPrecision("16-mixed", "cpu")) == "16-mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp = FSDPPrecision("16-mixed")
    with pytest.raises(PlanError, match="needs Lightning's MixedPrecision plugin, got FSDP"):
        check_precision(fsdp)


def _stepped_scaler() -> torch.amp.GradScaler:
    """A plain scaler with unusual settings, one finite step into its growth interval."""
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=3.0,
                                  backoff_factor=0.25, growth_interval=5)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    return scaler


def test_16_mixed_scaler_is_taken_over_with_its_settings_and_state():
    plugin = MixedPrecision("16-mixed", "cpu", scaler=_stepped_scaler())
    before = plugin.scaler.state_dict()
    executor = SimpleNamespace(loss_scale=None)
    scaler = install_loss_scaling(plugin, executor)
    assert isinstance(scaler, PipelineGradScaler)
    assert plugin.scaler is scaler
    assert scaler.state_dict() == before == {"scale": 8.0, "growth_factor": 3.0,
                                             "backoff_factor": 0.25, "growth_interval": 5,
                                             "_growth_tracker": 1}
    assert float(executor.loss_scale(torch.tensor(0.5))) == 4.0  # the loss times the scale
    again = SimpleNamespace(loss_scale=None)
    assert install_loss_scaling(plugin, again) is scaler  # a second fit keeps it
    assert again.loss_scale == scaler.scale


def test_precisions_without_a_scaler_clear_the_loss_scale_and_custom_scalers_are_refused():
    executor = SimpleNamespace(loss_scale=lambda t: t * 2)
    assert install_loss_scaling(MixedPrecision("bf16-mixed", "cpu"), executor) is None
    assert executor.loss_scale is None

    class Custom(torch.amp.GradScaler):
        pass

    plugin = MixedPrecision("16-mixed", "cpu", scaler=Custom("cpu"))
    with pytest.raises(PlanError, match="holds a Custom; AutoPipeStrategy needs a plain"):
        install_loss_scaling(plugin, executor)
