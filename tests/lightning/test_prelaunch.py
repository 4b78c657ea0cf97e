"""Setup mistakes are raised in the launching process, before any rank starts (no processes).

``trainer.fit`` runs in this process with Lightning's own launchers; ``subprocess.Popen`` and
the multiprocessing start are replaced by a recorder, so a launch (the ~25 s of process starts
and distributed initialisation the checks save) would be seen, and the error must come first.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher
from lightning.pytorch.strategies.launchers import subprocess_script

from lightning_autopipe import AutoPipeStrategy
from lightning_autopipe.errors import ClusterError, PlanError
from lightning_autopipe.lightning.prelaunch import check_before_launch
from lightning_autopipe.options import AutoPipeOptions
from tests.lightning import _module as M


class _NoLaunch:
    """Stands in for ``subprocess.Popen`` / the multiprocessing start: records every start."""

    def __init__(self) -> None:
        self.starts: list = []

    def __call__(self, *args, **kwargs):
        self.starts.append(args)
        raise AssertionError("a process was started before the configuration was checked")


@pytest.fixture
def no_launch(monkeypatch):
    recorder = _NoLaunch()
    monkeypatch.setattr(subprocess_script.subprocess, "Popen", recorder)
    monkeypatch.setattr(mp_launcher.mp, "get_context", recorder)
    monkeypatch.setattr(mp_launcher.mp, "start_processes", recorder)
    return recorder


def _fit(strategy: AutoPipeStrategy, devices: int = 2, **trainer_kwargs) -> None:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=1, **trainer_kwargs)
    loaders = M.loaders(1, explicit_sampler=False)
    trainer.fit(M.Classifier(), loaders["train"])


def _bad_cluster(tmp_path, text: str):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_num_stages_not_dividing_the_devices_is_refused_before_launch(no_launch, start_method):
    with pytest.raises(PlanError, match=r"num_stages=2 does not divide the 3 launched"):
        _fit(AutoPipeStrategy(num_stages=2, start_method=start_method), devices=3)
    assert no_launch.starts == []


def test_unreadable_cluster_file_is_refused_before_launch(no_launch, tmp_path):
    path = _bad_cluster(tmp_path, "name: x\nservers:\n  - {type: nope, count: 1}\n  [\n")
    with pytest.raises(ClusterError, match="cluster.yaml"):
        _fit(AutoPipeStrategy(cluster=path))
    assert no_launch.starts == []


def test_cluster_file_with_too_few_devices_is_refused_before_launch(no_launch, tmp_path):
    path = _bad_cluster(tmp_path, (
        "name: tiny\nservers:\n  - name: s\n    gpus: 1\n"
        "    device: {name: cpu, speed: 1.0, memory_gb: 8}\n"))
    with pytest.raises(ClusterError):
        _fit(AutoPipeStrategy(cluster=path), devices=2)
    assert no_launch.starts == []


def test_good_configuration_passes_the_checks():
    """The checks refuse only what is wrong: a divisor depth and a fitting cluster pass."""
    check_before_launch(AutoPipeOptions(num_stages=2), world_size=4, num_nodes=1)
    check_before_launch(AutoPipeOptions(num_stages="auto"), world_size=3, num_nodes=1)
    with pytest.raises(PlanError, match="num_stages=4"):
        check_before_launch(AutoPipeOptions(num_stages=4), world_size=6, num_nodes=1)


def test_manual_optimization_is_refused_before_launch(no_launch):
    class Manual(M.Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(strategy=AutoPipeStrategy(), accelerator="cpu", devices=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(PlanError, match="automatic optimization"):
        trainer.fit(Manual(), M.loaders(1, explicit_sampler=False)["train"])
    assert no_launch.starts == []
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", ["StochasticWeightAveraging", "EMAWeightAveraging",
                                  "ModelPruning"])
def test_callbacks_of_the_whole_models_weights_are_refused_before_launch(no_launch, name):
    """SWA and EMA average a copy of the whole model with the module's parameters, ModelPruning
    prunes every module's weight at an epoch's end, one stage each after the split: refused
    with the reason and the fix, not a shape or type error at the first update."""
    from lightning.pytorch import callbacks

    made = {"StochasticWeightAveraging": lambda: callbacks.StochasticWeightAveraging(0.01),
            "EMAWeightAveraging": lambda: callbacks.EMAWeightAveraging(decay=0.9),
            "ModelPruning": lambda: callbacks.ModelPruning("l1_unstructured", amount=0.5)}
    said = "WeightAveraging" if name == "EMAWeightAveraging" else name
    with pytest.raises(PlanError, match=f"{said} does not run under.*remove the callback"):
        _fit(AutoPipeStrategy(), callbacks=[made[name]()])
    assert no_launch.starts == []


def test_an_averaged_copy_of_the_model_inside_the_module_is_refused_before_launch(no_launch):
    """``self.ema = AveragedModel(self.net)``: its updates zip the whole copy's parameters with
    one stage's (a shape error on one rank, a released buffer on another)."""
    from torch.optim.swa_utils import AveragedModel

    class Averaging(M.Classifier):
        def __init__(self):
            super().__init__()
            self.ema = AveragedModel(self.net)

    trainer = pl.Trainer(strategy=AutoPipeStrategy(), accelerator="cpu", devices=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(PlanError, match=r"holds an AveragedModel \(ema\).*remove it"):
        trainer.fit(Averaging(), M.loaders(1, explicit_sampler=False)["train"])
    assert no_launch.starts == []


def test_devices_unlike_what_torchrun_started_names_the_devices_not_the_stages(no_launch,
                                                                               monkeypatch):
    """torchrun started 2 processes, the Trainer says devices=1: Lightning's own check names
    the setting to fix; the plan's check ran first and blamed num_stages=2 ("does not divide
    the 1 launched processes"), although 2 were launched."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"devices=1.*does not match the world size \(2\)"):
        _fit(AutoPipeStrategy(num_stages=2), devices=1)
    assert no_launch.starts == []
