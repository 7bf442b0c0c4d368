"""Hugging Face in (issue #14 item 2): `load_hf_pretrained` fills a model built on meta and
sharded, from single-file and sharded safetensors, at 1, 2 and 3 ranks, giving the logits
transformers gives; each rank reads only its rows; ``fsdp train --hf-pretrained DIR`` starts
from the weights (its first loss is transformers' own); bad directories and bad
``--hf-config`` keys or values are errors that name the problem."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fsdp_comm import launch
from fsdp_engine import fully_shard
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402

import fsdp  # noqa: E402
from fsdp._cli import main as fsdp_main  # noqa: E402
from fsdp.hf import build_hf_pretrained, load_hf_pretrained, parse_hf_spec  # noqa: E402
from fsdp.train import ByteCorpus  # noqa: E402

TEXT = "\n".join(
    f"def f{i}(x):\n    return x * {i} + sum(range({i}))  # step {i}" for i in range(120)
)
INPUT = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def _gpt2() -> Any:
    return transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=300,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _llama() -> Any:
    return transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=112,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
    )


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny GPT-2 (tied head) and Llama (uneven MLP, grouped KV), saved whole and in shards
    with an index; the GPT-2 directories also hold a tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    dirs: dict[str, Path] = {}
    tokenizer = _tokenizer()
    for kind, config in (("gpt2", _gpt2()), ("llama", _llama())):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # far from any fresh initialisation (whose loss is ~ln 300)
            for p in model.parameters():
                p.normal_(0.0, 0.5)
        for layout, options in (("single", {}), ("sharded", {"max_shard_size": "20KB"})):
            path = root / f"{kind}-{layout}"
            model.save_pretrained(path, **options)
            tokenizer.save_pretrained(path)
            dirs[f"{kind}-{layout}"] = path
    assert (dirs["llama-sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(dirs["llama-sharded"].glob("model-*.safetensors"))) > 2
    return dirs


def _reference_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(INPUT).logits


def _sharded_logits(backend: Any, path: Path) -> tuple[torch.Tensor, Any]:
    hf = build_hf_pretrained(path)  # on meta: nothing allocated
    for block in hf.blocks:
        fully_shard(block, mesh=backend)
    fully_shard(hf.model, mesh=backend)
    report = load_hf_pretrained(hf.model, path)
    hf.model.eval()
    with torch.no_grad():
        return hf.model(INPUT).logits, report


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt2-single", "gpt2-sharded", "llama-single", "llama-sharded"])
def test_sharded_load_gives_transformers_logits(
    saved: dict[str, Path], name: str, world: int
) -> None:
    want = _reference_logits(saved[name])
    results = launch(_sharded_logits, world, backend="threads", args=(saved[name],))
    for logits, report in results:
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
        assert report.missing == [] and report.unexpected == []
    # Every rank read its share; together they read each sharded tensor once.
    total = results[0][1].full_bytes
    assert sum(r.bytes_read for _, r in results) == total
    if world > 1:
        assert all(r.bytes_read < total for _, r in results)


def _to_empty_then_load(backend: Any, path: Path) -> torch.Tensor:
    """FSDP2's flow: build on meta, shard, ``to_empty``, then load (the rotary buffers that
    ``to_empty`` left as garbage are computed again)."""
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=backend)
    fully_shard(model, mesh=backend)
    model.to_empty(device="cpu")
    fsdp.load_hf_pretrained(model, path)
    with torch.no_grad():
        return model.eval()(INPUT).logits


def test_to_empty_flow(saved: dict[str, Path]) -> None:
    want = _reference_logits(saved["llama-sharded"])
    for logits in launch(_to_empty_then_load, 2, backend="threads", args=(saved["llama-sharded"],)):
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_plain_model_reads_a_bf16_file_into_fp32(saved: dict[str, Path], tmp_path: Path) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(saved["gpt2-single"])
    ref.to(torch.bfloat16).save_pretrained(tmp_path)
    hf = build_hf_pretrained(tmp_path)
    report = load_hf_pretrained(hf.model, tmp_path)  # unsharded, materialised from meta
    assert next(hf.model.parameters()).dtype == torch.float32
    assert hf.model.lm_head.weight is hf.model.transformer.wte.weight  # still tied
    assert report.bytes_read == report.full_bytes
    with torch.no_grad():
        got = hf.model.eval()(INPUT).logits
        want = ref.float().eval()(INPUT).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---- no rank holds the full model ---------------------------------------------------------------
def _one_big_tensor(backend: Any, path: Path) -> tuple[Any, torch.Tensor]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 1000, bias=False))
    fully_shard(model, mesh=backend)
    report = load_hf_pretrained(model, path)
    return report, model[0].weight.to_local().clone()


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_only_its_rows(tmp_path: Path, world: int) -> None:
    weight = torch.randn(1000, 256)
    save_file({"0.weight": weight}, str(tmp_path / "model.safetensors"))
    results = launch(_one_big_tensor, world, backend="threads", args=(tmp_path,))
    full = weight.numel() * 4
    rows = -(-1000 // world)  # torch.chunk's split
    for rank, (report, local) in enumerate(results):
        assert report.full_bytes == full
        assert report.bytes_read <= rows * 256 * 4 < full  # about 1/world of the tensor
        assert report.largest_read_bytes == report.bytes_read  # one slice, never the whole
        assert torch.equal(local, weight[rank * rows : (rank + 1) * rows])
    assert sum(r.bytes_read for r, _ in results) == full


# ---- keys and shapes ----------------------------------------------------------------------------
def test_missing_and_unexpected_keys(tmp_path: Path) -> None:
    save_file(
        {"0.weight": torch.ones(4, 4), "1.weight": torch.ones(4)},
        str(tmp_path / "model.safetensors"),
    )

    def model() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 4))

    with pytest.raises(
        ValueError,
        match=r"1 tensors of the model are not in the files: 0\.bias; "
        r"1 tensors in the files are not in the model: 1\.weight",
    ):
        load_hf_pretrained(model(), tmp_path)
    m = model()
    report = load_hf_pretrained(m, tmp_path, strict=False)
    assert (report.missing, report.unexpected, report.loaded) == (
        ["0.bias"],
        ["1.weight"],
        ["0.weight"],
    )
    assert torch.equal(m[0].weight, torch.ones(4, 4)) and torch.equal(m[0].bias, torch.zeros(4))


def test_shape_mismatch_names_tensor_file_and_shapes(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    shutil.copytree(saved["gpt2-single"], tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config, "vocab_size": 301}))
    hf = build_hf_pretrained(tmp_path / "d")
    message = (
        r"transformer\.wte\.weight in .*model\.safetensors: the file holds shape "
        r"\[300, 64\], the model's transformer\.wte\.weight has shape \[301, 64\]"
    )
    with pytest.raises(ValueError, match=message):
        load_hf_pretrained(hf.model, tmp_path / "d")
    assert next(hf.model.parameters()).is_meta  # refused before anything was allocated


def test_bad_directories(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no such directory"):
        load_hf_pretrained(model, tmp_path / "nope")
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        load_hf_pretrained(model, tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin, PyTorch's pickled format"):
        load_hf_pretrained(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"weight": "../elsewhere.safetensors"}})
    )
    with pytest.raises(
        ValueError, match="names the file '../elsewhere.safetensors', which is not in"
    ):
        load_hf_pretrained(model, tmp_path)


# ---- fsdp train --hf-pretrained ------------------------------------------------------------------
def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        fsdp_main(["train", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err.rpartition("usage: fsdp train")[2]
    return err


def test_train_starts_from_the_weights(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = saved["gpt2-sharded"]
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    assert (
        fsdp_main(
            [
                "train",
                "--hf-pretrained",
                str(path),
                "--steps",
                "2",
                "--world-size",
                "2",
                "--backend",
                "threads",
                "--seq-len",
                "32",
                "--data",
                str(data),
                "--no-progress",
                "--json",
                "--threads-per-rank",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert len(summary["losses"]) == 2
    # transformers' model on the same first batch (the text in the directory's tokens)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    corpus = ByteCorpus(ids, "")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    losses = []
    with torch.no_grad():
        for rank in range(2):
            x, y = corpus.batch(step=0, seed=0, global_batch=8, seq_len=32, rank=rank, world_size=2)
            losses.append(F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item())
    assert summary["losses"][0] == pytest.approx(sum(losses) / 2, abs=1e-4)
    assert abs(summary["losses"][0] - math.log(300)) > 0.5  # not a fresh model's loss


def test_train_refuses_bad_directories(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(["--hf-pretrained", str(tmp_path / "nope")], capsys)
    assert "--hf-pretrained: no such directory: " in err
    (tmp_path / "empty").mkdir()
    err = _refused(["--hf-pretrained", str(tmp_path / "empty")], capsys)
    assert "has no config.json (save_pretrained writes one)" in err
    no_tokenizer = tmp_path / "no-tok"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(saved["llama-single"] / name, no_tokenizer / name)
    err = _refused(["--hf-pretrained", str(no_tokenizer)], capsys)
    assert "has no tokenizer AutoTokenizer can load" in err
    err = _refused(["--hf-pretrained", str(saved["gpt2-single"]), "--hf-config", "gpt2"], capsys)
    assert "--hf-config and --hf-pretrained both name the model" in err
    err = _refused(["--hf-pretrained", str(saved["gpt2-single"]), "--seq-len", "65"], capsys)
    assert "--seq-len must be at most 64" in err


# ---- --hf-config: keys and values checked in config.json files too -----------------------------
def _config_file(tmp_path: Path, **values: Any) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, **values}))
    return str(path)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"n_layers": 2}, "GPT2Config (gpt2) has no key 'n_layers'; did you mean n_layer"),
        ({"n_embd": "64"}, "n_embd of gpt2 must be an integer, got '64'"),
        ({"n_head": True}, "n_head of gpt2 must be an integer, got true"),
        ({"layer_norm_epsilon": [1]}, "layer_norm_epsilon of gpt2 must be a number, got [1]"),
        ({"eos_token_id": ["a"]}, "eos_token_id of gpt2 must be an integer or a JSON list"),
    ],
)
def test_config_file_keys_and_values_are_checked(
    tmp_path: Path, values: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config_file(tmp_path, **values)
    err = _refused(["--hf-config", path], capsys)
    assert f"--hf-config: {path}: {message}" in err


def test_saved_and_hub_config_files_pass(saved: dict[str, Path], tmp_path: Path) -> None:
    assert parse_hf_spec(str(saved["llama-single"] / "config.json")).num_hidden_layers == 2
    assert parse_hf_spec(str(saved["gpt2-single"])).n_layer == 2  # a directory names its file
    # Keys of hub files transformers converts or keeps (gpt2's n_ctx), a list where an
    # integer or a list is declared (Llama 3's eos_token_id): accepted.
    config = parse_hf_spec(_config_file(tmp_path, n_ctx=1024, eos_token_id=[1, 2]))
    assert config.eos_token_id == [1, 2] and config.vocab_size == 256
    llama = parse_hf_spec("llama:num_hidden_layers=1,rope_theta=500000")
    assert llama.rope_parameters["rope_theta"] == 500000
