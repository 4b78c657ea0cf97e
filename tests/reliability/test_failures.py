"""A failing rank ends the whole Lightning job, and the user is told which rank and why.

Each case is one 2-rank launch (2 stages, or one stage on two replicas) of
``tests/reliability/_run.py`` in which rank ``r`` fails at global step 2: an exception in its
stage's forward, SIGKILL, or a hang (the launches run side by side). The job must end (every
rank's process gone) with a non-zero status, within the strategy timeout of the failure (a hang
can only be noticed when the timeout expires, so there: shortly after it).
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


#: Each test's launch, ``fail_<how>_rank<r>``: the hang, then the two started beside it.
HANG = "fail_hang_rank1"
BESIDE_THE_HANG = ("fail_raise_rank1", "fail_kill_rank0", "fail_hang_rank1_dp")


class _Launch:
    """One failure case's 2-rank launch, watched until every one of its processes is gone."""

    def __init__(self, out: Path, case: str) -> None:
        self.out = out
        self.log = out / "output.log"
        with open(self.log, "w") as f:  # a file, not a pipe: lingering children must not block
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "2", case],
                                         cwd=ROOT, env=launch_env(), stdout=f,
                                         stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        self.exited: float | None = None  # monotonic, when the launcher was seen gone
        self.ended: float | None = None  # wall clock when the launcher and its ranks were gone
        self.lingering: list[int] = []

    def _pids(self) -> list[int]:
        texts = [f.read_text() for f in (self.out / f"pid.rank{r}" for r in range(2))
                 if f.exists()]
        return [int(t) for t in texts if t]

    def poll(self) -> bool:
        """True once ended (the launcher exited and no rank outlives it by more than 60 s)."""
        if self.ended is not None:
            return True
        if self.proc.poll() is None and time.monotonic() - self.started < 300:
            return False
        self.proc.kill()  # a no-op when it exited; a launcher past 300 s ends here
        self.proc.wait()
        if self.exited is None:
            self.exited = time.monotonic()
        alive = [p for p in self._pids() if _alive(p)]
        if alive and time.monotonic() - self.exited < 60:
            return False
        self.ended, self.lingering = time.time(), alive
        for p in alive:
            psutil.Process(p).kill()
        return True

    def result(self) -> tuple[int, str, float]:
        """(exit status, all output, seconds from the failure to the job's end)."""
        out = self.log.read_text()
        assert not self.lingering, f"ranks {self.lingering} outlived the job:\n{out[-3000:]}"
        marker = self.out / "injected_at"
        assert marker.exists(), f"the job ended before the failure was injected:\n{out[-3000:]}"
        return self.proc.returncode, out, self.ended - float(marker.read_text())


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Launch]:
    """The failure launches side by side: most of a hang's launch is its timeout, in
    which its ranks sleep, so the other two start when the hang is injected and start up in
    that idle time. Each launch's time to end is taken from its own failure and each is
    watched on its own (polled together), so one that ends first is timed when it ends."""
    hang = _Launch(tmp_path_factory.mktemp(HANG), HANG)
    # the others start once the hang is injected: their start-up fills its timeout's idle cores
    while not (hang.out / "injected_at").exists() and not hang.poll():
        time.sleep(0.2)
    launches = {case: _Launch(tmp_path_factory.mktemp(case), case) for case in BESIDE_THE_HANG}
    launches[HANG] = hang
    while not all([launch.poll() for launch in launches.values()]):
        time.sleep(0.2)
    return launches


def test_exception_in_a_stage_forward_ends_the_job_naming_rank_and_cause(failures):
    rc, out, took = failures["fail_raise_rank1"].result()
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


def test_sigkill_of_a_rank_ends_the_job(failures):
    rc, out, took = failures["fail_kill_rank0"].result()
    assert rc != 0  # the launching rank itself was killed
    assert took < FAIL_TIMEOUT["kill"], f"the job ended {took:.1f} s after the kill"
    assert "rank 1 (stage 1, replica 0): receive of activations 1RF0.0 with rank 0 failed" in out
    assert "rank 0 has probably died or hung" in out


def test_a_hung_rank_is_timed_out_and_the_job_ends(failures):
    rc, out, took = failures["fail_hang_rank1"].result()
    timeout = FAIL_TIMEOUT["hang"]
    assert rc != 0
    assert timeout <= took < timeout + AFTER_TIMEOUT_S, f"the job ended {took:.1f} s after"
    assert f"Timed out waiting {timeout * 1000}ms for recv operation" in out
    assert f"rank 1 has probably died or hung (timeout {timeout} s)" in out
    assert "[rank 1] the launching process" in out  # the orphan watchdog ended the hung rank


def test_a_hung_replica_is_named_by_the_replica_that_waits_for_it(failures):
    """One stage on two replicas: rank 0 waits for rank 1 in a collective over the replicas
    (not a receive from a neighbour stage), and names rank 1, not itself."""
    rc, out, took = failures["fail_hang_rank1_dp"].result()
    timeout = FAIL_TIMEOUT["hang"]
    assert rc != 0
    assert timeout <= took < timeout + AFTER_TIMEOUT_S, f"the job ended {took:.1f} s after"
    assert "rank 0 (stage 0, replica 0): " in out
    assert f"rank 1 has probably died or hung (timeout {timeout} s)" in out
    assert "rank 0 has probably died" not in out
