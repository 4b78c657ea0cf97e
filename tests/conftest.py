"""Tests run single-threaded in the pytest process: on a shared 2-core box, two intra-op
threads competing with other processes make every op wait for the slower thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
