"""`from_dcp` never runs code from the DCP checkpoint it reads, and checks its file names.

DCP pickles its ``.metadata`` and its non-tensor values; each test plants a pickle whose
loading would run ``os.system`` (or ``exec``) to create a marker file, and checks the import is
refused with `CheckpointCorruptError` and the marker never appears, while the untouched
checkpoint, written by ``torch.distributed.checkpoint.save``, still imports.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsdp_ckpt.cli import main
from torch import nn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Payload:
    """Unpickling this calls ``call(arg)``: what a crafted checkpoint would do."""

    def __init__(self, call: Any, arg: str) -> None:
        self.call, self.arg = call, arg

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return self.call, (self.arg,)


def _payloads(marker: Path) -> dict[str, _Payload]:
    return {
        "os.system": _Payload(os.system, f"touch {marker}"),
        "exec": _Payload(exec, f"open({str(marker)!r}, 'w').close()"),
    }


def _state(lr: Any = 0.01) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = opt.state_dict()
    optim = {
        "state": {names[id(params[i])]: s for i, s in osd["state"].items()},
        "param_groups": [
            {**g, "lr": lr, "params": [names[id(params[i])] for i in g["params"]]}
            for g in osd["param_groups"]
        ],
    }
    return model, {"model": model.state_dict(), "optim": optim}


@pytest.fixture()
def real_dcp(tmp_path: Path) -> tuple[Path, nn.Module]:
    model, state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return tmp_path / "dcp", model


def _metadata(d: Path) -> Any:
    return dcp.FileSystemReader(str(d)).read_metadata()  # our own, trusted checkpoint


def _write_metadata(d: Path, metadata: Any) -> None:
    metadata.storage_meta = None
    (d / ".metadata").write_bytes(pickle.dumps(metadata))


def _imports(d: Path, out: Path, model: nn.Module) -> None:
    ck.from_dcp(d, out)
    loaded = nn.Linear(4, 3)
    ck.load(out, loaded)
    assert torch.equal(loaded.weight, model.weight)


@pytest.mark.parametrize("kind", ["os.system", "exec"])
def test_crafted_metadata_is_refused_and_never_runs(
    real_dcp: tuple[Path, nn.Module], tmp_path: Path, kind: str
) -> None:
    d, model = real_dcp
    _imports(d, tmp_path / "ours", model)  # the checkpoint torch wrote imports
    marker = tmp_path / "marker"
    metadata = _metadata(d)
    metadata.version = _payloads(marker)[kind]  # inside a real Metadata object
    _write_metadata(d, metadata)
    with pytest.raises(
        ck.CheckpointCorruptError,
        match=r"\.metadata: refused .*not part of "
        r"DCP metadata.*trust=True",
    ) as info:
        ck.from_dcp(d, tmp_path / "other")
    assert info.value.path == str(d / ".metadata")
    assert not marker.exists()
    assert not (tmp_path / "other").exists()


def test_bare_payload_is_refused_by_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_payloads(marker)["os.system"]))
    assert main(["from-dcp", str(tmp_path / "dcp"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "posix.system" in err and "Traceback" not in err
    assert not marker.exists()


def test_crafted_value_in_a_data_file_is_refused(tmp_path: Path) -> None:
    """DCP's default planner reads non-tensor values with plain pickle (torch.load with
    weights_only=False): a learning rate that is a payload."""
    marker = tmp_path / "marker"
    _, state = _state(lr=_payloads(marker)["os.system"])
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # pickles, runs nothing
    assert not marker.exists()
    with pytest.raises(ck.CheckpointCorruptError, match="DCP could not read it .*trust=True"):
        ck.from_dcp(tmp_path / "dcp", tmp_path / "out")
    assert not marker.exists()


def _storage_infos(metadata: Any) -> list[Any]:
    return list(metadata.storage_data.values())


def test_data_file_outside_the_directory_is_refused(
    real_dcp: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    d, _ = real_dcp
    metadata = _metadata(d)
    name = _storage_infos(metadata)[0].relative_path
    shutil.copy(d / name, tmp_path / name)  # what the import used to read
    for info in _storage_infos(metadata):
        info.relative_path = f"../{name}"
    _write_metadata(d, metadata)
    with pytest.raises(
        ck.CheckpointCorruptError,
        match=r"storage_data\[.*\]\.relative_path: "
        f"'../{name}' is not a plain file name",
    ):
        ck.from_dcp(d, tmp_path / "out")


def test_data_file_symlinked_out_of_the_directory_is_refused(
    real_dcp: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    d, _ = real_dcp
    name = _storage_infos(_metadata(d))[0].relative_path
    shutil.move(d / name, tmp_path / name)
    os.symlink(tmp_path / name, d / name)
    with pytest.raises(ck.CheckpointCorruptError, match="outside the checkpoint directory"):
        ck.from_dcp(d, tmp_path / "out")


def test_byte_range_beyond_the_file_is_refused(
    real_dcp: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    d, _ = real_dcp
    metadata = _metadata(d)
    info = _storage_infos(metadata)[-1]
    info.offset = (d / info.relative_path).stat().st_size
    _write_metadata(d, metadata)
    with pytest.raises(ck.CheckpointCorruptError, match="lie beyond the end of"):
        ck.from_dcp(d, tmp_path / "out")


def test_huge_tensor_is_refused_before_it_is_allocated(
    real_dcp: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    d, _ = real_dcp
    metadata = _metadata(d)
    metadata.state_dict_metadata["model.weight"].size = torch.Size([1 << 50])
    metadata.state_dict_metadata["model.weight"].chunks[0].sizes = torch.Size([1 << 50])
    metadata.state_dict_metadata["model.weight"].chunks[0].offsets = torch.Size([0])
    _write_metadata(d, metadata)
    with pytest.raises(ck.CheckpointCorruptError, match="but the data files hold"):
        ck.from_dcp(d, tmp_path / "out")


def test_missing_metadata_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="no DCP checkpoint at .* no .metadata"):
        ck.from_dcp(tmp_path, tmp_path / "out")


def test_from_dcp_help_warns_about_pickle(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["from-dcp", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "pickle" in text and "can run arbitrary code" in text
    assert "--trust" in text and "only for checkpoints whose origin you trust" in text
