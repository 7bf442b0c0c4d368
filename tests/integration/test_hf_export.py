"""Hugging Face out: `save_hf_pretrained` (a live sharded model), `export_hf` (a checkpoint)
and ``fsdp export-hf``, checked by loading the result with ``from_pretrained``."""

from __future__ import annotations

import copy
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import fsdp_ckpt  # noqa: E402
import torch  # noqa: E402
from fsdp_comm import Backend, launch  # noqa: E402
from fsdp_engine import fully_shard  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

from fsdp import export_hf, save_hf_pretrained  # noqa: E402
from fsdp._cli import main as fsdp_main  # noqa: E402

TIMEOUT = 120
SMALL = "100K"  # 102400 bytes (powers of 1024): forces >= 3 files for both tiny models
SMALL_BYTES = 102400
_LOCK = threading.Lock()  # rank threads share torch's global RNG: build one at a time

CONFIGS = {
    "gpt2": lambda: GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=300,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": lambda: LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=112,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


class Reference:
    """A tiny model written by ``save_pretrained``, whole and sharded by HF itself (from a
    model built from its config: transformers 5 saves a model loaded by ``from_pretrained`` in
    sorted-name order instead, so its files are cut elsewhere; we follow state-dict order)."""

    def __init__(self, arch: str, root: Path) -> None:
        torch.manual_seed(0)
        built = AutoModelForCausalLM.from_config(CONFIGS[arch]())
        self.dir = root / f"{arch}-ref"
        built.save_pretrained(self.dir)
        self.hf_sharded = root / f"{arch}-ref-sharded"
        built.save_pretrained(self.hf_sharded, max_shard_size=SMALL_BYTES)
        self.hf_tiny = root / f"{arch}-ref-tiny"  # nearly every tensor over the limit
        built.save_pretrained(self.hf_tiny, max_shard_size=1024)
        self.model = AutoModelForCausalLM.from_pretrained(self.dir).eval()
        self.ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
        self.logits = _logits(self.model, self.ids)
        with safe_open(str(self.dir / "model.safetensors"), framework="pt") as f:
            self.keys = set(f.keys())

    def check(self, out: Path) -> None:
        loaded = AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(_logits(loaded, self.ids), self.logits, rtol=0, atol=1e-6)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(request.param, tmp_path_factory.mktemp(request.param))


def _index(out: Path) -> dict[str, Any]:
    return json.loads((out / "model.safetensors.index.json").read_text())


def _check_sharded(ref: Reference, out: Path, report: Any, limit: int) -> None:
    """A valid index, the files HF itself makes for this limit, the memory bound, logits."""
    index = _index(out)
    weight_map = index["weight_map"]
    assert set(weight_map) == ref.keys  # every tensor once: the tied lm_head.weight dropped
    assert weight_map == _index(ref.hf_sharded)["weight_map"]  # HF's own plan, file for file
    files = sorted(set(weight_map.values()))
    assert len(files) >= 3 and files == list(report.files)
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    assert not (out / "model.safetensors").exists()
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            assert {k for k, v in weight_map.items() if v == name} == set(f.keys())
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            nbytes = sum(torch.Size(s).numel() * 4 for s in sizes)
            assert nbytes <= limit or len(sizes) == 1, (name, nbytes)
            total += nbytes
    assert index["metadata"]["total_size"] == total == report.total_size
    assert report.peak_shard_bytes <= limit + report.largest_tensor
    if report.largest_tensor <= limit:
        assert report.peak_shard_bytes <= limit
    ref.check(out)


def _shard_copy(be: Backend, model: Any) -> Any:
    with _LOCK:
        model = copy.deepcopy(model).train()  # the reference's weights; no re-seeding
    blocks = set(model._no_split_modules)
    for m in list(model.modules()):
        if type(m).__name__ in blocks:
            fully_shard(m, mesh=be)
    fully_shard(model, mesh=be)
    return model


def _live_export(be: Backend, model: Any, out: str, ckpt: str) -> Any:
    sharded = _shard_copy(be, model)
    report = save_hf_pretrained(sharded, out, max_shard_size=SMALL)
    fsdp_ckpt.save(ckpt, sharded)
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_live_model_and_its_checkpoint_load_with_from_pretrained(
    ref: Reference, world: int, tmp_path: Path
) -> None:
    out, ckpt = tmp_path / "live", tmp_path / "ckpt"
    reports = launch(
        _live_export,
        world,
        backend="threads",
        args=(ref.model, str(out), str(ckpt)),
        timeout=TIMEOUT,
    )
    assert all(r.files == reports[0].files for r in reports)
    _check_sharded(ref, out, reports[0], SMALL_BYTES)
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        type(ref.model).__name__
    ]
    # (b) The checkpoint of the same model, exported: the same files.
    report = export_hf(ckpt, tmp_path / "from-ckpt", config=ref.model.config, max_shard_size=SMALL)
    _check_sharded(ref, tmp_path / "from-ckpt", report, SMALL_BYTES)
    for name in report.files:
        assert (tmp_path / "from-ckpt" / name).read_bytes() == (out / name).read_bytes()


