"""What every benchmark does with its finished table: print it, and write it to ``--out``."""

from __future__ import annotations

from pathlib import Path


def publish(table: str, out: str | Path | None) -> None:
    """Print ``table``; with ``out``, write it there too (its folder made when missing)."""
    print(table)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table + "\n")
