"""An untraceable model's ``TraceError`` is the first thing a user reads, printed once.

In process: the tracers print nothing while they are tried (``torch.export`` would print its
graph per attempt and symbolic-shape warnings), unless ``AUTOPIPE_TRACE_LOGS=1``. On two real
ranks (``_untraceable_run.py``, uncaught, as a user's script): fewer than 40 lines come before
the error, whose message appears once; the other rank says one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_autopipe.errors import TraceError
from lightning_autopipe.graph.trace import TRACE_LOGS_ENV, trace
from tests._launch import launch_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "lightning" / "_untraceable_run.py"


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def _trace_output(capfd) -> tuple[str, TraceError]:
    with pytest.raises(TraceError) as info:
        trace(_Branchy(), (torch.randn(3, 4),))
    out, err = capfd.readouterr()
    return out + err, info.value


def test_the_tracers_print_nothing_while_tried_and_the_error_names_the_branch(
        capfd, monkeypatch):
    monkeypatch.delenv(TRACE_LOGS_ENV, raising=False)
    printed, error = _trace_output(capfd)
    assert printed.strip() == "", printed[:2000]
    assert "h.sum() > 0" in str(error)
    assert TRACE_LOGS_ENV in str(error)  # how to see what was hidden
    assert error.__cause__ is None  # no chained torch traceback of hundreds of lines


def test_the_tracers_logs_show_on_request(capfd, monkeypatch):
    monkeypatch.setenv(TRACE_LOGS_ENV, "1")
    printed, error = _trace_output(capfd)
    assert "def forward" in printed  # torch.export's own graph dump
    assert error.__cause__ is not None


@pytest.mark.slow
@pytest.mark.ranks  # starts ranks, asserts nothing on time
def test_two_ranks_print_the_trace_error_once_within_40_lines(tmp_path):
    env = launch_env()
    env.pop(TRACE_LOGS_ENV, None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    first = next((i for i, ln in enumerate(lines) if "TraceError" in ln), None)
    assert first is not None, "\n".join(lines[-80:])
    assert first < 40, "\n".join(lines[: first + 1])
    full = [ln for ln in lines if "cannot capture Branchy as a graph" in ln]
    assert len(full) == 1, "\n".join(lines)
    assert any("[rank 1] stopped with the TraceError" in ln for ln in lines), "\n".join(lines)
