"""`FSDPStrategy`: a LightningModule trained on this engine, checkpointed with fsdp-ckpt.

```python
trainer = Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=2)
```

Setup follows Lightning's own FSDP2 strategy (``ModelParallelStrategy``): processes are launched
by re-running the script (Lightning's subprocess launcher, or torchrun/Slurm), torch.distributed
is initialised (gloo on CPU, NCCL on GPU), ``configure_model`` runs, then the strategy shards the
module (each submodule ``auto_wrap_policy`` picks, then the root), materialises a ``meta``-device
model, and only then does Lightning create the optimizers, on the sharded DTensor parameters.

With ``tensor_parallel_size=N`` (Lightning's ``ModelParallelStrategy`` names) the ranks form a
``(data_parallel, tensor_parallel)`` DeviceMesh (or ``(replicate, shard, tensor_parallel)`` with
``device_mesh=(replicate, shard)``): ``configure_model`` applies tensor parallelism on
``self.device_mesh["tensor_parallel"]`` (``parallelize_module``, or `fsdp.models.parallelize`
for this project's GPT and Llama), then the strategy shards over the data-parallel dimensions,
and every rank of one tp group gets the same batches::

    class Model(L.LightningModule):
        def configure_model(self):
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)

    Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}, tensor_parallel_size=2), devices=4)

``trainer.save_checkpoint(path)`` writes an fsdp-ckpt checkpoint directory at ``path``: every
rank writes its own slices of the parameters and optimizer state; the rest of Lightning's
checkpoint (loops, callbacks, schedulers, hyperparameters) is committed in the same version
(Note [Lightning checkpoint contents] in ``_lightning_checkpoint.py``). ``fit(ckpt_path=path)``
resumes from it at any number of devices. Importing this module registers the strategy name
``"fsdp_engine"`` (``Trainer(strategy="fsdp_engine")`` uses the defaults).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch

# Lightning's own strategies import these names from where they do, which does not list them
# as exports (attr-defined); unused-ignore: without lightning installed they are Any.
from lightning.fabric.plugins.collectives.torch_collective import (  # type: ignore[attr-defined, unused-ignore]
    default_pg_timeout,
)
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group  # type: ignore[attr-defined, unused-ignore]
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import (  # type: ignore[attr-defined, unused-ignore]
    rank_zero_only,
    rank_zero_warn,
)
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from ._lightning_checkpoint import from_extra, to_extra
from ._lightning_wrap import (
    Policy,
    as_predicate,
    has_meta,
    is_sharded,
    materialize,
    shard_module,
    tp_size,
)

__all__ = ["FSDPStrategy"]

STRATEGY_NAME = "fsdp_engine"


class FSDPStrategy(ParallelStrategy):  # type: ignore[misc, unused-ignore]  # Any without lightning
    """Fully sharded data parallel training on this project's engine (FSDP2-compatible).

    Arguments:
        auto_wrap_policy: which submodules become units of their own (one all-gather and one
            reduce-scatter each): a set of ``nn.Module`` classes, or a callable(module) -> bool.
            The root is always a unit. None: the root only (the whole model is one unit).
        activation_checkpointing_policy: the same kind of value; those modules' forward is
            recomputed in backward (``torch.utils.checkpoint``, non-reentrant). Parameter
            names do not change, so checkpoints load with or without it.
        mixed_precision: a ``MixedPrecisionPolicy`` (torch's FSDP2 one or ``fsdp_engine``'s) or
            FSDP1's ``MixedPrecision``.
        reshard_after_forward: free gathered parameters after forward (True), keep them until
            backward (False), or reshard to groups of that many ranks (int). None (the
            default): free them in every unit but the root and the last to run forward.
        offload_policy: ``CPUOffloadPolicy()`` (torch's or ``fsdp_engine``'s) to keep shards on
            the host.
        sync_module_states: every rank starts from rank 0's initial weights and buffers, as
            under DDP (one broadcast per unit at setup). Not for a ``meta``-device model, whose
            ``reset_parameters()`` runs on the shards after sharding.
        device_mesh: None (one dimension over every rank), ``(replicate, shard)`` for hybrid
            sharding, a torch ``DeviceMesh``, or any ``fsdp_comm`` backend or mesh.
        tensor_parallel_size: ranks per tensor-parallel group (consecutive ranks; default 1:
            none). ``configure_model`` cuts the model over ``self.device_mesh
            ["tensor_parallel"]``; FSDP shards over the other dimensions.
        data_parallel_size: "auto" (the world size / ``tensor_parallel_size``) or that number,
            as Lightning's ``ModelParallelStrategy`` takes it.
        process_group_backend: "gloo", "nccl"...; default: the device's (gloo on CPU).
        timeout: of torch.distributed's collectives.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        auto_wrap_policy: Policy = None,
        activation_checkpointing_policy: Policy = None,
        mixed_precision: Any = None,
        reshard_after_forward: bool | int | None = None,
        offload_policy: Any = None,
        sync_module_states: bool = True,
        device_mesh: Any = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | str = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._wrap = as_predicate(auto_wrap_policy, "auto_wrap_policy")
        self._checkpointing = as_predicate(
            activation_checkpointing_policy, "activation_checkpointing_policy"
        )
        self._unit_kwargs = {
            "reshard_after_forward": reshard_after_forward,
            "mp_policy": mixed_precision,
            "offload_policy": offload_policy,
        }
        self._sync_module_states = sync_module_states
        self._mesh_arg = device_mesh
        self._tp = tp_size(tensor_parallel_size, data_parallel_size, device_mesh)
        self._dp_arg = data_parallel_size
        self._mesh: Any = None  # what the units shard over
        self._full_mesh: Any = None  # with tensor parallelism: every dimension
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1

    # ---- processes and devices -------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device: torch.device = self.parallel_devices[self.local_rank]
        return device

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for strategies it does not know: it then adds a DistributedSampler
        to the dataloaders and reduces ``self.log(..., sync_dist=True)`` values across ranks."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank its own batches; with tensor parallelism, every rank of a tp group (tp
        consecutive ranks) the same ones."""
        world = self.num_nodes * self.num_processes
        return {"num_replicas": world // self._tp, "rank": self.global_rank // self._tp}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def device_mesh(self) -> Any:
        """What the units are sharded over (set up in `setup_environment`); with
        ``tensor_parallel_size``, the whole mesh (its ``"tensor_parallel"`` dimension is what
        ``configure_model`` cuts the model over)."""
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once the processes are initialised")
        return self._full_mesh if self._full_mesh is not None else self._mesh

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the sharded model and the optimizers made for it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already did

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # the rank is an attribute these functions keep (their stubs do not declare it)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined, unused-ignore]

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend
            or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=device_id,
        )
        if self._tp > 1:
            self._full_mesh, self._mesh = self._build_tp_mesh()
        else:
            self._mesh = self._build_mesh()
        from torch.distributed.device_mesh import DeviceMesh

        mesh = self.device_mesh
        if isinstance(mesh, DeviceMesh):  # LightningModule.device_mesh, in configure_model
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = mesh

    def _build_tp_mesh(self) -> tuple[Any, Any]:
        """(the whole mesh, its data-parallel part) for ``tensor_parallel_size``."""
        from torch.distributed.device_mesh import init_device_mesh

        tp, world, kind = self._tp, self.world_size, self.root_device.type
        if world % tp:
            raise ValueError(
                f"tensor_parallel_size must divide the world size {world} (the "
                f"data-parallel size is world size / tensor_parallel_size), got "
                f"{tp}"
            )
        dp = world // tp
        if self._dp_arg != "auto" and self._dp_arg != dp:
            raise ValueError(
                f"data_parallel_size must be 'auto' or the world size {world} / "
                f"tensor_parallel_size {tp} = {dp}, got {self._dp_arg!r}"
            )
        if self._mesh_arg is None:
            mesh = init_device_mesh(
                kind, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel")
            )
            return mesh, mesh["data_parallel"]
        replicate, shard = self._mesh_arg
        if replicate * shard != dp:
            raise ValueError(
                f"device_mesh={self._mesh_arg}: replicate x shard must equal the "
                f"data-parallel size {dp} (world size {world} / "
                f"tensor_parallel_size {tp})"
            )
        mesh = init_device_mesh(
            kind, (replicate, shard, tp), mesh_dim_names=("replicate", "shard", "tensor_parallel")
        )
        return mesh, mesh["replicate", "shard"]

    def _build_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self._mesh_arg
        kind = self.root_device.type
        if mesh is None:
            return init_device_mesh(kind, (self.world_size,))
        if isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(n, int) for n in mesh):
            if mesh[0] * mesh[1] != self.world_size:
                raise ValueError(
                    f"device_mesh={mesh}: replicate x shard must equal the world "
                    f"size {self.world_size}"
                )
            return init_device_mesh(kind, mesh, mesh_dim_names=("replicate", "shard"))
        return mesh

    # ---- the model ---------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        # has-type: without lightning installed, mypy cannot type the base class's model
        assert self.accelerator is not None and self.model is not None  # type: ignore[has-type, unused-ignore]
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)  # type: ignore[has-type, unused-ignore]
        self.model = self.precision_plugin.convert_module(self.model)
        if not has_meta(self.model):
            self.model_to_device()
        self.model = self._setup_model(self.model)
        uninitialized = materialize(self.model, self.root_device)
        if uninitialized:
            rank_zero_warn(
                "meta-device model: these modules have no reset_parameters() and are "
                f"left uninitialized: {', '.join(uninitialized)}"
            )
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if is_sharded(model):  # a second fit/validate on the same module
            return model
        sync = self._sync_module_states and not has_meta(model)
        return shard_module(
            model,
            mesh=self._mesh,
            wrap=self._wrap,
            checkpointing=self._checkpointing,
            sync_module_states=sync,
            **self._unit_kwargs,
        )

    def setup_optimizers(self, trainer: Any) -> None:
        self._reset_optimizers_and_schedulers()  # a re-setup must not keep stale parameters
        super().setup_optimizers(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        # empty_init: build on meta; `setup` shards, then allocates and calls reset_parameters
        with (
            torch.device("meta") if empty_init else nullcontext(),
            self.precision_plugin.tensor_init_context(),
        ):
            yield

    def teardown(self) -> None:
        # Unlike Strategy.teardown, leave the sharded model and optimizer where they are:
        # trainer.save_checkpoint after fit still needs them.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- collectives ---------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- checkpoints ---------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The sharded state dict (DTensors, no communication), as under FSDP2; the checkpoint
        itself is written from the model by fsdp_ckpt, not from this dict."""
        assert self.model is not None
        state: dict[str, Any] = self.model.state_dict()
        return state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # saved from the optimizer itself by fsdp_ckpt (see save_checkpoint)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded the optimizer

    def _the_optimizer(self, what: str) -> Optimizer | None:
        if len(self.optimizers) > 1:
            raise NotImplementedError(
                f"FSDPStrategy {what}: fsdp_ckpt checkpoints hold one optimizer, this module has "
                f"{len(self.optimizers)}"
            )
        return self.optimizers[0] if self.optimizers else None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` as an fsdp-ckpt checkpoint directory at ``filepath`` (every rank
        calls it; each writes its own slices). A regular file there is replaced."""
        import fsdp_ckpt

        if storage_options is not None:
            raise TypeError(
                "FSDPStrategy.save_checkpoint(storage_options=...) is not supported: "
                "checkpoints are written by fsdp_ckpt, not a CheckpointIO"
            )
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # rank 0's path, on every rank
        if self.is_global_zero and os.path.isfile(path):
            os.unlink(path)
        optimizer = self._the_optimizer("save") if "optimizer_states" in checkpoint else None
        assert self.model is not None
        fsdp_ckpt.save(path, self.model, optimizer, extra=to_extra(checkpoint))

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load model (and optimizer) state from an fsdp-ckpt checkpoint at any world size;
        return the rest of Lightning's checkpoint for it to restore loops and callbacks."""
        import fsdp_ckpt

        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        # rank 0 reads the index; every rank gets its answer (or its error, to raise alike)
        has_optimizer, error = self.broadcast(_probe(path) if self.is_global_zero else None)
        if error is not None:
            raise ValueError(error)
        optimizer = self._the_optimizer("load") if has_optimizer else None
        assert self.model is not None and self.lightning_module is not None
        extra = fsdp_ckpt.load(
            path, self.model, optimizer, strict=self.lightning_module.strict_loading
        )
        return from_extra(extra, weights_only=weights_only, source=path)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME,
                cls,
                description="Fully sharded data parallel on fsdp_engine (fsdp.integrations)",
            )


def _probe(path: str) -> tuple[bool, str | None]:
    """(whether the checkpoint at ``path`` holds optimizer state, None), or (False, why it
    cannot be loaded: not an fsdp-ckpt checkpoint, such as another strategy's .ckpt file)."""
    import fsdp_ckpt

    if os.path.isfile(path):
        return False, (
            f"{path} is a single file (another strategy's torch.save checkpoint?); "
            "FSDPStrategy resumes from fsdp-ckpt checkpoint directories, written by "
            "trainer.save_checkpoint under this strategy"
        )
    try:
        return fsdp_ckpt.inspect_checkpoint(path).optimizer is not None, None
    except Exception as exc:  # raised on every rank by the caller
        return False, f"cannot load {path} as an fsdp-ckpt checkpoint: {exc}"


FSDPStrategy.register_strategies(StrategyRegistry)
