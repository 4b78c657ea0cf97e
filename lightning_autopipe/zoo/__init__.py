"""Recipes support: the model zoo, data modules, training tasks and typed Hydra configs.

Not part of the strategy library: ``recipes/`` and ``conf/`` build on it, and it needs the
``recipes`` extra (``pip install "lightning_autopipe[recipes]"``: Hydra, transformers,
torchvision, matplotlib).
"""
