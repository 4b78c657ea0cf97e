"""Messages from the runtime, said once (on global rank 0), without importing Lightning.

The runtime runs under the Lightning strategy, under plain ``torch.distributed`` scripts and in
the benchmarks, so it cannot use Lightning's rank-zero helpers; it logs to the
``lightning_autopipe`` logger, which prints at INFO unless the application configured it.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch.distributed as dist

__all__ = ["LOGGER", "global_rank", "rank_zero_info", "rank_zero_warn"]

LOGGER = logging.getLogger("lightning_autopipe")
if not LOGGER.handlers:  # like Lightning's own logger: visible by default, configurable
    LOGGER.addHandler(logging.StreamHandler())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def global_rank() -> int:
    """This process's global rank: the process group's, else the launcher's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def rank_zero_info(message: str) -> None:
    """Log ``message`` at INFO on global rank 0 only."""
    if global_rank() == 0:
        LOGGER.info(message)


def rank_zero_warn(message: str, stacklevel: int = 3) -> None:
    """Warn (``UserWarning``) on global rank 0 only."""
    if global_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
