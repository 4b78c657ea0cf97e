"""``--plan-only`` prints the plan table with its device-type column (as a training run does)."""

from __future__ import annotations

from pathlib import Path

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.profile import BlockProfile, Profile

ROOT = Path(__file__).resolve().parents[2]


def test_plan_only_table_keeps_the_device_type_column(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from _plan import show_plan

    profile = Profile("toy", 2, "test", [BlockProfile(f"layer{i}", 1.0 + i % 3, 2.0, 4096,
                                                      1024, 2048) for i in range(8)])
    cluster = Cluster.load(ROOT / "conf" / "cluster" / "mixed_rack.yaml")
    plan = make_plan(profile, cluster, 96, num_stages=2)
    show_plan(plan, profile, cluster, tmp_path, table=True)
    out = capsys.readouterr().out
    assert "device type (speed)" in out
    assert "x the reference" in out


def test_the_recipes_progress_bar_shows_no_v_num(tmp_path, monkeypatch):
    """The loggers' version is the folder name ``csv``: not a number to show in the bar."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from _common import _progress_bars

    assert _progress_bars({"enable_progress_bar": False}) == []
    (bar,) = _progress_bars({"enable_progress_bar": True})
    logger = CSVLogger(str(tmp_path), name="", version="csv")
    trainer = pl.Trainer(logger=logger, callbacks=[bar], accelerator="cpu", devices=1)
    assert "v_num" in TQDMProgressBar().get_metrics(trainer, None)  # Lightning's own bar
    assert "v_num" not in bar.get_metrics(trainer, None)
