"""Train a LightningModule on fsdp's engine with 2 CPU processes, checkpoint, resume.

pip install "fsdp[lightning]"; python examples/lightning_fsdp.py [CHECKPOINT_DIR]
"""

import sys

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp.integrations.lightning import FSDPStrategy


class Block(nn.Sequential):  # each Block is one FSDP unit: one all-gather, one reduce-scatter
    def __init__(self, w: int) -> None:
        super().__init__(nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))

    def forward(self, x):
        return x + super().forward(x)


class Regressor(L.LightningModule):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.head(self.blocks(batch[0])), batch[1])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(max_steps: int, ckpt_dir: str) -> L.Trainer:
    strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    save = L.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_last=True)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        callbacks=[save],
        logger=False,
        enable_progress_bar=False,
    )


if __name__ == "__main__":
    ckpt_dir = sys.argv[1] if len(sys.argv) > 1 else "checkpoints"
    L.seed_everything(0)
    data = DataLoader(TensorDataset(torch.randn(256, 32), torch.randn(256, 1)), batch_size=16)
    trainer(8, ckpt_dir).fit(Regressor(), data)  # checkpoints are directories: last.ckpt/
    # Resume at any device count: weights, AdamW state, loops and callbacks come back.
    trainer(12, ckpt_dir).fit(Regressor(), data, ckpt_path="last")
