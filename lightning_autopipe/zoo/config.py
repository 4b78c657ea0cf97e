"""Typed Hydra configs for the recipes: schemas in Hydra's ConfigStore, composing ``conf/``.

Each YAML option under ``conf/`` names its schema in its defaults list (``model/gpt_tiny.yaml``
starts with ``defaults: [gpt_schema, _self_]``), so a misspelt key in a file or an override
(``trainer.max_stepz=5``, ``strategy.stages=2``) and a wrongly typed value
(``trainer.max_steps=abc``) are errors at compose time instead of being silently ignored.
The cluster node stays an untyped mapping here: ``lightning_autopipe.cluster`` validates it.
The module runs past ~400 lines because the schemas, the composition and its error hints
(typos, unknown strategy keys, cluster files) all read the same registered schemas.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

from lightning_autopipe.extras import import_extra
from lightning_autopipe.options import AutoPipeOptions

import_extra("hydra", "the typed Hydra configs")
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import MISSING, DictConfig  # noqa: E402

__all__ = [
    "CONF_DIR",
    "AutoPipeStrategyConfig",
    "BertModelConfig",
    "CausalLMTaskConfig",
    "GPTModelConfig",
    "ImageDataConfig",
    "ImageTaskConfig",
    "LightningStrategyConfig",
    "MLMDataConfig",
    "MaskedLMTaskConfig",
    "RecipeConfig",
    "ResNetModelConfig",
    "TextDataConfig",
    "TrainerConfig",
    "build_cluster",
    "compose",
    "register_configs",
]

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


# -------------------------------------------------------------------------------------- model
@dataclass
class GPTModelConfig:
    """Decoder-only GPT (``arch``: ``tiny`` = TinyGPT, ``hf`` = transformers GPT-2)."""

    _target_: str = "lightning_autopipe.zoo.tasks.build_gpt"
    name: str = MISSING
    arch: str = "tiny"
    vocab_size: int = 264
    max_seq_len: int = 128
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    dropout: float = 0.0
    tie_embeddings: bool = True


@dataclass
class BertModelConfig:
    """transformers ``BertForMaskedLM`` (``intermediate_size`` null = 4 x ``n_embd``)."""

    _target_: str = "lightning_autopipe.zoo.tasks.build_bert"
    name: str = MISSING
    vocab_size: int = 264
    max_seq_len: int = 128
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    intermediate_size: int | None = None
    dropout: float = 0.0


@dataclass
class ResNetModelConfig:
    """SmallCNN (``arch: small_cnn``) or a torchvision ResNet (``arch: resnet50`` ...)."""

    _target_: str = "lightning_autopipe.zoo.tasks.build_resnet"
    name: str = MISSING
    arch: str = "small_cnn"
    num_classes: int = 10
    in_channels: int = 3
    widths: list[int] = field(default_factory=lambda: [16, 32, 64])
    blocks_per_stage: int = 1
    norm: str = "batch"
    # Not a constructor argument: the input resolution, read by the data and task configs.
    image_size: int = 32


# --------------------------------------------------------------------------------------- data
@dataclass
class TextDataConfig:
    """Next-byte prediction on the Python standard library (see ``data.StdlibTextDataModule``)."""

    _target_: str = "lightning_autopipe.zoo.data.StdlibTextDataModule"
    block_size: int = 128
    batch_size: int = 8
    max_bytes: int = 2_000_000
    val_fraction: float = 0.02
    num_workers: int = 0
    seed: int = 0
    # Samples per step over all replicas, fixed whatever the world (elastic runs); null: the
    # global batch is batch_size x replicas.
    global_batch_size: int | None = None


@dataclass
class MLMDataConfig(TextDataConfig):
    """Masked-LM on the Python standard library (see ``data.StdlibMLMDataModule``)."""

    _target_: str = "lightning_autopipe.zoo.data.StdlibMLMDataModule"
    mask_prob: float = 0.15


@dataclass
class ImageDataConfig:
    """Synthetic, learnable image classification (see ``data.SyntheticImageDataModule``)."""

    _target_: str = "lightning_autopipe.zoo.data.SyntheticImageDataModule"
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    num_samples: int = 4096
    val_samples: int = 256
    noise: float = 0.5
    batch_size: int = 16
    num_workers: int = 0
    seed: int = 0
    global_batch_size: int | None = None  # as TextDataConfig's


# ----------------------------------------------------------------------------------- strategy
_PLAIN = (str, int, float, bool)


def _schema_type(hint: Any) -> Any:
    """An option's type as OmegaConf can hold it.

    OmegaConf holds plain values and ``X | None``, no unions of several plain types and no
    objects: a union with one plain member keeps that member (``float | timedelta`` -> float,
    ``Plan | str | Path | None`` -> ``str | None``), one with several becomes ``Any`` (``int |
    str`` holds ``2`` or ``"auto"``).
    """
    if hint in _PLAIN:
        return hint
    members = get_args(hint) if isinstance(hint, types.UnionType) else ()
    plain = [m for m in members if m in _PLAIN]
    if len(plain) != 1:
        return Any
    return plain[0] | None if type(None) in members else plain[0]


def _strategy_schema() -> type:
    """``AutoPipeStrategyConfig``: the fields of :class:`AutoPipeOptions` plus ``_target_``."""
    hints = get_type_hints(AutoPipeOptions)
    cls = make_dataclass(
        "AutoPipeStrategyConfig",
        [("_target_", str, field(default="lightning_autopipe.AutoPipeStrategy"))]
        + [
            (f.name, _schema_type(hints[f.name]), field(default=f.default))
            for f in fields(AutoPipeOptions)
        ],
    )
    cls.__module__ = __name__
    cls.__doc__ = (
        "Arguments of ``lightning_autopipe.AutoPipeStrategy``: the fields of "
        "``AutoPipeOptions`` with their defaults (documented there). The recipes take "
        "``cluster`` from the ``cluster/`` group; ``plan`` is the path of a saved Plan JSON."
    )
    return cls


AutoPipeStrategyConfig = _strategy_schema()


@dataclass
class LightningStrategyConfig:
    """A stock Lightning strategy by registry name (``auto``, ``ddp``...), for comparison."""

    name: str = "auto"


# ------------------------------------------------------------------------------------ trainer
@dataclass
class TrainerConfig:
    """The ``lightning.Trainer`` arguments the recipes expose (all passed through)."""

    accelerator: str = "cpu"
    devices: Any = 2
    num_nodes: int = 1
    max_steps: int = 100
    max_epochs: int = -1
    precision: str = "32-true"
    log_every_n_steps: int = 1
    val_check_interval: Any = None
    limit_val_batches: Any = 0
    num_sanity_val_steps: int = 0
    gradient_clip_val: float | None = None
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    enable_checkpointing: bool = False
    deterministic: bool = False


# ------------------------------------------------------------------------------------- recipe
@dataclass
class _TaskConfig:
    """Optimiser settings shared by the tasks (the network comes from ``model``)."""

    _target_: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class _TokenTaskConfig(_TaskConfig):
    """A task on token ids (``seq_len``: the model's context length)."""

    seq_len: int = MISSING


@dataclass
class CausalLMTaskConfig(_TokenTaskConfig):
    _target_: str = "lightning_autopipe.zoo.tasks.CausalLMTask"


@dataclass
class MaskedLMTaskConfig(_TokenTaskConfig):
    _target_: str = "lightning_autopipe.zoo.tasks.MaskedLMTask"


@dataclass
class ImageTaskConfig(_TaskConfig):
    _target_: str = "lightning_autopipe.zoo.tasks.ImageClassificationTask"
    image_size: int = MISSING
    channels: int = 3


@dataclass
class RecipeConfig:
    """A whole recipe: groups ``model``, ``data``, ``task``, ``cluster``, ``strategy``, ``trainer``.

    ``run_dir`` (default ``outputs/<recipe>/<time>``, or ``$AUTOPIPE_RUN_DIR``) holds logs and
    the timeline picture; ``threads_per_rank`` null = CPU cores / local ranks;
    ``plan_only`` prints the plan for ``cluster`` without launching (same as ``--plan-only``).
    ``checkpoint_every_n_steps`` saves ``last.ckpt`` (atomically) every N optimizer steps in
    ``checkpoint_dir`` (default ``<run_dir>/checkpoints``); ``ckpt_path`` is passed to
    ``Trainer.fit`` (``last``: resume the newest checkpoint, start fresh when there is none:
    set it and forget it, as an elastic torchrun run needs).
    """

    recipe: str = MISSING
    model: Any = MISSING
    data: Any = MISSING
    cluster: Any = MISSING
    strategy: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: Any = MISSING
    seed: int = 0
    run_dir: str | None = None
    threads_per_rank: int | None = None
    plan_only: bool = False
    ckpt_path: str | None = None
    checkpoint_every_n_steps: int | None = None
    checkpoint_dir: str | None = None


_SCHEMAS: list[tuple[str | None, str, type]] = [
    ("model", "gpt_schema", GPTModelConfig),
    ("model", "bert_schema", BertModelConfig),
    ("model", "resnet_schema", ResNetModelConfig),
    ("data", "text_schema", TextDataConfig),
    ("data", "mlm_schema", MLMDataConfig),
    ("data", "images_schema", ImageDataConfig),
    ("strategy", "autopipe_schema", AutoPipeStrategyConfig),
    ("strategy", "lightning_schema", LightningStrategyConfig),
    ("task", "causal_lm_schema", CausalLMTaskConfig),
    ("task", "masked_lm_schema", MaskedLMTaskConfig),
    ("task", "image_classification_schema", ImageTaskConfig),
    (None, "recipe_schema", RecipeConfig),
]


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent; ``conf/`` files name them)."""
    store = ConfigStore.instance()
    for group, name, node in _SCHEMAS:
        store.store(group=group, name=name, node=node)


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with command-line style ``overrides``.

    Uses Hydra's compose API (no working-directory change, no output folder per process), so
    every process of a multi-process run composes exactly the same config from the same argv.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register_configs()
    overrides, cluster_file = _cluster_file(list(overrides or []))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        try:
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
        except ConfigCompositionException as exc:
            hint = _typo_hint(str(exc), config_name, overrides, hydra_compose)
            if hint is None:
                raise
            raise ConfigCompositionException(hint) from exc
    for override in overrides:  # ``+strategy.x=...`` would reach AutoPipeStrategy(x=...)
        key = override.split("=", 1)[0]
        if key.startswith("+strategy.") and key.count(".") == 1:
            name = key.split(".", 1)[1]
            known = [f.name for f in fields(AutoPipeStrategyConfig)]
            if _is_strategy_schema(cfg) and name not in known:
                raise ConfigCompositionException(_unknown_key_message(
                    "strategy", name, known, override.split("=", 1)[1] if "=" in override
                    else None))
    if cluster_file is not None:
        from omegaconf import OmegaConf, open_dict

        with open_dict(cfg):
            cfg.cluster = OmegaConf.create({"file": cluster_file})
    return cfg


def _cluster_file(overrides: list[str]) -> tuple[list[str], str | None]:
    """``cluster=<a YAML file>`` (the file a run wrote, or one of the user's): Hydra would look
    it up as an option of the ``cluster`` group (``conf/cluster/<value>.yaml``); the group
    takes ``local`` instead and the file is read by :func:`build_cluster`."""
    from hydra.errors import ConfigCompositionException

    out, found = [], None
    for override in overrides:
        key, _, value = override.partition("=")
        if key in ("cluster", "+cluster", "++cluster") and (
                value.endswith((".yaml", ".yml")) or "/" in value):
            path = Path(value).expanduser()
            if not path.is_file():
                names = ", ".join(sorted(f.stem for f in (CONF_DIR / "cluster").glob("*.yaml")))
                raise ConfigCompositionException(
                    f"cluster={value}: no such file; give a cluster file that exists or a name "
                    f"under conf/cluster ({names})")
            found = str(path.resolve())
            override = "cluster=local"
        out.append(override)
    return out, found


def _is_strategy_schema(cfg: Any) -> bool:
    from omegaconf import OmegaConf

    node = cfg.get("strategy") if isinstance(cfg, DictConfig) else None
    return node is not None and OmegaConf.get_type(node) is AutoPipeStrategyConfig


def _typo_hint(message: str, config_name: str, overrides: list[str], hydra_compose: Any
               ) -> str | None:
    """For Hydra's "Could not override 'a.b'": the keys of ``a`` closest to ``b``.

    Hydra's own hint (append with ``+a.b=...``) is wrong for a typed node: the key is a typo,
    and appending it fails later. The node's keys are read from the config composed without
    the failing override.
    """
    import difflib
    import re

    found = re.search(r"Could not override '([^']+)'", message)
    if found is None:
        return None
    key = found.group(1)
    parent, _, name = key.rpartition(".")
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        base = hydra_compose(config_name=config_name, overrides=rest)
    except Exception:  # noqa: BLE001 - another override fails too: keep Hydra's message
        return None
    from omegaconf import OmegaConf

    node = OmegaConf.select(base, parent) if parent else base
    if not isinstance(node, DictConfig):
        return None
    value = next((o.split("=", 1)[1] for o in overrides
                  if o.split("=", 1)[0] == key and "=" in o), None)
    known = [k for k in node if isinstance(k, str) and not k.startswith("_")]
    typed = OmegaConf.get_type(node) not in (dict, None)  # a schema: no key may be appended
    if not typed and not difflib.get_close_matches(name, known, n=1):
        return None
    return _unknown_key_message(parent, name, known, value)


def _unknown_key_message(parent: str, name: str, known: list[str], value: str | None) -> str:
    import difflib

    known = [k for k in known if not k.startswith("_")]
    close = difflib.get_close_matches(name, known, n=1)
    where = f"{parent}." if parent else ""
    fix = ""
    if close:
        fix = f"; did you mean {where}{close[0]}" + (f"={value}" if value is not None else "") + "?"
    return (f"Could not override '{where}{name}': {where}{name} is not a key of "
            f"{parent or 'the config'}{fix} (its keys: {', '.join(known)})")


def build_cluster(cluster_cfg: Any, world_size: int | None = None) -> Any:
    """The ``cluster/`` node as a validated :class:`~lightning_autopipe.cluster.Cluster`.

    A ``cluster=<file>`` override is read from that file. The ``local`` cluster (no servers)
    means "the launched ranks as one server": it gives
    ``None`` (the strategy sizes it from the world it finds), or ``Cluster.local(world_size)``
    when a world size is given (plan-only mode, where nothing is launched).
    """
    from omegaconf import OmegaConf

    from lightning_autopipe.cluster import Cluster

    data = OmegaConf.to_container(cluster_cfg, resolve=True)
    if isinstance(data, dict) and set(data) == {"file"}:  # cluster=<file> (see compose)
        return Cluster.load(data["file"])
    if isinstance(data, dict) and not data.get("servers"):
        return None if world_size is None else Cluster.local(world_size)
    return Cluster.from_dict(data)
