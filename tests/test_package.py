"""Importing the package: "autopipe" is registered whichever of it and Lightning comes first,
and the profile data type the planner reads loads without torch (fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# one fresh interpreter at a time, no ranks: beside the other shard (tests/_machine.py)
pytestmark = pytest.mark.one_child

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_profile_data_type_imports_without_torch():
    _fresh("import sys, lightning_autopipe.profile\n"
           "assert 'torch' not in sys.modules, 'lightning_autopipe.profile imported torch'")


@pytest.mark.parametrize("first", ["lightning_autopipe", "lightning.pytorch"])
def test_importing_the_package_registers_autopipe_before_or_after_lightning(first):
    second = "lightning.pytorch" if first == "lightning_autopipe" else "lightning_autopipe"
    _fresh(
        f"import {first}\n"
        f"import {second}\n"
        "import lightning.pytorch as pl\n"
        "from lightning_autopipe import AutoPipeStrategy\n"
        "trainer = pl.Trainer(strategy='autopipe', accelerator='cpu', devices=1, logger=False)\n"
        "assert type(trainer.strategy) is AutoPipeStrategy, type(trainer.strategy)\n"
    )


def test_every_public_name_and_submodule_is_an_attribute_of_the_package():
    _fresh(
        "import lightning_autopipe as la\n"
        "assert callable(la.checkpoint.read_model_state)\n"  # a submodule not yet imported
        "missing = [n for n in la.__all__ if getattr(la, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(la.__all__) <= set(dir(la))\n"
        "try:\n"
        "    la.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
