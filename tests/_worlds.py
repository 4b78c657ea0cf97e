"""Shared Lightning worlds: one launch per world size runs every selected test module's cases.

A test module that needs Lightning on several ranks declares its cases,
``WORLD_CASES = {2: ["tests.lightning._run:ordinary", ...], 4: [...]}`` (runner module and case
name, run by :mod:`tests._world`), and reads the results through the session fixture
``worlds`` (``worlds.results(2, "tests.lightning._run", "ordinary")``). Only the cases of the
modules that pytest selected run, each world size is launched once, the smaller sizes first (a
case may read what a case of a smaller world wrote, e.g. a checkpoint to resume in another
layout), and a runner module may define ``prepare(world, folder)``, called here before the
launch (files the cases read).

Launching a Lightning world costs every rank its interpreter, torch and Lightning (seconds of
CPU each on this class of machine): sharing the launches is what keeps the suite short.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._launch import ROOT, launch_env, run_script

__all__ = ["Worlds", "collect_cases"]

#: Seconds a launch may take: start-up plus a budget per case (a case that hangs is bounded
#: by its own strategy timeout well inside this).
_BASE_S, _PER_CASE_S = 120.0, 60.0
#: ... and at most this, inside pytest's own per-test timeout (pyproject.toml, 600 s): the
#: launch is killed here, with the cases' progress in the failure, not interrupted from outside.
_MOST_S = 540.0


def collect_cases(modules: Iterable[Any]) -> dict[int, list[str]]:
    """The ``WORLD_CASES`` of ``modules`` merged per world size, in the modules' order, those
    with a higher ``WORLD_ORDER`` (default 50) later."""
    out: dict[int, list[str]] = {}
    for module in sorted(modules, key=lambda m: getattr(m, "WORLD_ORDER", 50)):
        for world, specs in getattr(module, "WORLD_CASES", {}).items():
            bucket = out.setdefault(int(world), [])
            bucket.extend(s for s in specs if s not in bucket)
    return out


class Worlds:
    """Launches each world size on first use and hands its cases' results to the tests."""

    def __init__(self, root: Path, cases: dict[int, list[str]]) -> None:
        self.root = root
        self.cases = cases
        self._logs: dict[int, str] = {}

    def folder(self, world: int, module: str) -> Path:
        """Where ``module``'s cases on ``world`` ranks wrote their files (launched if needed)."""
        self._launch(world)
        return self.root / f"w{world}" / module

    def log(self, world: int) -> str:
        return self._logs.get(world, "")

    def results(self, world: int, module: str, case: str, *, weights_only: bool = False
                ) -> list[dict]:
        """Every rank's saved record of ``case`` (rank order); a missing one fails the test
        with the case's error or the launch's log."""
        folder = self.folder(world, module)
        out = []
        for r in range(world):
            path = folder / f"{case}.rank{r}.pt"
            if not path.exists():
                self.fail(world, module, case)
            out.append(torch.load(path, weights_only=weights_only))
        return out

    def fail(self, world: int, module: str, case: str) -> None:
        folder = self.root / f"w{world}" / module
        errors = sorted(folder.glob(f"{case}.error.rank*.txt"))
        detail = "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in errors)
        pytest.fail(f"case {module}:{case} on {world} ranks left no result\n"
                    f"{detail or self.log(world)[-8000:]}")

    def _launch(self, world: int) -> None:
        for size in sorted(self.cases):
            if size > world:
                break
            if size in self._logs:
                continue
            specs = self.cases[size]
            out = self.root / f"w{size}"
            for module in dict.fromkeys(s.partition(":")[0] for s in specs):
                folder = out / module
                folder.mkdir(parents=True, exist_ok=True)
                prepare = getattr(importlib.import_module(module), "prepare", None)
                if prepare is not None:
                    prepare(size, folder)
            log = out / "launch"  # launch.out, launch.err: each case's start and end per rank
            try:
                proc = run_script([ROOT / "tests" / "_world.py", out, size, *specs],
                                  timeout=min(_BASE_S + _PER_CASE_S * len(specs), _MOST_S),
                                  env=launch_env(), cwd=out, check=False, log=log)
            except AssertionError as exc:  # overran: killed, with its output in the message
                self._logs[size] = str(exc)
                continue
            except BaseException:  # interrupted (pytest's timeout): no second launch either
                self._logs[size] = ("the launch was interrupted\n--- stderr\n"
                                    + Path(f"{log}.err").read_text(errors="replace")[-12000:])
                raise
            self._logs[size] = (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                f"--- stderr\n{proc.stderr[-12000:]}")
