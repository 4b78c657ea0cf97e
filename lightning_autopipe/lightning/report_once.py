"""An error every rank raises alike is printed in full once (by rank 0), one line elsewhere.

Every rank traces the model, so an untraceable model raises the same ``TraceError`` on every
rank (none waits in a collective for another); an error rank 0 found while planning is
re-raised on the others with its message. Printed by every process, the same traceback
appears once per rank. A ``TraceError`` is shown from the strategy's ``setup`` down (the
frames below are the package's own; its message names the user's construct), unless the
tracers' logs were asked for (then its cause is chained and every frame kept). Ranks other
than 0 mark such an error while the pipeline is built and their ``sys.excepthook`` prints one
line naming it instead of the traceback; every other exception, and every exception a script
catches, is untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from lightning_autopipe.errors import AutoPipeError, InputError, TraceError

__all__ = ["install_excepthook", "shown_by_rank_zero"]

_MARK = "_autopipe_shown_by_rank_zero"
_RANK0_PREFIX = "(raised on rank 0)"


def shown_by_rank_zero(rank: int, build: Callable[[], Any]) -> Any:
    """``build()``; on ``rank`` > 0 an error rank 0 raises too (the trace's, rank 0's plan's)
    is marked for :func:`install_excepthook`."""
    try:
        return build()
    except AutoPipeError as exc:
        alike = isinstance(exc, TraceError | InputError) or str(exc).startswith(_RANK0_PREFIX)
        if rank > 0 and alike:
            setattr(exc, _MARK, rank)
        if isinstance(exc, TraceError) and exc.__cause__ is None:
            # The frames from here down to the tracer are the package's own; the message
            # names the user's construct. Shown from here, the error is the first screen.
            raise exc.with_traceback(None) from None
        raise


def install_excepthook() -> None:
    """Print a marked error as one line (idempotent; other exceptions go to the old hook)."""
    previous = sys.excepthook
    if getattr(previous, "_autopipe", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        rank = getattr(exc, _MARK, None)
        if rank is None:
            previous(kind, exc, tb)
            return
        print(f"[rank {rank}] stopped with the {kind.__name__} that rank 0 prints in full",
              file=sys.stderr)

    hook._autopipe = True  # type: ignore[attr-defined]
    sys.excepthook = hook
