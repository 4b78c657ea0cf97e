"""A failing rank ends the whole Lightning job, and the user is told which rank and why.

Each case is one 2-rank launch (2 stages) of ``tests/reliability/_run.py`` in which rank ``r``
fails at global step 2: an exception in its stage's forward, SIGKILL, or a hang. The job must
end (every rank's process gone) with a non-zero status, within the strategy timeout of the
failure (a hang can only be noticed when the timeout expires, so there: shortly after it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests._launch import launch_env
from tests.reliability._run import FAIL_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "reliability" / "_run.py"
# Ending after a hang: the timeout, then the launcher's exit and the orphan watchdog (~1 s).
AFTER_TIMEOUT_S = 15.0

pytestmark = [pytest.mark.slow, pytest.mark.launch]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_failure(tmp_path: Path, case: str) -> tuple[int, str, float]:
    """Launch ``case``; returns (exit status, all output, seconds from failure to job end)."""
    log = tmp_path / "output.log"
    with open(log, "w") as f:  # a file, not a pipe: lingering children must not block us
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "2", case],
                                cwd=ROOT, env=launch_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=300)
        finally:
            proc.kill()
    pids = [int((tmp_path / f"pid.rank{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    ended = time.time()
    lingering = [p for p in pids if _alive(p)]
    for p in lingering:
        psutil.Process(p).kill()
    assert not lingering, f"ranks {lingering} outlived the job:\n{log.read_text()[-3000:]}"
    marker = tmp_path / "injected_at"
    assert marker.exists(), (
        f"the job ended before the failure was injected:\n{log.read_text()[-3000:]}")
    injected = float(marker.read_text())
    return rc, log.read_text(), ended - injected


def test_exception_in_a_stage_forward_ends_the_job_naming_rank_and_cause(tmp_path):
    rc, out, took = _run_failure(tmp_path, "fail_raise_rank1")
    assert rc != 0
    assert took < FAIL_TIMEOUT["raise"], f"the job ended {took:.1f} s after the failure"
    original = "ValueError: injected failure in the stage's forward"
    assert (
        f"PipelineRuntimeError: rank 1 (stage 1, replica 0) failed in forward 1F0.0 of "
        f"training step 2: {original}" in out
    )
    # the other rank does not just time out: it names rank 1 and the original exception
    assert "rank 0 (stage 0, replica 0) stopped in receive of gradients" in out
    assert "because rank 1 (stage 1, replica 0) failed in forward 1F0.0" in out


def test_sigkill_of_a_rank_ends_the_job(tmp_path):
    rc, out, took = _run_failure(tmp_path, "fail_kill_rank0")
    assert rc != 0  # the launching rank itself was killed
    assert took < FAIL_TIMEOUT["kill"], f"the job ended {took:.1f} s after the kill"
    assert "rank 1 (stage 1, replica 0): receive of activations 1RF0.0 with rank 0 failed" in out
    assert "rank 0 has probably died or hung" in out


def test_a_hung_rank_is_timed_out_and_the_job_ends(tmp_path):
    rc, out, took = _run_failure(tmp_path, "fail_hang_rank1")
    timeout = FAIL_TIMEOUT["hang"]
    assert rc != 0
    assert timeout <= took < timeout + AFTER_TIMEOUT_S, f"the job ended {took:.1f} s after"
    assert f"Timed out waiting {timeout * 1000}ms for recv operation" in out
    assert f"rank 1 has probably died or hung (timeout {timeout} s)" in out
    assert "[rank 1] the launching process" in out  # the orphan watchdog ended the hung rank
