"""An ordinary LightningModule (loss and accuracy logged in its steps, no pipeline_loss) and data.

Shared by the multi-process launch (``_run.py``) and the ``strategy="auto"`` reference in the
pytest process, so both train the same module on the same samples.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_autopipe.zoo.models import SmallCNN

REPLICA_BATCH = 10  # m=2 micro-batches of 5, micro-batch 0 in 3 startup slices: 2, 2, 1, then 5
MICROBATCHES, STARTUP_SLICES = 2, 3
TRAIN_STEPS = 3  # per epoch
EPOCHS = 2  # then one more by fitting again
VAL_PER_REPLICA = 2 * REPLICA_BATCH + 3  # a short last batch: its units hold 2 and 1 samples
LR = 0.2
ACCUMULATE = 2  # accumulate_grad_batches: windows of 2, 2 batches and the epoch's last alone
FIRST_STAGE_BLOCKS = 3  # the pipeline's cut (tests/lightning/_run.py:fixed_plan)


def dataset(num: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(num, 3, 8, 8, generator=g),
                         torch.randint(0, 10, (num,), generator=g))


class Classifier(pl.LightningModule):
    """Logs loss and accuracy as any Lightning user would; ``mistake`` names a contract error.

    ``mistake``: ``"twice"`` (``self(...)`` called twice), ``"never"`` (a loss without
    ``self(...)``), ``"metric"`` (logs a torchmetrics object), each in ``training_step``;
    ``"optimizer"`` (``configure_optimizers`` raises on rank 1 alone);
    ``only_replica`` restricts it to that data-parallel replica's last stage.
    """

    def __init__(self, mistake: str | None = None, only_replica: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SmallCNN(widths=(4, 8), blocks_per_stage=1)
        # never read by forward (a head kept for later): still the model's, in its checkpoint
        self.spare = torch.nn.Linear(3, 2)
        self.register_buffer("version", torch.tensor(3))
        self.register_buffer("loss_scale", torch.tensor(1.0))  # read by the steps only
        self.mistake, self.only_replica = mistake, only_replica
        if mistake == "metric":
            from torchmetrics import MeanMetric

            self.mean_loss = MeanMetric()

    def forward(self, x):
        return self.net(x)

    def _mistaken(self) -> bool:
        if self.mistake is None:
            return False
        if self.only_replica is None:
            return True
        return self.trainer.strategy.pipeline.layout.replica == self.only_replica

    def _scores(self, batch, stage: str):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y) * self.loss_scale
        acc = (logits.argmax(-1) == y).float().mean()
        self.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "train")
        self.log(f"{stage}_acc", acc, sync_dist=True)
        self.log(f"{stage}_samples", float(len(y)), reduce_fx="sum", sync_dist=True)  # DDP's sum
        return logits, loss

    def training_step(self, batch, batch_idx):
        if self._mistaken() and self.mistake == "never":
            return (self.net.fc.weight ** 2).sum()
        logits, loss = self._scores(batch, "train")
        if self._mistaken() and self.mistake == "twice":
            loss = loss + 0.0 * self(batch[0]).sum()
        if self._mistaken() and self.mistake == "metric":
            self.mean_loss(loss)
            self.log("mean_loss", self.mean_loss)
        return loss

    def validation_step(self, batch, batch_idx):
        logits, loss = self._scores(batch, "val")
        return {"loss": loss, "logits": logits}  # for on_validation_batch_end (BatchOutputs)

    def test_step(self, batch, batch_idx):
        return self._scores(batch, "test")[1]

    def predict_step(self, batch, batch_idx):
        logits = self(batch[0])
        return {"probs": logits.softmax(-1), "label": logits.argmax(-1)}

    def configure_optimizers(self):  # the fine-tuning idiom: what is frozen is left out
        if self.mistake == "optimizer" and self.trainer.global_rank == 1:
            raise ValueError("rank one's optimizer breaks on purpose")
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)


def freeze_first_stage(task: Classifier, cut: int) -> Classifier:
    """Freeze every parameter the pipeline's first stage (blocks ``[0, cut)``) holds, as
    fine-tuning freezes embeddings: that stage then trains nothing."""
    from lightning_autopipe.graph import split_model

    blocks = split_model(task, (torch.zeros(2, 3, 8, 8),))
    first = set(blocks.stage(0, cut).param_names.values())
    for name, p in task.named_parameters():
        if name in first:
            p.requires_grad_(False)
    return task


def loaders(replicas: int, explicit_sampler: bool) -> dict[str, DataLoader]:
    """Train / val / test / predict loaders; ``explicit_sampler``: the one-process reference.

    Lightning wraps a training loader in a shuffling ``DistributedSampler`` (seed 0) under the
    pipeline; the reference takes the same sampler with one replica and the whole global batch,
    so global step ``t`` sees the same samples in both. Evaluation loaders keep their order.
    """
    batch = REPLICA_BATCH * (replicas if explicit_sampler else 1)
    train = dataset(REPLICA_BATCH * replicas * TRAIN_STEPS, seed=1)
    sampler = None
    if explicit_sampler:
        sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
    evaluation = VAL_PER_REPLICA * replicas
    return {
        "train": DataLoader(train, batch_size=batch, sampler=sampler),
        "val": DataLoader(dataset(evaluation, seed=2), batch_size=batch),
        "test": DataLoader(dataset(evaluation, seed=3), batch_size=batch),
        # one sample over whole batches: Lightning's predict sampler does not pad, so replica
        # 0 runs a batch (of one sample) more than the others, which must not wait for it
        "predict": DataLoader(dataset(3 * REPLICA_BATCH * replicas + 1, seed=4),
                              batch_size=batch),
    }


class KeepPredictions(BasePredictionWriter):
    """A prediction writer callback that keeps what it is handed, per batch."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.written: list = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch,
                           batch_idx, dataloader_idx) -> None:
        self.written.append(prediction)


