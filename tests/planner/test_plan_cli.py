"""``python -m lightning_autopipe plan``: JSON output, the table, errors, trace and saved plans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.planner import Plan, make_plan
from lightning_autopipe.planner.cli import plan_main
from lightning_autopipe.planner.report import format_plan
from lightning_autopipe.profile import BlockProfile, Profile

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("planner", "num_microbatches", "startup_slices", "stages", "iteration_ms",
        "bubble_fraction", "balance", "peak_memory_bytes", "search_ms")


@pytest.fixture
def profile_path(tmp_path):
    prof = Profile("toy", 2, "test",
                   [BlockProfile(f"layer{i}", 1.0 + i % 3, 2.0, 4096, 1024, 2048)
                    for i in range(10)])
    path = tmp_path / "profile.json"
    prof.save(path)
    return path


def _args(profile_path, *extra):
    return ["--profile", str(profile_path), "--cluster", "mixed_rack",
            "--global-batch-size", "64", *extra]


def test_json_output_is_one_object_with_the_documented_keys(profile_path, capsys):
    assert plan_main(_args(profile_path, "--json", "--stages", "3", "--replicas", "2")) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # exactly one JSON document: anything else would not parse
    for key in KEYS:
        assert key in data
    # auto may choose several stage chunks per rank: the JSON then says how many, and where
    v = data.get("chunks_per_rank", 1)
    assert ("placement" in data) == (v > 1)
    assert len(data["stages"]) == 3 * v
    assert [s["blocks"][0] for s in data["stages"]][0] == 0
    assert data["stages"][-1]["blocks"][1] == 10
    for a, b in zip(data["stages"], data["stages"][1:]):
        assert a["blocks"][1] == b["blocks"][0]
    stage_ms = [s["stage_ms"] for s in data["stages"]]
    assert data["balance"] == pytest.approx(max(stage_ms) / (sum(stage_ms) / len(stage_ms)))
    plan = Plan.from_dict(data)
    assert (plan.num_ranks, plan.num_stages, plan.chunks_per_rank) == (3, 3 * v, v)


def test_table_output_and_format_plan(profile_path, capsys):
    assert plan_main(_args(profile_path, "--planner", "time", "--micro-batches", "4")) == 0
    out = capsys.readouterr().out
    assert "plan (time)" in out
    assert "predicted iteration" in out
    assert "balance" in out
    prof = Profile.load(profile_path)
    plan = make_plan(prof, Cluster.load(ROOT / "conf/cluster/mixed_rack.yaml"), 64,
                     num_stages=2)
    table = format_plan(plan, prof)
    assert "layer0" in table
    assert len([ln for ln in table.splitlines() if ln.strip().startswith(("0 ", "1 "))]) == 2


def test_errors_exit_2_with_the_message(profile_path, capsys):
    assert plan_main(_args(profile_path, "--stages", "11")) == 2
    err = capsys.readouterr().err
    assert "10 blocks" in err
    assert "11 stages" in err
    assert plan_main(["--profile", str(profile_path) + ".missing", "--cluster", "mixed_rack",
                      "--global-batch-size", "8"]) == 2
    assert "cannot read profile" in capsys.readouterr().err


def test_an_unwritable_output_or_a_malformed_profile_exits_2_naming_it(profile_path, tmp_path,
                                                                        capsys):
    missing = tmp_path / "no" / "such" / "folder"
    for flag in ("--out", "--trace"):
        assert plan_main(_args(profile_path, flag, str(missing / "x.json"))) == 2
        err = capsys.readouterr().err
        assert f"cannot write {missing / 'x.json'}" in err
        assert "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "micro_batch_size": 4, "device": "cpu",
                               "blocks": None}))
    assert plan_main(["--profile", str(bad), "--cluster", "mixed_rack",
                      "--global-batch-size", "8"]) == 2
    assert "'blocks' must be a list" in capsys.readouterr().err


def test_the_local_cluster_and_unknown_names(profile_path, capsys):
    base = ["--profile", str(profile_path), "--global-batch-size", "8", "--json"]
    assert plan_main([*base, "--cluster", "local", "--world-size", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {d for s in plan["stages"] for d in s["devices"]} <= {"local:0", "local:1"}
    assert plan_main([*base, "--cluster", "local"]) == 2
    assert "--world-size N" in capsys.readouterr().err
    assert plan_main([*base, "--cluster", "local", "--world-size", "0"]) == 2
    assert "N >= 1" in (err := capsys.readouterr().err)
    assert "got --world-size 0" in err
    assert plan_main([*base, "--cluster", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "no cluster file 'nosuch'" in err
    assert "mixed_rack" in err
    # a misspelt name with --world-size: the name is what is wrong
    assert plan_main([*base, "--cluster", "mixed-rack", "--world-size", "2"]) == 2
    assert "no cluster file 'mixed-rack'" in capsys.readouterr().err
    assert plan_main([*base, "--cluster", "mixed_rack", "--world-size", "2"]) == 2
    assert "--world-size only applies to --cluster local" in capsys.readouterr().err


def test_trace_png_and_saved_plan(profile_path, tmp_path, capsys):
    trace, png, out = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "plan.json"
    assert plan_main(_args(profile_path, "--json", "--trace", str(trace), "--png", str(png),
                           "--out", str(out))) == 0
    printed = json.loads(capsys.readouterr().out)
    events = json.loads(trace.read_text())
    assert events  # a Chrome trace: a list of events or {"traceEvents": [...]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Plan.load(out).to_dict() == printed


@pytest.mark.one_child
def test_module_entry_point_prints_exactly_one_json_object(profile_path):
    cmd = [sys.executable, "-m", "lightning_autopipe", "plan", *_args(profile_path, "--json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["planner"] == "autopipe"


def test_a_cpu_profile_planned_on_a_gpu_cluster_warns(tmp_path, capsys):
    prof = Profile("toy", 2, "cpu", [BlockProfile(f"layer{i}", 1.0, 2.0, 4096, 1024, 2048)
                                     for i in range(10)])
    path = tmp_path / "cpu.json"
    prof.save(path)
    assert plan_main(_args(path, "--json")) == 0
    captured = capsys.readouterr()
    assert "warning: the profile was measured on 'cpu'" in captured.err
    assert "A100-40GB, V100-32GB" in captured.err
    json.loads(captured.out)  # stdout stays one JSON object
    assert plan_main(["--profile", str(path), "--cluster", "local", "--world-size", "2",
                      "--global-batch-size", "16"]) == 0
    assert "warning" not in capsys.readouterr().err  # this machine's own processes


def test_replicas_of_unlike_speed_get_uneven_batches_as_the_strategy_plans_them(profile_path,
                                                                              tmp_path, capsys):
    """Like ``search_plan`` (the strategy's), the CLI balances unlike replicas unless told."""
    import yaml

    from lightning_autopipe.cluster import Cluster

    data = Cluster.local(2).to_dict()
    data["servers"][0]["devices"] = {1: {"name": "slow", "speed": 0.5, "memory_gb": 16}}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(data))
    common = ["--profile", str(profile_path), "--cluster", str(path), "--global-batch-size",
              "32", "--stages", "1", "--replicas", "2", "--json"]
    assert plan_main(common) == 0
    balanced = json.loads(capsys.readouterr().out)
    assert plan_main([*common, "--even-replicas"]) == 0
    even = json.loads(capsys.readouterr().out)
    assert "replica_batches" not in even
    fast = balanced["stages"][0]["devices"].index("local:0")
    assert balanced["replica_batches"][fast] > balanced["replica_batches"][1 - fast]
    assert balanced["iteration_ms"] < even["iteration_ms"]
