"""How tests start processes: a free port, the launch environment, and a script runner.

Every multi-process test goes through here, so a launched script always imports this
checkout, runs one intra-op thread, inherits none of the launching process's rank variables,
and is killed with all of its children when it overruns (nothing a test starts outlives it).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

__all__ = ["ROOT", "free_port", "init_gloo", "launch_env", "run_script"]

ROOT = Path(__file__).resolve().parents[1]

#: Variables a launcher sets per rank: a child must not inherit the test process's own.
_RANK_VARIABLES = (
    "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID", "AUTOPIPE_RUN_DIR",
    "AUTOPIPE_LAUNCHER_PID",
)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing uses right now, from below the
    system's ephemeral range where it can be found.

    A port the system hands out (``bind`` to 0) is one of the ephemeral ports that every
    outgoing connection on the machine also takes its local port from: in the seconds between
    finding it and rank 0 binding its store to it (the ranks import torch first), a gloo
    connection of a test running beside it could take it, and rank 0 died while the others
    waited out their start timeout. Below that range only an explicit ``bind`` takes a port.
    """
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(200 if low > _LOWEST + 1000 else 0):
        port = pick.randrange(_LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range (or all taken): the system's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The lowest port :func:`free_port` picks (above the well-known and common service ports).
_LOWEST = 10000


def _ephemeral_low() -> int:
    """The first port of the system's ephemeral range (Linux's default where it is unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60) -> None:
    """Join a ``world``-rank gloo group on the loopback ``port`` (a spawned test worker), one
    intra-op thread, every collective bounded by ``timeout_s``."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a test launches a script with: this checkout importable first, one
    thread, unbuffered output, no inherited rank variables, then ``extra``."""
    env = dict(os.environ)
    for key in _RANK_VARIABLES:
        env.pop(key, None)
    path = env.get("PYTHONPATH")
    env.update(PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def run_script(
    args: Sequence[str | Path],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path = ROOT,
    check: bool = True,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python *args`` in its own process group and return it finished.

    On overrunning ``timeout`` the whole group (a Lightning launcher's children included) is
    killed and the test fails with the output so far; with ``check`` a non-zero exit fails the
    test with the tails of both streams. With ``log`` the streams are written as they come to
    ``<log>.out`` and ``<log>.err``, so what a run printed survives when it is interrupted from
    outside (pytest's own timeout) and can be read while it runs.
    """
    cmd = [sys.executable, *map(str, args)]
    with contextlib.ExitStack() as files:
        if log is None:
            streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        else:
            streams = {name: files.enter_context(open(f"{log}.{name[3:]}", "w"))
                       for name in ("stdout", "stderr")}
        proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env) if env is not None else launch_env(),
                                text=True, start_new_session=True, **streams)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = _read_back(proc.communicate(), log)
            raise AssertionError(
                f"{' '.join(cmd[1:])} ran past {timeout:.0f} s and was killed\n--- stdout\n"
                f"{out[-4000:]}\n--- stderr\n{err[-8000:]}") from None
        finally:
            _kill_group(proc)  # a launcher that exited may leave children behind
    out, err = _read_back((out, err), log)
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and done.returncode:
        raise AssertionError(
            f"{' '.join(cmd[1:])} exited with {done.returncode}\n--- stdout\n{out[-4000:]}\n"
            f"--- stderr\n{err[-8000:]}")
    return done


def _read_back(piped: tuple[str | None, str | None], log: Path | None) -> tuple[str, str]:
    """Both streams' text: piped, or read from the ``log`` files."""
    if log is None:
        return piped[0] or "", piped[1] or ""
    return tuple(Path(f"{log}.{name}").read_text(errors="replace") for name in ("out", "err"))


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
