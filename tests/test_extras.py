"""A feature whose optional package is missing says which extra brings it."""

from __future__ import annotations

import sys

import pytest

from lightning_autopipe.errors import MissingExtraError
from lightning_autopipe.extras import import_extra


def test_a_missing_extra_names_the_extra_and_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    with pytest.raises(MissingExtraError, match=r'lightning_autopipe\[recipes\].*transformers'):
        import_extra("transformers", "Hugging Face models")


def test_the_zoo_raises_it_for_a_hugging_face_model(monkeypatch):
    from lightning_autopipe.zoo.models import build_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtraError, match="Hugging Face models needs 'transformers'"):
        build_model("gpt2", "tiny", 2)


def test_an_installed_extra_is_the_module_itself():
    import yaml

    assert import_extra("yaml", "cluster files") is yaml
