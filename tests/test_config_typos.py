"""A misspelt override names the nearest key (as ``AutoPipeStrategy(...)`` does), never an
"append it with +" hint that fails later; the recipe prints it as one line."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from lightning_autopipe.zoo.config import compose
from tests.recipes._run import run_in_process


@pytest.mark.parametrize(("override", "nearest"), [
    ("strategy.num_stage=2", "strategy.num_stages=2"),
    ("+strategy.num_stage=2", "strategy.num_stages=2"),
    ("trainer.max_step=3", "trainer.max_steps=3"),
    ("strategy.startup_slice=2", "strategy.startup_slices=2"),
])
def test_a_typo_names_the_nearest_key_not_the_append_hint(override, nearest):
    with pytest.raises(ConfigCompositionException) as info:
        compose("train_gpt", [override])
    message = str(info.value)
    assert f"did you mean {nearest}?" in message
    assert "To append" not in message
    assert "num_microbatches" in message or "max_epochs" in message  # the node's keys listed


def test_an_unknown_strategy_key_lists_the_keys_even_without_a_close_one():
    with pytest.raises(ConfigCompositionException, match="is not a key of strategy") as info:
        compose("train_gpt", ["strategy.zzzqqq=1"])
    assert "did you mean" not in str(info.value)


def test_appending_to_an_untyped_node_and_good_overrides_still_compose():
    cfg = compose("train_gpt", ["strategy.num_stages=2", "+cluster.note=x"])
    assert cfg.strategy.num_stages == 2


def test_the_recipe_prints_the_nearest_key_in_one_line(monkeypatch, capsys):
    err = run_in_process(monkeypatch, capsys, "train_gpt", ["strategy.num_stage=2"], status=2).err
    assert "did you mean strategy.num_stages=2?" in err
    assert "Traceback" not in err
