"""``benchmarks/planner.py`` with measured profiles next to the FLOP-derived ones.

A measured profile (as ``benchmarks/gpu_check.sh`` writes one) is planned on the same clusters;
its rows say so in a ``costs`` column and their figures are the planner's own for that
profile. Without measured profiles the report says so and its table keeps the FLOP-only form.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import make_plan
from lightning_autopipe.profile import BlockProfile, Profile

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "NVIDIA H200 (cuda:0, bf16)"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("planner_bench", ROOT / "benchmarks/planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measured(tmp_path: Path) -> Profile:
    """A 12-block GPT-like profile as if measured on a GPU, saved where gpu_check puts it."""
    blocks = [
        BlockProfile(name=f"h.{i}", forward_ms=0.8 + 0.05 * (i % 3), backward_ms=1.7,
                     param_bytes=28 * 2**20, activation_bytes=12 * 2**20,
                     memory_bytes=90 * 2**20)
        for i in range(12)
    ]
    prof = Profile(model="gpt2", micro_batch_size=16, device=DEVICE, blocks=blocks)
    (tmp_path / "profiles").mkdir()
    prof.save(tmp_path / "profiles" / "gpt2.bf16.profile.json")
    return prof


def test_measured_profiles_are_planned_on_the_same_clusters_and_marked(bench, tmp_path, capsys):
    prof = _measured(tmp_path)
    out = tmp_path / "report.md"
    assert bench.main(["--profiles-dir", str(tmp_path), "--measured-only", "--quick",
                       "--quality-cases", "0", "--out", str(out)]) == 0
    report = out.read_text()
    assert report == capsys.readouterr().out.rstrip("\n") + "\n"
    assert f"--measured-only --profiles-dir {tmp_path} --quality-cases 0`" in report
    assert f"profiles measured on {DEVICE} (gpt2.bf16 under" in report
    lines = [line for line in report.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| case | costs | planner | iteration ms |")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[1:]]
    clusters = [c for c in bench.CLUSTERS if c != "mixed_64"]  # --quick
    assert [r[0] for r in rows if r[2] == "autopipe"] == [
        f"gpt2.bf16 / {c} (B=512)" for c in clusters
    ]
    assert {r[1] for r in rows} == {f"measured: {DEVICE}"}
    assert len(rows) == len(clusters) * len(bench.PLANNERS)
    for cname in clusters:  # AutoPipe's figure is the planner's own for that profile
        plan = make_plan(prof, Cluster.load(ROOT / "conf" / "cluster" / f"{cname}.yaml"), 512)
        auto = next(r for r in rows if r[0].endswith(f"/ {cname} (B=512)") and r[2] == "autopipe")
        assert auto[3] == f"{plan.iteration_ms:.1f}"
        assert auto[4] == "1.000"
    assert "measured costs:" in report  # the summary is given per kind of cost


def test_without_measured_profiles_the_report_says_so_and_keeps_its_form(
    bench, tmp_path, monkeypatch, capsys
):
    assert bench.measured_profiles(tmp_path) == {}
    assert bench.measured_profiles(tmp_path / "absent") == {}
    row = {"case": "m / c (B=8)", "planner": "autopipe", "iteration_ms": 10.0, "balance": 1.0,
           "search_ms": 1.0, "shape": "1x2 m1 k1", "costs": bench.FLOP}
    seen = {}

    def fake_run(quick, measured, flop):
        seen.update(quick=quick, measured=measured, flop=flop)
        return [row]

    monkeypatch.setattr(bench, "run", fake_run)
    assert bench.main(["--profiles-dir", str(tmp_path), "--quality-cases", "0"]) == 0
    report = capsys.readouterr().out
    assert seen == {"quick": False, "measured": {}, "flop": True}
    assert f"No measured profiles under `{tmp_path}`" in report
    assert "| case | planner | iteration ms | x AutoPipe |" in report  # no costs column
    assert "| m / c (B=8) | autopipe | 10.0 | 1.000 | 1.000 | 1 | 1x2 m1 k1 |" in report
    with pytest.raises(SystemExit):
        bench.main(["--profiles-dir", str(tmp_path), "--measured-only"])


def test_the_quality_table_finds_no_better_neighbour_of_autopipes_cuts(bench):
    lines = bench.quality(range(1000, 1001)).splitlines()
    assert lines[0].startswith("| schedule | cases | stages | blocks | improved by")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    assert [r[0] for r in rows] == ["1f1b", "zb-h1"]
    for r in rows:  # the simulator finds nothing better next to the partitioner's answer
        assert (r[1], r[4], r[5]) == ("1", "0", "0.00%")
