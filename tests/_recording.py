"""A Lightning logger that keeps every logged metric, for launches that compare losses."""

from __future__ import annotations

from lightning.pytorch.loggers import Logger


class RecordingLogger(Logger):
    """Keeps every logged metric (Lightning logs from rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "rec"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))
