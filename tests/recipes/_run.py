"""Run recipes as separate processes (Lightning's launcher re-runs the command line, so a
multi-rank run must never be started from inside pytest) and read what they logged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._launch import launch_env

ROOT = Path(__file__).resolve().parents[2]

# The tiniest GPT that still has blocks to pipeline: every override is one the README shows.
TINY_GPT = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.max_seq_len=16",
    "data.batch_size=8",
    "data.max_bytes=40000",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]


def env() -> dict[str, str]:
    return launch_env()


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``python <args>`` from the repository root; fail with its output on error."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode:
        raise AssertionError(
            f"{' '.join(args)} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_in_process(monkeypatch, capsys, recipe: str, argv: list[str], status: int = 0):
    """Run ``recipes/<recipe>.py argv`` inside pytest (plan-only runs, one-process runs and
    refused configurations: nothing launched); asserts its exit ``status`` and returns what it
    printed (``.out``, ``.err``)."""
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    # setenv (not delenv) so that what the recipe exports is undone after the test
    monkeypatch.setenv("AUTOPIPE_RUN_DIR", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # seed_everything exports these
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    from _common import run_recipe

    assert run_recipe(recipe, argv) == status
    return capsys.readouterr()


def losses(run_dir: Path, key: str = "train_loss") -> dict[int, float]:
    """``{step: value}`` of ``key`` in the run's CSV log."""
    import csv

    out = {}
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key):
                out[int(row["step"])] = float(row[key])
    return out


