"""One source of options: the strategy's arguments, the Hydra schema and the shipped YAML agree.

Also: keyword arguments and a ready ``AutoPipeOptions`` build the same strategy, and bad values
fail at construction naming the value and the fix.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_autopipe import AutoPipeStrategy
from lightning_autopipe.errors import OptionError, PlanError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.zoo.config import CONF_DIR, AutoPipeStrategyConfig, compose

OPTIONS = {f.name: f.default for f in dataclasses.fields(AutoPipeOptions)}


def test_every_option_has_one_default_in_the_strategy_the_schema_and_the_yaml():
    schema = {f.name: f.default for f in dataclasses.fields(AutoPipeStrategyConfig)}
    shipped = yaml.safe_load((CONF_DIR / "strategy" / "autopipe.yaml").read_text())
    for meta in ("_target_", "defaults"):
        schema.pop(meta, None)
        shipped.pop(meta, None)
    assert set(schema) == set(OPTIONS), "the schema lacks or adds options"
    assert set(shipped) == set(OPTIONS), "conf/strategy/autopipe.yaml lacks or adds options"
    assert AutoPipeStrategy().options == AutoPipeOptions()
    for name, default in OPTIONS.items():
        assert schema[name] == default, f"schema default of {name}"
        assert shipped[name] == default, f"conf/strategy/autopipe.yaml value of {name}"
    assert OPTIONS["timeout"] == 120.0  # README: "the strategy's `timeout` (default 120 s)"


def test_the_composed_strategy_config_instantiates_the_default_options():
    cfg = compose("train_gpt", ["strategy=autopipe"]).strategy
    values = OmegaConf.to_container(cfg, resolve=True)
    assert values.pop("_target_") == "lightning_autopipe.AutoPipeStrategy"
    assert AutoPipeStrategy(**values).options == AutoPipeOptions()
    pinned = compose("train_gpt", ["strategy.num_stages=2", "strategy.timeout=30"]).strategy
    assert (pinned.num_stages, pinned.timeout) == (2, 30.0)


def test_keywords_and_an_options_object_build_the_same_strategy():
    want = AutoPipeOptions(num_stages=2, timeout=30.0, checkpoint_format="sharded")
    by_keyword = AutoPipeStrategy(
        num_stages=2, timeout=timedelta(seconds=30), checkpoint_format="sharded"
    )
    assert by_keyword.options == want
    assert AutoPipeStrategy(want).options == want
    assert AutoPipeStrategy(AutoPipeOptions(num_stages=2), timeout=30,
                            checkpoint_format="sharded").options == want
    assert want.pins == {"num_stages": 2, "num_microbatches": None, "startup_slices": None,
                         "drain_slices": None}
    assert want.timeout_delta == timedelta(seconds=30)
    assert AutoPipeOptions(bucket_mb=1).bucket_bytes == 2**20


def test_an_unknown_option_is_named_with_the_close_one():
    with pytest.raises(TypeError, match=r"unknown options \['num_stagez'\] .*'num_stages'"):
        AutoPipeStrategy(num_stagez=2)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"start_method": "thread"}, OptionError, r"'popen', 'spawn', 'fork' or .* not 'thread'"),
        ({"num_stages": 0}, PlanError, r"num_stages must be 'auto' or a positive int, got 0"),
        ({"startup_slices": "two"}, PlanError, r"startup_slices .* got 'two'"),
        ({"drain_slices": True}, PlanError, r"drain_slices .* got True"),
        ({"timeout": 0}, OptionError, r"timeout must be positive seconds, got 0"),
        ({"timeout": "soon"}, OptionError, r"timeout must be positive seconds, got 'soon'"),
        ({"checkpoint_format": "zip"}, OptionError, r"one of \('consolidated', 'sharded'\)"),
        ({"nonfinite_loss": "ignore"}, OptionError, r"one of \('raise', 'skip'\), not 'ignore'"),
        ({"replan": "on"}, OptionError, r"replan must be one of \('auto', 'off'\), not 'on'"),
        ({"replan_threshold": 1.5}, OptionError, r"replan_threshold must be a fraction .* 1.5"),
        ({"replan_threshold": -0.1}, OptionError, r"replan_threshold .* not -0.1"),
        ({"replan_window": 0}, OptionError, r"replan_window must be a positive .* not 0"),
        ({"replan_min_steps": 2.5}, OptionError, r"replan_min_steps .* not 2.5"),
        ({"optimizer_state": -1}, OptionError, r"optimizer_state must be 'auto' or .* not -1"),
        ({"optimizer_state": "adam"}, OptionError, r"plain SGD 0\), not 'adam'"),
        ({"planner": "autopip"}, OptionError, r"planner must be one of .* \(did you mean "
                                              r"'autopipe'\?\)"),
        ({"granularity": "layers"}, OptionError, r"not 'layers' \(did you mean 'layer'\?\)"),
        ({"profile_repeats": 0}, OptionError, r"profile_repeats must be a positive integer"),
        ({"bucket_mb": -1}, OptionError, r"bucket_mb must be a positive number of MiB, got -1"),
    ],
)
def test_bad_options_fail_at_construction_with_the_value_and_the_fix(options, error, match):
    with pytest.raises(error, match=match):
        AutoPipeOptions(**options)
    with pytest.raises(error, match=match):
        AutoPipeStrategy(**options)


def test_a_misspelt_compile_backend_is_refused_by_the_strategy():
    """The options stay free of torch; the strategy checks the backend's name when it is
    made, not every rank when it compiles its stage after profiling."""
    with pytest.raises(OptionError, match=r"names no torch.compile backend \(did you mean "
                                          r"'inductor'\?\)"):
        AutoPipeStrategy(compile="inductr")
    AutoPipeStrategy(compile="aot_eager")
