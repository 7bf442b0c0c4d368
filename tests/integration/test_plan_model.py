"""`fsdp plan`'s models: presets with their published parameter counts, Hugging Face
``config.json`` files against the models transformers builds from them, a bare count matched to
a preset, and the engine's own layout rule and constants (imported, not copied)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_engine import ALIGN_BYTES, MAX_REDUCTIONS_IN_FLIGHT, FlatLayout, ShardingStrategy
from fsdp_memory import MemoryManager

import fsdp.plan._plan as P
from fsdp.plan import ModelShape, PlanError, padded_numel, plan
from fsdp.plan._hf import read_hf_config
from fsdp.plan._presets import PRESETS, nearest_preset, preset

#: Parameter counts published for these checkpoints (model cards; Hugging Face's
#: ``num_parameters()``; GPT-2's with its position embeddings and tied head).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


# ---- presets -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_are_the_published_ones(name: str) -> None:
    assert PRESETS[name].num_params == PUBLISHED[name]
    assert ModelShape.from_name(name).total_params == PUBLISHED[name]


def test_preset_shapes() -> None:
    l3 = PRESETS["llama3-8b"]
    assert (l3.n_layers, l3.d_model, l3.n_heads, l3.n_kv_heads, l3.ffn_dim, l3.vocab_size) == (
        32,
        4096,
        32,
        8,
        14336,
        128256,
    )
    q, k, v = ModelShape.from_name("llama3-8b").block_params[:3]
    assert q == (4096, 4096) and k == v == (1024, 4096)  # GQA: 8 kv heads of 128
    gpt2 = ModelShape.from_name("gpt2")
    assert (1024, 768) in gpt2.root_params and len(gpt2.root_params) == 4  # tied: no head
    assert preset("Llama-3-8B") is PRESETS["llama3-8b"] and preset("gpt2-small") is PRESETS["gpt2"]
    assert ModelShape.from_name("llama3.1-8b").seq_len == 8192  # context 131072, capped


def test_a_bare_count_takes_the_nearest_preset() -> None:
    p = plan(70e9, gpus=8)
    assert p.model.architecture is PRESETS["llama3-70b"]
    assert p.model.total_params == PUBLISHED["llama3-70b"]
    assert "llama3-70b" in p.model.note and "+0.8%" in p.model.note
    assert nearest_preset(int(7e9)) is PRESETS["llama2-7b"]
    assert nearest_preset(int(1e9)) is None
    guess = plan(1e9, gpus=8).model
    assert guess.architecture is None and "guessed" in guess.note
    explicit = plan(70e9, layers=80, d_model=8192, gpus=8).model
    assert explicit.total_params == 70_000_000_000 and explicit.note == ""


# ---- Hugging Face config.json ----------------------------------------------------------------
def _write(tmp_path: Path, data: dict[str, Any], name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


LLAMA3_8B_CONFIG = {  # meta-llama/Meta-Llama-3-8B's config.json (the keys the planner reads)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
}
GPT2_CONFIG = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
    "n_inner": None,
}


def test_published_configs_read_as_plain_json(tmp_path: Path) -> None:
    llama = read_hf_config(_write(tmp_path, LLAMA3_8B_CONFIG))
    assert llama.num_params == PUBLISHED["llama3-8b"]
    gpt2 = read_hf_config(_write(tmp_path, GPT2_CONFIG, "g") / "config.json")  # the file
    assert gpt2.num_params == PUBLISHED["gpt2"] and gpt2.ffn_dim == 3072
    p = plan(ModelShape.from_hf_config(tmp_path / "m"), gpus=8)
    assert p.model.total_params == PUBLISHED["llama3-8b"]


@pytest.mark.parametrize(
    "data, words",
    [
        (
            {"model_type": "t5"},
            "model_type 't5' is not supported; supported: llama, mistral, qwen2, gpt2",
        ),
        ({**LLAMA3_8B_CONFIG, "hidden_size": None}, "has no 'hidden_size' (model_type llama"),
        ({k: v for k, v in GPT2_CONFIG.items() if k != "n_layer"}, "has no 'n_layer'"),
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": "32"}, "num_hidden_layers must be an int >= 1"),
        ({**LLAMA3_8B_CONFIG, "num_key_value_heads": 5}, "multiple of n_kv_heads (5)"),
    ],
)
def test_config_errors_name_the_key_and_file(
    tmp_path: Path, data: dict[str, Any], words: str
) -> None:
    folder = _write(tmp_path, data)
    with pytest.raises(PlanError) as info:
        read_hf_config(folder)
    assert info.value.argument == "hf_config"
    assert words in info.value.message and str(folder / "config.json") in info.value.message


def test_missing_or_broken_config(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no config.json in directory"):
        read_hf_config(tmp_path)
    with pytest.raises(PlanError, match="no such file"):
        read_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match="not readable JSON"):
        read_hf_config(tmp_path)


def _hf_configs(transformers: Any) -> dict[str, Any]:
    tiny = dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=128,
    )
    return {
        "llama-gqa": transformers.LlamaConfig(**tiny),
        "llama-biases-tied": transformers.LlamaConfig(
            **tiny, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=32
        ),
        "mistral": transformers.MistralConfig(**tiny),
        "qwen2": transformers.Qwen2Config(**tiny),
        "gpt2": transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=32
        ),
        "gpt2-inner": transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=32, n_inner=100
        ),
    }


@pytest.mark.parametrize(
    "kind", ["llama-gqa", "llama-biases-tied", "mistral", "qwen2", "gpt2", "gpt2-inner"]
)
def test_counts_match_the_model_transformers_builds(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = _hf_configs(transformers)[kind]
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = ModelShape.from_hf_config(tmp_path)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    blocks = model.transformer.h if kind.startswith("gpt2") else model.model.layers
    assert shape.block_params == tuple(tuple(p.shape) for p in blocks[0].parameters())
    assert shape.n_layers == len(blocks)


# ---- the engine's rules, imported ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shard_count", [1, 2, 3, 8, 64])
def test_padding_is_the_engines_layout(dtype: torch.dtype, shard_count: int) -> None:
    """The plan's padded unit size equals a real `FlatLayout` of uneven parameters."""
    shapes = [(3,), (5, 7), (1,), (130, 3), (17,), (2, 3, 5), (4097,)]
    named = [
        (f"p{i}", (), torch.empty(s, dtype=dtype, device="meta")) for i, s in enumerate(shapes)
    ]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for n in range(1, len(shapes) + 1):
        layout = FlatLayout.build(named[:n], shard_count, dtype)
        assert (
            padded_numel(shapes[:n], shard_count=shard_count, itemsize=itemsize)
            == layout.padded_numel
        ), (n, shapes[:n])
    assert padded_numel([10], shard_count=3, itemsize=4) == padded_numel(
        [(10,)], shard_count=3, itemsize=4
    )  # a bare count is 1-D


