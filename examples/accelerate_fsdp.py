"""Train with this project's FSDP engine inside a Hugging Face Accelerate loop.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_fsdp.py --out /tmp/run
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_fsdp.py --out /tmp/run

Both commands start two processes, on CPU (gloo) or on GPUs (NCCL). ``--multi_gpu`` picks
Accelerate's torchrun launcher, and it works on a machine without GPUs as well, because the
script asks for ``cpu=True`` there. ``accelerate launch --cpu --num_processes 2`` starts only
one process: Accelerate runs several CPU processes only through ``mpirun``
(``--mpirun_hostfile``). Run the same command again to resume from the last checkpoint in
``--out``. A plain ``python examples/accelerate_fsdp.py --out ...`` runs one process.

Accelerate takes only torch's own FSDP as a plugin, so this script uses Accelerate for what
does not touch the model: the process group, the per-rank data split, gradient accumulation,
``backward`` and gradient clipping. The model is sharded by hand:

- ``Accelerator()`` gets no FSDP plugin. With several processes it sees a ``MULTI_GPU`` run,
  or ``MULTI_CPU`` given ``cpu=True``, and sets up the default process group. Without
  ``cpu=True``, a torchrun job on a machine without GPUs is ``DistributedType.NO``, and each
  process would train alone.
- The model is **not** passed to ``accelerator.prepare``: there it would be wrapped in
  ``DistributedDataParallel``. It is sharded with ``fsdp_engine.fully_shard`` on a
  DeviceMesh over Accelerate's process group, one unit per block and then the root.
- The optimizer and the DataLoader are prepared. The optimizer then steps only at the end of
  each accumulation window. The loader gives each process its own batches, and with
  ``use_seedable_sampler`` the shuffle is the same on every rank and after a resume.
- ``accelerator.accumulate(model)`` calls the sharded model's ``no_sync()``. The engine
  supports it: gradients add up unsharded and are reduce-scattered once, at the last
  micro-batch.
- Checkpoints are ``fsdp_ckpt.save``/``load`` (sharded, crash-safe, resumable at another
  world size), not ``accelerator.save_state``, which cannot save a model it did not prepare.

See docs/drafts/accelerate.md for what else in Accelerate does not apply.
"""

from __future__ import annotations

import argparse
import json
import os

import fsdp_ckpt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from fsdp_engine import fully_shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Net(nn.Module):
    """8 -> 13 -> 6 blocks (13 rows do not split evenly over 2 ranks), then a 6 -> 4 head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(8, 13), Block(13, 6))
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class Samples(Dataset):
    """``n`` fixed (index, input, class) samples: the index lets a run log its data order."""

    def __init__(self, n: int = 96, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def build_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return Net()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint path (resumes from it if present)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=4, help="samples per process per micro-batch")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-grad-norm", type=float, default=0.3)
    p.add_argument("--save-every", type=int, default=4, help="save every N optimizer steps")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this step (and its save), as if the job were interrupted",
    )
    p.add_argument("--log-file", default=None, help="rank 0 appends one JSON line per step here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(
        # Without cpu=True, a torchrun job on a machine with no GPU is DistributedType.NO:
        # every process would train alone. `accelerate launch --cpu` sets it too.
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=args.grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=1234),
    )

    # 1. Shard the model ourselves, over the process group Accelerate initialised (a run of
    #    one process has none: give it a group of one, so the same code runs).
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build_model().to(accelerator.device)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # 2. The optimizer sees the sharded (DTensor) parameters; prepare it and the data only.
    raw_optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(Samples(), batch_size=args.batch_size, shuffle=True, drop_last=True)
    optimizer, loader = accelerator.prepare(raw_optimizer, loader)
    if len(loader) % args.grad_accum:
        raise SystemExit(
            f"{len(loader)} micro-batches per epoch per process: not a multiple "
            f"of --grad-accum {args.grad_accum}"
        )

    # 3. Resume: fsdp_ckpt reshards into this world size; the data position follows the step.
    step = 0
    if os.path.exists(os.path.join(args.out, "CURRENT")):
        step = fsdp_ckpt.load(args.out, model, raw_optimizer)["step"]
        accelerator.print(f"resumed from {args.out} at step {step}")
    consumed = step * args.grad_accum  # micro-batches each process has used
    epoch, skip = divmod(consumed, len(loader))

    losses: list[torch.Tensor] = []
    samples: list[torch.Tensor] = []
    while step < args.steps:
        loader.set_epoch(epoch)  # seeded shuffle of this epoch, the same on every rank
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for idx, x, y in batches:
            with accelerator.accumulate(model):  # model.no_sync() until the last micro-batch
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)  # divides by grad_accum
                losses.append(loss.detach())
                if args.log_file:  # which samples this step used, for the log (a collective)
                    samples.append(accelerator.gather(idx))
                grad_norm = None
                if accelerator.sync_gradients:  # torch's clip_grad_norm_: DTensor-aware
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()  # a no-op until the window is complete
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean = accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item()
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            accelerator.print(f"step {step} loss {mean:.6f} grad_norm {float(norm):.6f}")
            if args.log_file and accelerator.is_main_process:
                with open(args.log_file, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "step": step,
                                "loss": mean,
                                "grad_norm": float(norm),
                                "samples": [s.tolist() for s in samples],
                            }
                        )
                        + "\n"
                    )
            losses, samples = [], []
            if step % args.save_every == 0 or step == args.steps:
                fsdp_ckpt.save(args.out, model, raw_optimizer, extra={"step": step}, keep_last=2)
            if step == args.stop_after or step == args.steps:
                break
        if step == args.stop_after:
            break
        epoch += 1
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
