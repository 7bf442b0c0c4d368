"""The built-in models of ``fsdp train`` and the benchmarks, and their tensor-parallel plans.

- `GPT` (`GPTConfig`, sizes in `MODEL_SIZES`): a GPT-style decoder, each `Block` an FSDP unit.
- `Llama` (`LlamaConfig`, sizes in `LLAMA_SIZES`): a Llama-style decoder for the GPU
  benchmarks and ``fsdp train --model``'s Llama sizes.
- `parallelize(model, tp_mesh)`: cuts either model Megatron-style over a tensor-parallel mesh
  before `fsdp_engine.fully_shard` shards it over the data-parallel one.
"""

from ._gpt import GPT, MODEL_SIZES, Block, GPTConfig, init_gpt_module
from ._llama import LLAMA_SIZES, Llama, LlamaBlock, LlamaConfig
from ._tp_plan import (
    FusedColwiseParallel,
    block_plan,
    check_tp_size,
    device_meshes,
    fuse_rows,
    parallelize,
    root_plan,
    tp_model_problem,
    unfuse_rows,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "MODEL_SIZES",
    "init_gpt_module",
    "Llama",
    "LlamaConfig",
    "LlamaBlock",
    "LLAMA_SIZES",
    "parallelize",
    "FusedColwiseParallel",
    "block_plan",
    "root_plan",
    "check_tp_size",
    "tp_model_problem",
    "device_meshes",
    "fuse_rows",
    "unfuse_rows",
]
