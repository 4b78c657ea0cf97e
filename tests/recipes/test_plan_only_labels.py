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
