"""torch and Lightning, imported by a launched test rank before anything else, with the garbage
collector paused.

The imports build hundreds of thousands of objects and free no cycles, so the collector's
passes over them are waste: a fifth of the import's CPU time on this class of machine (2.8-3.1
against 3.4-4.0 CPU-s for ``import lightning.pytorch``), paid by every rank of every launch.
"""

from __future__ import annotations

import gc

__all__ = ["import_the_stack"]


def import_the_stack() -> None:
    """Import torch and Lightning (once: later imports are lookups) and run one intra-op thread."""
    gc.disable()
    try:
        import lightning.pytorch  # noqa: F401
        import torch
    finally:
        gc.enable()
    torch.set_num_threads(1)