class BatchOutputs(pl.Callback):
    """What ``on_validation_batch_end`` / ``on_test_batch_end`` are handed, per batch, during
    ``trainer.validate`` / ``trainer.test`` (the steps' return values)."""

    def __init__(self) -> None:
        self.seen: dict[str, list] = {"validate": [], "test": []}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx=0) -> None:
        if trainer.state.fn == "validate":
            self.seen["validate"].append(outputs)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                          dataloader_idx=0) -> None:
        self.seen["test"].append(outputs)


class SummaryProbe(pl.Callback):
    """What the Trainer's model summary callback reports (at the first fit's start)."""

    def __init__(self) -> None:
        self.seen: dict | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning.pytorch.callbacks import ModelSummary

        if self.seen is not None:
            return
        cb = next(c for c in trainer.callbacks if isinstance(c, ModelSummary))
        s = cb._summary(trainer, pl_module)
        self.seen = {"total": s.total_parameters, "trainable": s.trainable_parameters,
                     "layers": dict(zip(s.layer_names, s.param_nums)),
                     "columns": [head for head, _ in s._get_summary_data()]}


def run_sequence(trainer_factory, replicas: int, explicit_sampler: bool, ckpt_dir) -> dict:
    """fit; validate, test, predict after it; fit one more epoch; test best, validate last.

    The same calls on the same Trainer and module, for the pipeline and the reference alike.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests._recording import RecordingLogger

    task = Classifier()
    logger = RecordingLogger()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", monitor="val_loss",
                                 mode="min", save_top_k=1, save_last=True)
    writer, probe, batch_outputs = KeepPredictions(), SummaryProbe(), BatchOutputs()
    trainer = trainer_factory(logger=logger, callbacks=[checkpoint, writer, probe, batch_outputs],
                              max_epochs=EPOCHS)
    dl = loaders(replicas, explicit_sampler)
    out: dict = {}
    trainer.fit(task, dl["train"], dl["val"])
    out["fit_logged"] = list(logger.rows)
    out["fit_state"] = {k: v.detach().clone() for k, v in task.state_dict().items()}
    out["best"] = (str(checkpoint.best_model_path).rsplit("/", 1)[-1],
                   float(checkpoint.best_model_score))
    out["validate"] = trainer.validate(task, dl["val"], verbose=False)
    out["test"] = trainer.test(task, dl["test"], verbose=False)
    out["predict"] = trainer.predict(task, dl["predict"])
    out["written"] = writer.written
    out["batch_outputs"] = {k: list(v) for k, v in batch_outputs.seen.items()}
    rows = len(logger.rows)
    trainer.fit_loop.max_epochs = EPOCHS + 1
    trainer.fit(task, dl["train"], dl["val"])
    out["refit_logged"] = logger.rows[rows:]
    out["refit_state"] = {k: v.detach().clone() for k, v in task.state_dict().items()}
    out["test_best"] = trainer.test(task, dl["test"], ckpt_path="best", verbose=False)
    out["validate_last"] = trainer.validate(task, dl["val"], ckpt_path="last", verbose=False)
    out["summary"] = probe.seen
    pipe = getattr(trainer.strategy, "pipeline", None)  # kept after the calls for the next
    out["replica"] = pipe.layout.replica if pipe is not None else 0
    plan = getattr(trainer.strategy, "plan", None)
    out["plan"] = plan.to_json() if plan is not None else None
    return out


def run_accumulate(trainer_factory, replicas: int, explicit_sampler: bool) -> dict:
    """fit under ``accumulate_grad_batches=ACCUMULATE`` (no checkpoints): the logged rows, the
    weights and the optimizer steps taken, for the pipeline and the reference alike."""
    from tests._recording import RecordingLogger

    # the first stage trains nothing (fixed_plan's cut): its rank makes an empty optimizer
    task, logger = freeze_first_stage(Classifier(), FIRST_STAGE_BLOCKS), RecordingLogger()
    trainer = trainer_factory(logger=logger, max_epochs=EPOCHS, enable_checkpointing=False,
                              accumulate_grad_batches=ACCUMULATE)
    trainer.fit(task, loaders(replicas, explicit_sampler)["train"])
    return {"acc_logged": list(logger.rows), "acc_steps": trainer.global_step,
            "acc_state": {k: v.detach().clone() for k, v in task.state_dict().items()}}