def test_single_file_dtype_and_stale_files(ref: Reference, tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    fsdp_ckpt.save(ckpt, ref.model)  # a plain model: rank 0 writes it whole
    # Every tensor over the limit: one file each (as HF does), each larger than the limit.
    tiny = export_hf(ckpt, out, config=ref.dir, max_shard_size=1024)
    assert _index(out)["weight_map"] == _index(ref.hf_tiny)["weight_map"]
    assert len(tiny.files) > 10 and tiny.largest_tensor > 1024
    assert tiny.largest_tensor <= tiny.peak_shard_bytes <= 1024 + tiny.largest_tensor
    ref.check(out)
    # (c) One file: model.safetensors and no index; the earlier files are removed.
    report = export_hf(ckpt, out, config=ref.dir / "config.json")
    assert report.files == ("model.safetensors",)
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    ref.check(out)
    assert (out / "generation_config.json").exists()
    # A plain (unsharded) model, live: the same file.
    plain = save_hf_pretrained(ref.model, tmp_path / "plain")
    assert plain.files == report.files and plain.weight_map == report.weight_map
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == (
        out / "model.safetensors"
    ).read_bytes()
    # A cast: bf16 tensors, and the config says so.
    half = export_hf(ckpt, tmp_path / "bf16", config=ref.model.config, dtype="bf16")
    assert half.total_size * 2 == report.total_size
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    torch.testing.assert_close(
        _logits(loaded.float().eval(), ref.ids), ref.logits, rtol=0.1, atol=0.1
    )


SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("train") / "ckpt"
    assert (
        fsdp_main(
            [
                "train",
                "--hf-config",
                SPEC,
                "--steps",
                "2",
                "--backend",
                "threads",
                "--world-size",
                "2",
                "--no-progress",
                "--threads-per-rank",
                "1",
                "--save",
                str(ckpt),
            ]
        )
        == 0
    )
    return ckpt


def test_cli_exports_a_checkpoint_of_fsdp_train(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsdp.hf import parse_hf_spec

    out = tmp_path / "hf"
    assert fsdp_main(["export-hf", str(trained), str(out), "--max-shard-size", "64K"]) == 0
    assert "weight files" in capsys.readouterr().out
    assert len(_index(out)["weight_map"]) == 2 * 12 + 4  # wte, wpe, ln_f.{weight,bias}
    with torch.device("cpu"):
        expected = AutoModelForCausalLM.from_config(parse_hf_spec(SPEC))
    fsdp_ckpt.load(trained, expected)  # the trained weights, read the other way
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(
        _logits(loaded.eval(), ids), _logits(expected.eval(), ids), rtol=0, atol=1e-6
    )


def test_errors(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Not a checkpoint.
    assert fsdp_main(["export-hf", str(tmp_path / "absent"), str(tmp_path / "o")]) == 1
    assert "error:" in capsys.readouterr().err
    with pytest.raises(fsdp_ckpt.CheckpointError):
        export_hf(tmp_path / "absent", tmp_path / "o")
    # No config recorded (a checkpoint saved without fsdp train) and none given.
    plain = tmp_path / "plain"
    torch.manual_seed(0)
    fsdp_ckpt.save(plain, AutoModelForCausalLM.from_config(CONFIGS["gpt2"]()))
    assert fsdp_main(["export-hf", str(plain), str(tmp_path / "o")]) == 2
    assert "--config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no Hugging Face config.*config="):
        export_hf(plain, tmp_path / "o")
    # A config of another model: named, with the mismatches.
    assert (
        fsdp_main(
            [
                "export-hf",
                str(trained),
                str(tmp_path / "o"),
                "--config",
                str(_write_config(tmp_path, CONFIGS["llama"]())),
            ]
        )
        == 1
    )
    assert "does not hold the LlamaForCausalLM" in capsys.readouterr().err
    # Usage: a bad size, an output that is a file.
    with pytest.raises(SystemExit):
        fsdp_main(["export-hf", str(trained), str(tmp_path / "o"), "--max-shard-size", "lots"])
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        export_hf(trained, tmp_path / "file")
    with pytest.raises(ValueError, match="max_shard_size"):
        export_hf(trained, tmp_path / "o", max_shard_size=0)
    assert not os.path.exists(tmp_path / "o")  # nothing written by a refused export


def _write_config(tmp_path: Path, config: Any) -> Path:
    config.save_pretrained(tmp_path / "cfg")
    return tmp_path / "cfg" / "config.json"
