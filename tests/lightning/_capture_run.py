"""Launched by tests/lightning/test_exported_modes.py and test_dict_batch.py: what the strategy
captures of a module and feeds it.

    run by tests/_world.py in the shared 2-rank world: run_case(CASE, 2, OUT_DIR)

Both cases train on two ranks under a fixed plan of 2 stages (:func:`plan`) and write, on every
rank, ``OUT_DIR/<case>.rank<r>.pt``: the step losses and batches (the sampler's order, which the
references train on), the stage's state and which stage the rank holds.

* ``batchnorm``: a BatchNorm CNN whose forward peeks at its output (``out.logits if
  hasattr(out, "logits") else out``, code written for Hugging Face outputs and tensors alike):
  ``hasattr`` is true of every torch.fx proxy, so fx's graph fails where the model runs and the
  strategy captures the model with torch.export, whose graph holds BatchNorm's mode as
  constants. One micro-batch, no slices (BatchNorm normalises the whole batch, as one process
  does), ``STEPS`` steps, then two validations; also records both validation losses and whether
  the stage reads its own ``self.training``.
* ``labels``: Hugging Face style batches ``{"input_ids", "attention_mask", "labels"}`` for a
  forward taking ``(input_ids, attention_mask)``: the strategy gives forward the entries that
  name its parameters and the steps read ``labels`` from the batch. Two micro-batches, the first
  in two startup slices (the dict is sliced per unit), ``STEPS`` SGD steps.
* ``frozen``: a BatchNorm CNN that torch.fx captures, fine-tuned with its first BatchNorm put
  in evaluation mode in ``on_train_epoch_start``; ``frozen-export``: the same with the peeking
  net, which torch.export captures. One micro-batch, no slices; also records the warnings.
* ``unfreeze``: the fx-captured CNN with its first stage's layers frozen at the start and
  unfrozen from step ``UNFROZEN_FROM`` on (that stage had nothing to train when built).
* ``finetune``: the fx-captured CNN under Lightning's ``BackboneFinetuning`` (the first
  stage's layers join the optimizer as a group of their own at the second epoch), saved after
  two epochs and resumed for a third in another layout (:func:`_finetune`).
* ``stop``: the CNN whose ``training_step`` sets ``self.trainer.should_stop`` at batch
  ``STOP_AT`` of the first epoch of two.
* ``warmup``: the CNN whose ``training_step`` sets the learning rate at every step.
* ``anneal``: the CNN whose logits are divided by a Python number raised every epoch.
* ``onecycle``: the CNN under ``OneCycleLR`` sized by ``estimated_stepping_batches``, planned
  by the strategy (no given plan), its loader sampled by Lightning.
* ``clipnorm``: a module clipping by the norm of ``self.parameters()`` in its own
  ``on_before_optimizer_step`` (each rank's are its stage's): the warnings.
* ``mapping``: the ``labels`` batches collated into a mapping that is not a ``dict`` (a
  ``UserDict``, as a tokenizer's ``BatchEncoding`` is, which Hugging Face collators return).
* ``tuple``: the same net and plan on tuple batches ``(input_ids, attention_mask, labels)``
  whose step calls ``self(input_ids, attention_mask)``: no ``pipeline_inputs``; the strategy
  reads the two entries off the step's own call at setup.
"""

from __future__ import annotations

import sys
import warnings
from collections import UserDict
from collections.abc import Mapping
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset, default_collate  # noqa: E402

import lightning_autopipe  # noqa: E402
from lightning_autopipe.graph import split_model  # noqa: E402
from lightning_autopipe.planner.plan import Plan, StagePlan  # noqa: E402

BATCH, STEPS, LR = 8, 3, 0.1
VAL_BATCHES = 2  # batchnorm
SEQ, VOCAB, LABELS_LR = 6, 32, 0.5  # labels


