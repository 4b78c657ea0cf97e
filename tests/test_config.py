"""Every YAML under conf/ composes, its objects instantiate, and typos are errors."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.zoo.config import CONF_DIR, GPTModelConfig, build_cluster, compose

RECIPES = ("train_gpt", "train_bert", "train_resnet")


def _recipe_for(group: str, option: str) -> str:
    """The recipe an option belongs to (shared groups compose with the GPT recipe)."""
    if group == "cluster" or group in ("strategy", "trainer"):
        return "train_gpt"
    text = f"{group}/{option}"
    if "bert" in text or "mlm" in text or "masked" in text:
        return "train_bert"
    if "resnet" in text or "image" in text:
        return "train_resnet"
    return "train_gpt"


def _options() -> list[tuple[str, str]]:
    return sorted(
        (path.parent.name, path.stem)
        for path in CONF_DIR.glob("*/*.yaml")
    )


def test_every_group_option_exists_for_each_required_name():
    found = set(_options())
    for group, names in {
        "model": ["gpt_tiny", "gpt_small", "gpt2", "gpt2_medium", "gpt2_xl", "bert_tiny",
                  "bert_base", "bert_large", "resnet_tiny", "resnet18", "resnet50", "resnet152"],
        "data": ["text_stdlib", "mlm_stdlib", "images_synthetic"],
        "cluster": ["local", "nvlink_2x8", "pcie_2x8", "mixed_rack"],
        "strategy": ["autopipe", "auto"],
        "trainer": ["cpu", "gpu"],
    }.items():
        for name in names:
            assert (group, name) in found, f"conf/{group}/{name}.yaml is missing"
    for recipe in RECIPES:
        assert (CONF_DIR / f"{recipe}.yaml").exists()


def _param_count(model_cfg) -> int:
    with torch.device("meta"):  # gpt2_xl etc. without allocating a byte
        net = instantiate(model_cfg)
    return sum(p.numel() for p in net.parameters())


# Published sizes (HF GPT2LMHeadModel / BertForMaskedLM at their vocabularies, torchvision).
_PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2_medium": 354_823_168,
    "gpt2_xl": 1_557_611_200,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
}


@pytest.mark.parametrize(("group", "option"), _options())
def test_option_composes_and_instantiates(group, option):
    recipe = _recipe_for(group, option)
    cfg = compose(recipe, [f"{group}={option}"])
    assert OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group == "model":
        assert cfg.model.name == option
        n = _param_count(cfg.model)
        if option in _PUBLISHED:
            assert n == _PUBLISHED[option]
        if option.startswith("bert_"):
            published = {"bert_base": 109_514_298, "bert_large": 335_174_458}
            assert n == published.get(option, n)
    elif group == "data":
        dm = instantiate(cfg.data)
        assert isinstance(dm, pl.LightningDataModule)
        assert dm.batch_size == cfg.data.batch_size
    elif group == "task":
        network = instantiate(cfg.model)
        task = instantiate(cfg.task, model=network)
        assert isinstance(task, pl.LightningModule)
        assert hasattr(task, "pipeline_loss")
    elif group == "cluster":
        cluster = build_cluster(cfg.cluster)
        if option == "local":
            assert cluster is None
            assert build_cluster(cfg.cluster, world_size=3).num_devices == 3
        else:
            assert isinstance(cluster, Cluster)
            assert cluster.num_devices >= 2
    elif group == "strategy":
        if "_target_" in cfg.strategy:
            from lightning_autopipe import AutoPipeStrategy

            strategy = instantiate(cfg.strategy, cluster=None)
            assert isinstance(strategy, AutoPipeStrategy)
        else:
            trainer = pl.Trainer(strategy=cfg.strategy.name, accelerator="cpu", devices=1,
                                 logger=False, enable_progress_bar=False)
            assert trainer.strategy is not None
    elif group == "trainer":
        kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
        inspect.signature(pl.Trainer).bind(**kwargs)  # every key is a Trainer argument
        if cfg.trainer.accelerator == "cpu":
            trainer = pl.Trainer(**kwargs, strategy="auto", logger=False)
            assert trainer.max_steps == cfg.trainer.max_steps
    elif group == "experiment":
        assert cfg.recipe == recipe
    else:
        pytest.fail(f"no instantiation check for conf/{group}/{option}.yaml")


def test_experiment_presets_override_groups():
    cfg = compose("train_gpt", ["experiment=gpt2_mixed_rack_plan"])
    assert cfg.model.name == "gpt2_xl"
    assert cfg.plan_only
    assert build_cluster(cfg.cluster).num_devices == 24
    assert cfg.data.block_size == 1024  # follows the model's context


def test_the_readme_override_example_composes():
    cfg = compose("train_gpt", ["model=gpt_small", "cluster=local", "trainer.devices=4",
                                "strategy.startup_slices=2", "trainer.max_steps=50"])
    assert (cfg.model.arch, cfg.trainer.devices, cfg.strategy.startup_slices) == ("hf", 4, 2)
    assert cfg.task.seq_len == cfg.data.block_size == cfg.model.max_seq_len


@pytest.mark.parametrize(
    "override",
    ["trainer.max_stepz=5", "strategy.stages=2", "trainer.max_steps=abc", "model.n_layr=3",
     "data.batch_size=many", "model=gpt3"],
)
def test_typos_and_wrong_types_are_errors(override):
    with pytest.raises(ConfigCompositionException):
        compose("train_gpt", [override])


def test_a_typo_inside_a_yaml_file_is_an_error():
    """A misspelt key in a model file meets the schema the file names in its defaults."""
    schema = OmegaConf.structured(GPTModelConfig)
    with pytest.raises(ConfigKeyError, match="n_layr"):
        OmegaConf.merge(schema, OmegaConf.create({"name": "x", "n_layr": 3}))


def test_a_cluster_file_is_taken_as_cluster_and_a_missing_one_is_named(tmp_path):
    """``cluster=<file>``, as the run's own message advises for the cluster it discovered,
    loads that file (it is no option of the ``cluster`` group)."""
    text = (CONF_DIR / "cluster" / "mixed_rack.yaml").read_text().replace(
        "name: mixed", "name: edited-mixed", 1)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    cfg = compose("train_gpt", [f"cluster={path}"])
    got = build_cluster(cfg.cluster)
    assert got.name == "edited-mixed-rack"
    assert got.to_dict() == Cluster.load(path).to_dict()
    with pytest.raises(ConfigCompositionException, match=r"cluster=.*nope\.yaml: no such file.*"
                       r"mixed_rack"):
        compose("train_gpt", [f"cluster={tmp_path / 'nope.yaml'}"])