@pytest.mark.parametrize("world", [3, 64])
def test_a_real_unit_is_padded_as_planned(world: int) -> None:
    """A GPT block and its root sharded ``world`` ways (fake backend): their FlatParameters
    are exactly as long as the plan's padded units."""
    from fsdp_comm import FakeBackend
    from fsdp_engine import fully_shard, sharded_layout

    from fsdp.models import GPT, MODEL_SIZES

    cfg = MODEL_SIZES["small"]
    model = GPT(cfg)
    mesh = FakeBackend(rank=0, world_size=world)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded_layout(model)  # builds the units
    shape = ModelShape.from_config(cfg)
    for module, params in ((model.blocks[0], shape.block_params), (model, shape.root_params)):
        layout = module._fsdp_state.unit.groups[0].flat.layout
        assert layout.padded_numel == padded_numel(params, shard_count=world, itemsize=4)


def test_constants_are_the_engines() -> None:
    assert P.ALIGN_BYTES == ALIGN_BYTES
    assert P.GATHERS_IN_FLIGHT == MemoryManager("cpu").config.max_inflight_all_gathers
    assert P.REDUCTIONS_IN_FLIGHT == MAX_REDUCTIONS_IN_FLIGHT + 1
    assert P.STRATEGIES == tuple(s.value for s in ShardingStrategy)
