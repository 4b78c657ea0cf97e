"""The Lightning integration: the strategy and everything that touches Lightning.

Importing this package imports nothing heavy: ``lightning_autopipe`` imports ``_registry`` from
here at start-up to register ``"autopipe"``, and the strategy itself loads on first use.
"""
