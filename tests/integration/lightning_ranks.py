"""The rank side of ``test_lightning.py``: Lightning runs on CPU, one JSON of losses per run.

``python lightning_ranks.py suite OUT`` (every rank of a 2-process world; the test starts the
ranks itself, as torchrun would, so Lightning does not re-run the script) runs in order:

- ``ddp``: Lightning's own DDP strategy, 8 steps (2 epochs of 4 global batches of 8 samples),
  gradients clipped to norm 0.5, validation (16 samples) before training and after each epoch;
- ``fsdp``: `FSDPStrategy(auto_wrap_policy={Block})`, the same 8 steps;
- ``fsdp_ac``: the same with ``activation_checkpointing_policy={Block}``;
- ``registered``: ``strategy="fsdp_engine"`` (the registered name; one unit), 2 steps;
- ``ddp_accumulate``, ``fsdp_accumulate``: ``accumulate_grad_batches=2``, 2 steps;
- ``first``: 4 steps (one epoch), ``trainer.save_checkpoint(OUT/ckpt)`` after the 4th (a
  callback's ``on_train_batch_end``, where Lightning resumes exactly: a checkpoint saved after
  ``fit`` returned would restart mid-way, under every strategy, Lightning 2.6's own DDP too);
- ``resumed``: a fresh Trainer and module, ``fit(ckpt_path=OUT/ckpt)`` up to step 8;
- ``validated``: ``trainer.validate(ckpt_path=OUT/ckpt)`` of a module initialised otherwise;
- ``bf16``: torch's ``MixedPrecisionPolicy(param_dtype=bfloat16)``, no reshard after forward;
- ``meta``: a module that builds its blocks on the meta device in ``configure_model``;
- ``gpt``, ``gpt_tp``: the tiny GPT (fsdp.models._gpt) as a LightningModule, 4 steps on token
  windows, sharded per block (``gpt``) and with ``tensor_parallel_size=2`` (``gpt_tp``: its
  ``configure_model`` cuts it over ``self.device_mesh["tensor_parallel"]`` with
  `fsdp.models._tp_plan.parallelize`; dp 1, so both ranks see every batch);
  ``gpt_tp_first`` saves after 2 steps, ``gpt_tp_resumed`` resumes it to step 4.

``python lightning_ranks.py resume1 OUT`` resumes ``OUT/ckpt`` on one device (global batch 8
still) up to step 8 (``resumed1``). Each run writes ``OUT/<run>.json``: the loss of each global
step, the mean over ranks (so equal global batches give equal losses at any device count), and
facts about the sharded model.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, TensorDataset

from fsdp.integrations.lightning import FSDPStrategy

GLOBAL_BATCH = 8
SAMPLES = 32  # 4 global steps per epoch
STEPS = 8


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Net(L.LightningModule):
    """7 -> 13 -> 5 (uneven: 13 rows do not split evenly over 2 ranks), then a 5 -> 5 head on
    the root (parameters of the root unit itself)."""

    def __init__(self, lr: float = 0.05, on_meta: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not on_meta:
            self._build()

    def _build(self) -> None:
        self.blocks = nn.Sequential(Block(7, 13), Block(13, 5))
        self.head = nn.Linear(5, 5)

    def configure_model(self) -> None:
        if self.hparams.on_meta and not hasattr(self, "blocks"):
            with torch.device("meta"):
                self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(L.Callback):
    """Rank 0 writes the mean over ranks of each step's loss to ``path`` at the end of fit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.losses: dict[int, float] = {}
        self.val: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.losses[trainer.global_step] = float(loss)

    def on_validation_end(self, trainer, module) -> None:
        self.val[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    def on_train_end(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        params = dict(module.named_parameters())
        facts = {
            "dtensor": all(type(p.data).__name__ == "DTensor" for p in params.values()),
            "names": sorted(params),
            "units": sorted(
                n for n, m in module.named_modules() if getattr(m, "_fsdp_state", None) is not None
            ),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "world": trainer.world_size,
            "max_abs": max(
                float(getattr(p, "to_local", lambda p=p: p)().detach().abs().max())
                for p in params.values()
            ),
            "mesh_dims": sorted(
                {
                    tuple(getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())
                    for p in params.values()
                }
            ),
        }
        self.path.write_text(json.dumps({"losses": self.losses, "val": self.val, "facts": facts}))


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` once global step ``step`` is done."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def data(devices: int, samples: int = SAMPLES) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(SAMPLES, 7, generator=g), torch.randn(SAMPLES, 5, generator=g)
    return DataLoader(
        TensorDataset(x[:samples], y[:samples]), batch_size=GLOBAL_BATCH // devices, shuffle=False
    )


def fit(
    out: Path,
    run: str,
    strategy,
    *,
    devices: int = 2,
    steps: int = STEPS,
    ckpt_path: Path | None = None,
    on_meta: bool = False,
    callbacks: tuple = (),
    **trainer_kwargs,
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    module = Net(on_meta=on_meta)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[Recorder(out / f"{run}.json"), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        gradient_clip_val=0.5,
        **trainer_kwargs,
    )
    trainer.fit(module, data(devices), data(devices, samples=16), ckpt_path=ckpt_path)
    return trainer


class GPTNet(L.LightningModule):
    """The tiny GPT; with a strategy's ``tensor_parallel`` mesh dimension, cut over it."""

    def __init__(self) -> None:
        super().__init__()
        from fsdp.models import GPT, MODEL_SIZES

        self.model = GPT(MODEL_SIZES["tiny"])

    def configure_model(self) -> None:
        from fsdp.models import parallelize

        mesh = self.device_mesh
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()):
            if not isinstance(self.model.tok.weight.data, torch.distributed.tensor.DTensor):
                parallelize(self.model, mesh["tensor_parallel"], seq_len=SEQ)

    def training_step(self, batch: tuple[torch.Tensor], idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


SEQ = 16


def fit_gpt(
    out: Path,
    run: str,
    strategy,
    *,
    dp: int,
    steps: int = 4,
    ckpt_path: Path | None = None,
    callbacks: tuple = (),
) -> None:
    """``GPTNet`` on 2 devices, global batches of 8 windows of ``SEQ + 1`` tokens split over
    the ``dp`` data-parallel groups."""
    L.seed_everything(0, verbose=False)
    module = GPTNet()
    # 16 windows: 2 steps per epoch, so a checkpoint after step 2 is an epoch's end, where
    # Lightning resumes exactly (mid-epoch it restarts the data, under every strategy)
    tokens = torch.randint(0, 256, (16, SEQ + 1), generator=torch.Generator().manual_seed(5))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=[Recorder(out / f"{run}.json"), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        gradient_clip_val=0.5,
    )
    trainer.fit(
        module,
        DataLoader(TensorDataset(tokens), batch_size=GLOBAL_BATCH // dp, shuffle=False),
        ckpt_path=ckpt_path,
    )


def validate(out: Path, run: str, strategy, ckpt_path: Path) -> None:
    """``trainer.validate(ckpt_path=...)`` of a fresh module: the model alone is loaded."""
    L.seed_everything(1, verbose=False)  # other initial weights: the checkpoint must replace them
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(Net(), data(2, samples=16), ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        (out / f"{run}.json").write_text(json.dumps({"val": {"4": metrics["val_loss"]}}))


def suite(out: Path) -> None:
    fit(out, "ddp", "ddp")
    fit(out, "fsdp", FSDPStrategy(auto_wrap_policy={Block}))
    fit(
        out,
        "fsdp_ac",
        FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}),
    )
    fit(out, "registered", "fsdp_engine", steps=2)  # the name: defaults, the root one unit
    fit(out, "ddp_accumulate", "ddp", steps=2, accumulate_grad_batches=2)
    fit(
        out,
        "fsdp_accumulate",
        FSDPStrategy(auto_wrap_policy={Block}),
        steps=2,
        accumulate_grad_batches=2,
    )
    fit(
        out,
        "first",
        FSDPStrategy(auto_wrap_policy={Block}),
        steps=STEPS // 2,
        callbacks=(SaveAt(out / "ckpt", STEPS // 2),),
    )
    fit(out, "resumed", FSDPStrategy(auto_wrap_policy={Block}), ckpt_path=out / "ckpt")
    validate(out, "validated", FSDPStrategy(auto_wrap_policy={Block}), out / "ckpt")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fit(
        out,
        "bf16",
        FSDPStrategy(auto_wrap_policy={Block}, mixed_precision=bf16, reshard_after_forward=False),
        steps=4,
    )
    fit(out, "meta", FSDPStrategy(auto_wrap_policy={Block}), steps=4, on_meta=True)
    from fsdp.models import Block as GPTBlock

    fit_gpt(out, "gpt", FSDPStrategy(auto_wrap_policy={GPTBlock}), dp=2)
    fit_gpt(out, "gpt_tp", FSDPStrategy(auto_wrap_policy={GPTBlock}, tensor_parallel_size=2), dp=1)
    fit_gpt(
        out,
        "gpt_tp_first",
        FSDPStrategy(auto_wrap_policy={GPTBlock}, tensor_parallel_size=2),
        dp=1,
        steps=2,
        callbacks=(SaveAt(out / "tp_ckpt", 2),),
    )
    fit_gpt(
        out,
        "gpt_tp_resumed",
        FSDPStrategy(auto_wrap_policy={GPTBlock}, tensor_parallel_size=2),
        dp=1,
        ckpt_path=out / "tp_ckpt",
    )


def resume_one_device(out: Path) -> None:
    _wait_for_first_run(out)
    fit(out, "resumed1", FSDPStrategy(auto_wrap_policy={Block}), devices=1, ckpt_path=out / "ckpt")


def _wait_for_first_run(out: Path, timeout: float = 300.0) -> None:
    """Started with the suite so that its imports overlap the suite's runs: wait until the
    suite's ``first`` run has ended. Its ``first.json`` is written at the end of that fit,
    after ``OUT/ckpt`` was saved (a synchronous save: committed); no later run writes there."""
    deadline = time.monotonic() + timeout
    while not (out / "first.json").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"resume1: no {out / 'first.json'} after {timeout:g} s")
        time.sleep(0.2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"suite": suite, "resume1": resume_one_device}[mode](out_dir)