# ---------------------------------------------------------------------------- batchnorm
class PeekingCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        out = self.fc(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))
        return out.logits if hasattr(out, "logits") else out


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = PeekingCNN()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class PlainCNN(PeekingCNN):
    """The same net without the peek: torch.fx captures it, its stages call its modules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))


class FrozenStem(Classifier):
    """Fine-tuning with the first BatchNorm frozen: put in evaluation mode every epoch."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def on_train_epoch_start(self) -> None:
        self.net.bn1.eval()


class ClipsItself(Classifier):
    """Clips by the norm of ``self.parameters()`` in its own hook, as one process may."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PlainCNN()

    def on_before_optimizer_step(self, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


class Unfreezes(Classifier):
    """Its first stage's layers (conv1, bn1) frozen at the start, unfrozen from the second
    step on, as gradual unfreezing (Lightning's BackboneFinetuning) does; SGD over every
    parameter, so the unfrozen ones train from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PlainCNN()
        for layer in (self.net.conv1, self.net.bn1):
            layer.requires_grad_(False)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx == UNFROZEN_FROM:
            for layer in (self.net.conv1, self.net.bn1):
                layer.requires_grad_(True)


UNFROZEN_FROM = 1  # the step (batch index) from which Unfreezes trains its first stage


class Finetunes(Classifier):
    """Lightning's ``BackboneFinetuning`` over the first stage's layers (conv1, bn1): frozen in
    the first epoch, then given to the optimizer as a group of their own, which only the rank
    holding them adds; their learning rate changes every epoch after."""

    def __init__(self, head: bool = False) -> None:
        super().__init__()
        self.net = PlainCNN()
        self.head = head  # the last stage's layer is the one frozen first, not the first's

    @property
    def backbone(self) -> nn.Module:  # a property: the layers keep their one name
        return self.net.fc if self.head else nn.ModuleList([self.net.conv1, self.net.bn1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)


def finetuning() -> pl.Callback:
    from lightning.pytorch.callbacks import BackboneFinetuning

    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5,
                              verbose=False)


FINETUNE_EPOCHS = 2  # then resumed for one more, from its checkpoint, in another layout


class Stops(Classifier):
    """Its ``training_step`` (run on the last stage alone) asks the Trainer to stop."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PlainCNN()

    def training_step(self, batch, batch_idx):
        if batch_idx == STOP_AT:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


STOP_AT = 1  # the batch whose step sets should_stop; the run ends after it, step STOP_AT + 1


class AnnealedCNN(PlainCNN):
    """Its logits divided by a temperature held as a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.temperature


class Anneals(Classifier):
    """Raises the temperature every epoch (a schedule as one process would run it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = AnnealedCNN()

    def on_train_epoch_start(self) -> None:
        self.net.temperature = 1.0 + self.current_epoch


class OneCycle(Classifier):
    """Sizes its schedule by ``self.trainer.estimated_stepping_batches``, as ``OneCycleLR``
    examples do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PlainCNN()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def shuffled_images(batches: int, seed: int) -> DataLoader:
    """:func:`images` in the order Lightning's sampler gives one data-parallel replica."""
    data = images(batches, seed).dataset
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    return DataLoader(data, batch_size=BATCH, sampler=sampler)


class WarmsUp(Classifier):
    """Its ``training_step`` (run on the last stage alone) sets the learning rate: a warm-up
    written in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PlainCNN()

    def training_step(self, batch, batch_idx):
        for group in self.optimizers().param_groups:
            group["lr"] = LR * (self.global_step + 1) / STEPS
        return super().training_step(batch, batch_idx)


def single_or_split_trainer(root: Path, epochs: int, callbacks: list, strategy=None,
                            sampled: bool = False) -> pl.Trainer:
    """The Trainer of cases ``finetune``, ``stop``, ``warmup``, ``anneal`` and ``onecycle``:
    under ``strategy`` on 2 ranks, or one process (Lightning's own strategy, the tests'
    reference); the loader in its own order, or (``sampled``) in that of Lightning's sampler."""
    devices = {"strategy": strategy, "devices": 2} if strategy else {"devices": 1}
    return pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=str(root), callbacks=callbacks,
                      use_distributed_sampler=sampled, **devices)


