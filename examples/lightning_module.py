# A LightningModule written as for DDP, trained as a pipeline on 2 CPU ranks:
#     python examples/lightning_module.py
# (the README's "Use it from your own code" example is this file; the test suite runs it)
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_autopipe  # noqa: F401  (registers strategy="autopipe")
from lightning_autopipe.zoo.models import TinyGPT


class LM(L.LightningModule):
    def __init__(self, net):                      # any fx- or export-traceable nn.Module
        super().__init__()
        self.net = net

    def forward(self, ids):                       # this is what gets traced and pipelined
        return self.net(ids)

    def training_step(self, batch, batch_idx):    # runs per micro-batch slice, last stage
        ids, targets = batch
        logits = self(ids)                        # the slice's outputs of the last stage
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, targets = batch
        loss = F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):               # sees only this rank's stage parameters
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


torch.manual_seed(0)
net = TinyGPT(vocab=32, seq_len=16, d_model=32, n_layers=2, n_heads=2)
g = torch.Generator().manual_seed(5)              # sequences whose next token is this one + 1
tokens = (torch.randint(0, 32, (128, 1), generator=g) + torch.arange(17)) % 32
loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)

model = LM(net)
trainer = L.Trainer(strategy="autopipe", accelerator="cpu", devices=2, max_steps=50)
trainer.fit(model, loader)
trainer.validate(model, loader)                   # same Trainer and module after fit
