"""Bad arguments to fsdp-ckpt's public functions are refused before anything is read or
written, with a message naming the argument, the rule and the value given."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
from torch import nn


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("args") / "run")
    ck.save(path, nn.Linear(2, 2))
    return path


def _model() -> nn.Module:
    return nn.Linear(2, 2)


# (what is called, the error, what the message must say)
def _cases(p: str, out: str) -> list[tuple[str, Callable[[], Any], type[Exception], str]]:
    m = _model()
    return [
        (
            "save path None",
            lambda: ck.save(None, m),
            TypeError,
            "path must be a str or os.PathLike, got NoneType None",
        ),
        (
            "save path empty",
            lambda: ck.save("", m),
            ValueError,
            "path must be a non-empty path, got ''",
        ),
        (
            "save path a file",
            lambda: ck.save(os.path.join(p, "CURRENT"), m),
            ValueError,
            "path must be a checkpoint directory",
        ),
        (
            "save model",
            lambda: ck.save(p, "m"),
            TypeError,
            "model must be a torch.nn.Module, got str 'm'",
        ),
        (
            "save optimizer",
            lambda: ck.save(p, m, "o"),
            TypeError,
            "optimizer must be a torch.optim.Optimizer or None, got str 'o'",
        ),
        (
            "save extra",
            lambda: ck.save(p, m, extra=[1]),
            TypeError,
            "extra must be a dict or None, got list [1]",
        ),
        (
            "save async_save",
            lambda: ck.save(p, m, async_save=1),
            TypeError,
            "async_save must be a bool, got int 1",
        ),
        (
            "save keep_last 0",
            lambda: ck.save(p, m, keep_last=0),
            ValueError,
            "keep_last must be an int >= 1, got 0",
        ),
        (
            "save keep_last bool",
            lambda: ck.save(p, m, keep_last=True),
            TypeError,
            "keep_last must be an int >= 1, got bool True",
        ),
        (
            "save keep_last str",
            lambda: ck.save(p, m, keep_last="2"),
            TypeError,
            "keep_last must be an int >= 1, got str '2'",
        ),
        (
            "save storage",
            lambda: ck.save(p, m, storage="s"),
            TypeError,
            "storage must be an fsdp_ckpt.Storage or None, got str 's'",
        ),
        (
            "save backend",
            lambda: ck.save(p, m, backend="b"),
            TypeError,
            "backend must be an fsdp_comm.Backend spanning every rank, or None, got str 'b'",
        ),
        (
            "load path",
            lambda: ck.load(3, m),
            TypeError,
            "path must be a str or os.PathLike, got int 3",
        ),
        ("load path empty", lambda: ck.load("", m), ValueError, "path must be a non-empty path"),
        (
            "load model",
            lambda: ck.load(p, None),
            TypeError,
            "model must be a torch.nn.Module, got NoneType None",
        ),
        (
            "load strict",
            lambda: ck.load(p, m, strict=0),
            TypeError,
            "strict must be a bool, got int 0",
        ),
        (
            "load storage",
            lambda: ck.load(p, m, storage=1),
            TypeError,
            "storage must be an fsdp_ckpt.Storage or None, got int 1",
        ),
        (
            "load backend",
            lambda: ck.load(p, m, backend=1),
            TypeError,
            "backend must be an fsdp_comm.Backend",
        ),
        (
            "verify path",
            lambda: ck.verify(None),
            TypeError,
            "path must be a str or os.PathLike, got NoneType",
        ),
        (
            "verify path NUL",
            lambda: ck.verify("a\0b"),
            ValueError,
            "path must not contain a NUL character, got 'a\\x00b'",
        ),
        (
            "verify storage",
            lambda: ck.verify(p, storage="s"),
            TypeError,
            "storage must be an fsdp_ckpt.Storage",
        ),
        (
            "inspect path",
            lambda: ck.inspect_checkpoint(b"x"),
            TypeError,
            "path must be a str or os.PathLike, got bytes b'x'",
        ),
        (
            "export path",
            lambda: ck.export(None, out),
            TypeError,
            "path must be a str or os.PathLike",
        ),
        (
            "export out",
            lambda: ck.export(p, None),
            TypeError,
            "out must be a str or os.PathLike, got NoneType None",
        ),
        (
            "export format",
            lambda: ck.export(p, out, format="zip"),
            ValueError,
            "format must be 'safetensors', 'torch' or None, got 'zip'",
        ),
        (
            "to_dcp dcp_dir",
            lambda: ck.to_dcp(p, None),
            TypeError,
            "dcp_dir must be a str or os.PathLike, got NoneType None",
        ),
        (
            "to_dcp model_key",
            lambda: ck.to_dcp(p, out, model_key=3),
            TypeError,
            "model_key must be a str, got int 3",
        ),
        (
            "to_dcp optim_key",
            lambda: ck.to_dcp(p, out, optim_key=""),
            ValueError,
            "optim_key must be a non-empty str, got ''",
        ),
        (
            "to_dcp same keys",
            lambda: ck.to_dcp(p, out, model_key="a", optim_key="a"),
            ValueError,
            "model_key and optim_key must differ",
        ),
        (
            "from_dcp dcp_dir",
            lambda: ck.from_dcp("", p),
            ValueError,
            "dcp_dir must be a non-empty path",
        ),
        (
            "from_dcp path",
            lambda: ck.from_dcp(out, None),
            TypeError,
            "path must be a str or os.PathLike",
        ),
        (
            "from_dcp keep_last",
            lambda: ck.from_dcp(out, p, keep_last=0),
            ValueError,
            "keep_last must be an int >= 1, got 0",
        ),
        (
            "from_dcp trust",
            lambda: ck.from_dcp(out, p, trust="yes"),
            TypeError,
            "trust must be a bool, got str 'yes'",
        ),
        (
            "full_state_dict model",
            lambda: ck.full_state_dict(1),
            TypeError,
            "model must be a torch.nn.Module, got int 1",
        ),
        (
            "full_state_dict cpu_offload",
            lambda: ck.full_state_dict(m, cpu_offload=None),
            TypeError,
            "cpu_offload must be a bool, got NoneType None",
        ),
        (
            "full_state_dict backend",
            lambda: ck.full_state_dict(m, backend=2),
            TypeError,
            "backend must be an fsdp_comm.Backend",
        ),
        (
            "iter_full_state_dict names",
            lambda: ck.iter_full_state_dict(m, names="weight"),
            TypeError,
            "names must be a list of str (or another iterable of them) or None, got str 'weight'",
        ),
        (
            "iter_full_state_dict names items",
            lambda: ck.iter_full_state_dict(m, names=[1]),
            TypeError,
            "names must hold only str, got int 1",
        ),
        (
            "iter_full_state_dict rank0_only",
            lambda: ck.iter_full_state_dict(m, rank0_only=1),
            TypeError,
            "rank0_only must be a bool, got int 1",
        ),
        (
            "iter_full_tensors path",
            lambda: ck.iter_full_tensors(""),
            ValueError,
            "path must be a non-empty path",
        ),
        (
            "iter_full_tensors verify",
            lambda: ck.iter_full_tensors(p, verify="no"),
            TypeError,
            "verify must be a bool, got str 'no'",
        ),
        (
            "iter_full_tensors names",
            lambda: ck.iter_full_tensors(p, names=5),
            TypeError,
            "names must be a list of str (or another iterable of them) or None, got int 5",
        ),
        (
            "wait_for_cleanup path",
            lambda: ck.wait_for_cleanup(3),
            TypeError,
            "path must be a str or os.PathLike, got int 3",
        ),
        (
            "LocalStorage buffer_size",
            lambda: ck.LocalStorage(buffer_size=0),
            ValueError,
            "buffer_size must be an int >= 1, got 0",
        ),
    ]


_NAMES = [c[0] for c in _cases("p", "o")]


@pytest.mark.parametrize("name", _NAMES)
def test_a_bad_argument_is_refused_naming_it(saved: str, tmp_path: Path, name: str) -> None:
    out = str(tmp_path / "out.pt")
    before = sorted(os.listdir(saved))
    _, call, error, message = next(c for c in _cases(saved, out) if c[0] == name)
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value), str(info.value)
    assert sorted(os.listdir(saved)) == before  # nothing was written
    assert not os.path.exists(out)