def images(batches: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = batches * BATCH
    return DataLoader(TensorDataset(torch.randn(n, 3, 6, 6, generator=g) * 2 + 1,
                                    torch.randint(0, 10, (n,), generator=g)), batch_size=BATCH)


# ---------------------------------------------------------------------------- labels
class MaskedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = nn.Embedding(VOCAB, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mix(self.emb(input_ids))) * attention_mask[..., None]
        return self.head(h)


class LabelledLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MaskedLM()

    def forward(self, input_ids, attention_mask):
        return self.net(input_ids, attention_mask)

    def training_step(self, batch, batch_idx):
        return token_loss(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LABELS_LR)


class TupleLM(LabelledLM):
    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch
        return token_loss(self(input_ids, attention_mask), labels)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Encoding(UserDict):
    """A batch that is a mapping but not a ``dict``, like Hugging Face's ``BatchEncoding``."""


def tokens(n: int, *, as_tuples: bool = False, as_mapping: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = (torch.rand(n, SEQ, generator=g) > 0.2).long()
    if as_tuples:
        return DataLoader(TensorDataset(ids, mask, ids.roll(-1, dims=1)), batch_size=BATCH)
    collate = (lambda rows: Encoding(default_collate(rows))) if as_mapping else None
    return DataLoader([{"input_ids": ids[i], "attention_mask": mask[i],
                        "labels": ids[i].roll(-1)} for i in range(n)], batch_size=BATCH,
                      collate_fn=collate)


# ---------------------------------------------------------------------------- both
def assert_like_one_process(ranks: list[dict], losses: list[float], net: nn.Module,
                            rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The tests' check of a case: the last stage's step losses are ``losses`` and every
    rank's stage state is ``net``'s (as the LightningModule's ``net``), the suite's float32
    tolerance by default (sums in another order)."""
    last = next(r for r in ranks if r["stage"] == 1)
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(losses),
                               rtol=rtol, atol=atol)
    state = {f"net.{k}": v for k, v in net.state_dict().items()}
    for rank in ranks:
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, state[name], rtol=rtol, atol=atol,
                                       msg=lambda s, n=name: f"{n}: {s}")


def plan(module: pl.LightningModule, example: tuple | dict, m: int, k: int,
         shift: int = 0) -> Plan:
    """2 stages cut in the middle of the module's blocks (``shift`` blocks later), ``m``
    micro-batches, ``k`` slices."""
    n = len(split_model(module, example))
    cut = n // 2 + shift
    return Plan("fixed", BATCH, m, k, [StagePlan((0, cut), ["local:0"]),
                                       StagePlan((cut, n), ["local:1"])])


class Record(pl.Callback):
    """Each step's loss and batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.batches.append({k: v.clone() for k, v in batch.items()}
                            if isinstance(batch, Mapping) else [t.clone() for t in batch])


def _finetune(out: Path, head: bool) -> dict:
    """``finetune``: two epochs, a checkpoint, a third epoch resumed from it with the cut one
    block later; the checkpoint's path, each fit's stage state and parameter names.
    ``finetune-head``: the same, the last stage's layer the one unfrozen (sharded checkpoint)."""
    example = (torch.zeros(2, 3, 6, 6),)
    states, path = [], out / f"finetune-{head}.ckpt"
    for epochs, shift in ((FINETUNE_EPOCHS, 0), (FINETUNE_EPOCHS + 1, 1)):
        task = Finetunes(head)
        strategy = lightning_autopipe.AutoPipeStrategy(
            plan=plan(Finetunes(), example, 1, 1, shift), timeout=120,
            checkpoint_format="sharded" if head else "consolidated")
        trainer = single_or_split_trainer(out / "root-finetune", epochs, [finetuning()],
                                          strategy)
        trainer.fit(task, images(STEPS, seed=1), ckpt_path=path if shift else None)
        if not shift:
            trainer.save_checkpoint(path)
        states.append({k: v.detach().clone() for k, v in task.state_dict().items()})
    return {"checkpoint": str(path), "states": states,
            "stage": trainer.strategy.pipeline.layout.stage}


def run_case(case: str, world: int, out: Path) -> dict:
    assert world == 2, "the capture cases run on the 2-rank world"
    if case.startswith("finetune"):
        return _finetune(out, case == "finetune-head")
    if case == "onecycle":  # planned by the strategy, the loader sampled by Lightning
        task = OneCycle()
        strategy = lightning_autopipe.AutoPipeStrategy(num_stages=2, timeout=60)
        trainer = single_or_split_trainer(out / "root-1c", 2, [], strategy, sampled=True)
        trainer.fit(task, images(STEPS, seed=1))
        return {"steps": trainer.global_step, "stage": trainer.strategy.pipeline.layout.stage,
                "total": trainer.lr_scheduler_configs[0].scheduler.total_steps,
                "state": {k: v.detach().clone() for k, v in task.state_dict().items()}}
    if case in ("stop", "warmup", "anneal"):
        made = {"stop": Stops, "warmup": WarmsUp, "anneal": Anneals}[case]
        task = made()
        strategy = lightning_autopipe.AutoPipeStrategy(
            plan=plan(made(), (torch.zeros(2, 3, 6, 6),), 1, 1), timeout=60)
        trainer = single_or_split_trainer(out / f"root-{case}", 2, [], strategy)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            trainer.fit(task, images(STEPS, seed=1))
        return {"steps": trainer.global_step, "stage": trainer.strategy.pipeline.layout.stage,
                "state": {k: v.detach().clone() for k, v in task.state_dict().items()},
                "warnings": [str(w.message) for w in warned]}
    if case == "batchnorm":
        task, loader = Classifier(), images(STEPS, seed=1)
        pinned = plan(Classifier(), (torch.zeros(2, 3, 6, 6),), 1, 1)
    elif case == "unfreeze":
        task, loader = Unfreezes(), images(STEPS, seed=1)
        pinned = plan(Unfreezes(), (torch.zeros(2, 3, 6, 6),), 1, 1)
    elif case == "clipnorm":
        task, loader = ClipsItself(), images(STEPS, seed=1)
        pinned = plan(ClipsItself(), (torch.zeros(2, 3, 6, 6),), 1, 1)
    elif case.startswith("frozen"):
        net = PlainCNN if case == "frozen" else PeekingCNN
        task, loader = FrozenStem(net()), images(STEPS, seed=1)
        pinned = plan(FrozenStem(net()), (torch.zeros(2, 3, 6, 6),), 1, 1)
    else:
        as_tuples = case == "tuple"
        task = TupleLM() if as_tuples else LabelledLM()
        loader = tokens(STEPS * BATCH, as_tuples=as_tuples, as_mapping=case == "mapping")
        pinned = plan(LabelledLM(), {"input_ids": torch.zeros(2, SEQ, dtype=torch.long),
                                     "attention_mask": torch.ones(2, SEQ, dtype=torch.long)},
                      2, 2)
    record = Record()
    trainer = pl.Trainer(strategy=lightning_autopipe.AutoPipeStrategy(plan=pinned, timeout=120),
                         accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(out / f"root-{case}"), callbacks=[record])
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(task, loader)
    pipe = trainer.strategy.pipeline
    result = {"losses": record.losses, "batches": record.batches,
              "state": {k: v.detach().clone() for k, v in task.state_dict().items()},
              "stage": pipe.layout.stage,
              "warnings": [str(w.message) for w in warned]}
    if case == "batchnorm":
        result["validated"] = [trainer.validate(task, images(VAL_BATCHES, seed=2),
                                                verbose=False)[0]["val_loss"] for _ in range(2)]
        stage = next(iter(pipe.executor.chunks.values()))
        result["reads_its_mode"] = "self.training" in getattr(stage, "code", "")
    return result
