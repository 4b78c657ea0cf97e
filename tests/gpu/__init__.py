"""Tests that need a CUDA device (``gpu`` marker; skipped without one)."""
