"""Crafted and tampered checkpoints: every one a `CheckpointCorruptError` naming the file and the
field, raised quickly, before any special file is opened or any memory is allocated from it.

Each case edits the index of a small saved checkpoint (re-sealing its ``index_crc32`` so the
checksum is not what catches it), then runs `inspect_checkpoint`, `verify` and `load`. Special
files (a FIFO, /dev/zero) would block or spin a reader that opened them, so those cases run in
a subprocess with a timeout. Also here: the optimizer's class is recorded and checked, and an
edited ``index.json`` of a version directory loaded directly is caught by its own checksum.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from torch import nn

_CRC_PREFIX = b'{\n "index_crc32": "'
_SHARD = "shard-00000.safetensors"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A version directory: parameters and AdamW state in the shard, buffers and an RNG state
    (5056 bytes) in common.safetensors."""
    model, opt = _model()
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("crafted") / "run"
    ck.save(path, model, opt, extra={"step": 7, "rng": torch.get_rng_state()})
    return path / "v000001"


@pytest.fixture()
def version(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(pristine, copy)
    return copy


def _index(d: Path) -> dict[str, Any]:
    return json.loads((d / "index.json").read_text())


def _sealed(obj: dict[str, Any]) -> bytes:
    """``obj`` as fsdp-ckpt writes an index: checksum first, over the text with it zeroed."""
    obj = {"index_crc32": "00000000", **{k: v for k, v in obj.items() if k != "index_crc32"}}
    raw = (json.dumps(obj, indent=1) + "\n").encode()
    n = len(_CRC_PREFIX)
    return raw[:n] + f"{zlib.crc32(raw):08x}".encode() + raw[n + 8 :]


def _write_index(d: Path, obj: dict[str, Any]) -> None:
    (d / "index.json").write_bytes(_sealed(obj))


def _rename(obj: Any, old: str, new: str) -> None:
    """Make the index call file ``old`` by the name ``new`` everywhere."""
    if isinstance(obj, list):
        for v in obj:
            _rename(v, old, new)
    elif isinstance(obj, dict):
        if obj.get("file") == old:
            obj["file"] = new
        if old in obj.get("files", {}):
            obj["files"][new] = obj["files"].pop(old)
        for v in obj.values():
            _rename(v, old, new)


def _load(path: str) -> None:
    model, opt = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        ck.load(path, model, opt)
    finally:
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _refused(
    path: Path,
    field: str,
    *,
    file: str = "index.json",
    actions: tuple[Callable[[str], Any], ...] = (ck.inspect_checkpoint, ck.verify, _load),
) -> None:
    for action in actions:
        with pytest.raises(ck.CheckpointCorruptError) as info:
            action(str(path))
        assert info.value.path == str(path / file), (action, str(info.value))
        assert field in str(info.value), (action, str(info.value))


# ---- crafted index fields ---------------------------------------------------------------
def _outside(obj: dict[str, Any], d: Path) -> None:
    shutil.copy(d / _SHARD, d.parent / "outside.safetensors")  # what `verify` used to accept
    _rename(obj, _SHARD, "../outside.safetensors")


def _absolute(obj: dict[str, Any], d: Path) -> None:
    target = d.parent / "elsewhere.safetensors"
    shutil.copy(d / _SHARD, target)
    _rename(obj, _SHARD, str(target))


def _subdirectory(obj: dict[str, Any], d: Path) -> None:
    (d / "sub").mkdir()
    shutil.copy(d / _SHARD, d / "sub" / _SHARD)
    _rename(obj, _SHARD, f"sub/{_SHARD}")


def _negative_shape(obj: dict[str, Any], d: Path) -> None:
    obj["params"]["0.weight"]["shape"] = [-3, -4]  # 12 elements, as many as the chunk holds


def _huge_shape(obj: dict[str, Any], d: Path) -> None:
    obj["params"]["0.weight"]["shape"] = [1 << 40, 1 << 40, 1 << 40]


def _chunk_beyond_file(obj: dict[str, Any], d: Path) -> None:
    # A 4 PB "step" tensor: load allocated it (and failed with RuntimeError) before reading.
    n = 1 << 50
    obj["optimizer"]["state"]["0.weight"]["step"] = {
        "shape": [n],
        "dtype": "float32",
        "chunks": [{"file": _SHARD, "key": "optim/0.weight/exp_avg", "start": 0, "length": n}],
    }


def _bad_dtype(obj: dict[str, Any], d: Path) -> None:
    obj["params"]["0.bias"]["dtype"] = "float128"


def _negative_size(obj: dict[str, Any], d: Path) -> None:
    obj["files"][_SHARD]["size"] = -1


def _extra_unlisted_file(obj: dict[str, Any], d: Path) -> None:
    obj["extra"]["rng"]["__tensor__"]["file"] = "other.safetensors"  # was a KeyError


def _extra_negative_shape(obj: dict[str, Any], d: Path) -> None:
    obj["extra"]["rng"]["__tensor__"]["shape"] = [-5]  # was a RuntimeError


def _extra_bad_tag(obj: dict[str, Any], d: Path) -> None:
    obj["extra"]["step"] = {"__tensor__": 5}  # was a TypeError


def _extra_deep(obj: dict[str, Any], d: Path) -> None:
    deep: Any = 0
    for _ in range(100):  # JSON parses it; decoding it recursed without bound
        deep = [deep]
    obj["extra"]["deep"] = deep


def _box(obj: dict[str, Any], offsets: list[int], sizes: list[int], *, version: int = 2) -> None:
    """Make 0.weight's one chunk a box chunk (Note [boxes] in fsdp_ckpt._box)."""
    obj["format_version"] = version
    chunk = obj["params"]["0.weight"]["chunks"][0]
    del chunk["start"], chunk["length"]
    chunk.update(offsets=offsets, sizes=sizes)


def _box_in_version_1(obj: dict[str, Any], d: Path) -> None:
    _box(obj, [0, 0], [3, 4], version=1)  # an fsdp-ckpt 0.1 index never holds one


def _box_outside(obj: dict[str, Any], d: Path) -> None:
    _box(obj, [2, 0], [3, 4])


def _box_wrong_rank(obj: dict[str, Any], d: Path) -> None:
    _box(obj, [0], [12])


def _boxes_overlap(obj: dict[str, Any], d: Path) -> None:
    _box(obj, [0, 0], [3, 4])  # 12 elements, then 12 more of the same rows, 4 of them new
    chunk = obj["params"]["0.weight"]["chunks"][0]
    chunk["sizes"] = [2, 4]
    obj["params"]["0.weight"]["chunks"].append({**chunk, "offsets": [1, 0], "sizes": [1, 4]})


def _boxes_short(obj: dict[str, Any], d: Path) -> None:
    _box(obj, [0, 0], [2, 4])  # row 2 in no chunk


CASES: list[tuple[str, Callable[[dict[str, Any], Path], None], str]] = [
    (
        "box-in-version-1",
        _box_in_version_1,
        "params['0.weight'].chunks[0].offsets: a box chunk needs format_version 2",
    ),
    (
        "box-outside",
        _box_outside,
        "params['0.weight'].chunks[0].sizes[0]: expected an integer in [0, 1]",
    ),
    ("box-wrong-rank", _box_wrong_rank, "params['0.weight'].chunks[0].offsets: expected 2 entries"),
    (
        "boxes-overlap",
        _boxes_overlap,
        "params/0.weight: pieces do not tile the tensor: pieces overlap",
    ),
    ("boxes-short", _boxes_short, "pieces hold 8 of 12 elements"),
    (
        "traversal",
        _outside,
        "files['../outside.safetensors']: '../outside.safetensors' is not a plain file name",
    ),
    ("absolute-path", _absolute, "is not a plain file name"),
    ("subdirectory", _subdirectory, f"files['sub/{_SHARD}']"),
    ("negative-shape", _negative_shape, "params['0.weight'].shape[0]: expected an integer"),
    ("huge-shape", _huge_shape, "params['0.weight'].shape: more than"),
    (
        "chunk-beyond-file",
        _chunk_beyond_file,
        f"optimizer.state['0.weight']['step'].chunks[0].length: does not fit in {_SHARD}",
    ),
    ("bad-dtype", _bad_dtype, "params['0.bias'].dtype: unknown dtype"),
    ("negative-file-size", _negative_size, f"files['{_SHARD}'].size: expected an integer"),
    (
        "extra-unlisted-file",
        _extra_unlisted_file,
        "extra['rng'].__tensor__.file: names a file that the index does not list",
    ),
    ("extra-negative-shape", _extra_negative_shape, "extra['rng'].__tensor__.shape[0]"),
    ("extra-bad-tag", _extra_bad_tag, "extra['step'].__tensor__: expected a JSON object"),
    ("extra-deep", _extra_deep, "nested more than 64 levels deep"),
]


@pytest.mark.parametrize("craft,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_crafted_index_is_refused_naming_the_field(version: Path, craft: Any, field: str) -> None:
    obj = _index(version)
    craft(obj, version)
    _write_index(version, obj)
    _refused(version, field)


def test_a_box_chunk_loads_like_the_flat_chunk_it_replaces(pristine: Path, version: Path) -> None:
    """Format version 2: the whole of 0.weight as one box chunk instead of one flat chunk."""
    want, _ = _model()
    ck.load(str(pristine), want)
    obj = _index(version)
    _box(obj, [0, 0], [3, 4])
    _write_index(version, obj)
    ck.verify(str(version))
    got, _ = _model()
    ck.load(str(version), got)
    assert torch.equal(got[0].weight, want[0].weight)
    exported = dict(ck.iter_full_tensors(str(version)))
    assert torch.equal(exported["0.weight"], want[0].weight)


def test_json_nested_beyond_the_parser_is_refused(version: Path) -> None:
    text = (version / "index.json").read_text()
    deep = "[" * 100_000 + "]" * 100_000  # json.loads raised RecursionError
    (version / "index.json").write_text(text.replace('"step": 7', f'"step": {deep}'))
    _refused(version, "JSON nested too deeply")


def test_safe_values_still_round_trip_at_the_depth_limit(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(63):
        deep = [deep]
    model, opt = _model()
    ck.save(tmp_path / "c", model, opt, extra={"deep": deep})
    assert ck.load(tmp_path / "c", _model()[0]) == {"deep": deep}
    with pytest.raises(TypeError, match="nested more than 64 levels deep"):
        ck.save(tmp_path / "c", model, opt, extra={"deep": [deep]})


def test_user_dicts_that_look_like_tags_round_trip(tmp_path: Path) -> None:
    extra = {
        "a": {"__tensor__": 1},
        "b": {"__tensor__": {"key": "k", "file": "x"}},
        "c": ({"__tuple__": [1]}, {"__dict__": 2}),
    }
    model, opt = _model()
    ck.save(tmp_path / "c", model, opt, extra=extra)
    assert ck.load(tmp_path / "c", *_model()) == extra  # the tags were read as tensors


# ---- tensor file headers ----------------------------------------------------------------
def _rewrite_header(d: Path, change: Callable[[dict[str, Any]], bytes | None]) -> None:
    """Rewrite the shard's safetensors header, and record the new file in the index."""
    shard = d / _SHARD
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    raw = change(header) or json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    new = struct.pack("<Q", len(raw)) + raw + data[8 + n :]
    shard.write_bytes(new)
    obj = _index(d)
    obj["files"][_SHARD] = {"size": len(new), "crc32": f"{zlib.crc32(new):08x}"}
    _write_index(d, obj)


def _negative_dims(header: dict[str, Any]) -> None:
    header["param/0.weight"]["shape"] = [-3, -4]  # passed verify, failed load


def _deep_metadata(header: dict[str, Any]) -> bytes:
    text = json.dumps(header, separators=(",", ":"))
    return text.replace(
        '"__metadata__":{', '"__metadata__":{"x":' + "[" * 100_000 + "]" * 100_000 + ",", 1
    ).encode()


@pytest.mark.parametrize(
    "change,field",
    [
        (_negative_dims, "safetensors entry 'param/0.weight': shape: expected"),
        (_deep_metadata, "safetensors header nested too deeply"),
    ],
    ids=["negative-dims", "deep"],
)
def test_crafted_tensor_header_is_refused(version: Path, change: Any, field: str) -> None:
    _rewrite_header(version, change)
    _refused(version, field, file=_SHARD, actions=(ck.verify, _load))


# ---- files on disk ----------------------------------------------------------------------
def test_symlink_out_of_the_directory_is_refused(version: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.move(version / _SHARD, outside)
    os.symlink(outside, version / _SHARD)  # same bytes: verify used to say OK
    _refused(
        version,
        "outside the checkpoint directory",
        file=_SHARD,
        actions=(ck.verify, _load, lambda p: ck.export(p, tmp_path / "m.safetensors")),
    )
    assert not (tmp_path / "m.safetensors").exists()
    # A link to a file in the directory itself is followed.
    os.remove(version / _SHARD)
    shutil.move(outside, version / "real.bin")
    os.symlink("real.bin", version / _SHARD)
    ck.verify(version)
    assert ck.load(version, *_model())["step"] == 7


def test_directory_listed_as_a_file_is_refused(version: Path) -> None:
    (version / "dir.safetensors").mkdir()
    obj = _index(version)
    size = (version / "dir.safetensors").stat().st_size
    obj["files"]["dir.safetensors"] = {"size": size, "crc32": "00000000"}
    _write_index(version, obj)
    _refused(
        version,
        "is a directory, not a regular file",
        file="dir.safetensors",
        actions=(ck.verify, _load),
    )


_PROBE = r"""
import json, sys, torch, fsdp_ckpt as ck
from torch import nn
out = {}
for path in sys.argv[1:]:
    res = {}
    for action in ("verify", "export", "load"):
        try:
            if action == "verify":
                ck.verify(path)
            elif action == "export":
                ck.export(path, path + ".safetensors")
            else:
                m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
                ck.load(path, m, torch.optim.AdamW(m.parameters(), lr=0.01))
            res[action] = "no error"
        except Exception as exc:
            res[action] = f"{type(exc).__name__}: {exc}"
    out[path] = res
print(json.dumps(out))
"""


def _special(d: Path, name: str, make: Callable[[Path], None]) -> None:
    make(d / name)
    obj = _index(d)
    obj["files"][name] = {"size": 0, "crc32": "00000000"}  # what stat says of all three
    _write_index(d, obj)


def _mknod_zero(p: Path) -> None:
    os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers


SPECIAL: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (os.mkfifo, "is a FIFO, not a regular file"),
    "dev-zero-symlink": (
        lambda p: os.symlink("/dev/zero", p),
        "is a symbolic link to /dev/zero, outside the checkpoint directory",
    ),
    "char-device": (_mknod_zero, "is a character device, not a regular file"),
}


@pytest.fixture(scope="module")
def special_results(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """verify, export and load of each special-file checkpoint, in a subprocess: a reader
    that opened a FIFO would block, one reading /dev/zero would never finish."""
    root = tmp_path_factory.mktemp("special")
    dirs = {}
    for case, (make, _) in SPECIAL.items():
        d = root / case
        shutil.copytree(pristine, d)
        try:
            _special(d, "x.safetensors", make)
        except PermissionError:  # mknod needs CAP_MKNOD
            continue
        dirs[case] = str(d)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, *dirs.values()],
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired:
        return {case: "hung" for case in dirs}
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    return {case: results[d] for case, d in dirs.items()}


@pytest.mark.parametrize("case", list(SPECIAL))
def test_special_file_is_refused_without_being_opened(
    special_results: dict[str, Any], case: str
) -> None:
    if case not in special_results:
        pytest.skip("cannot create a device node here")
    result = special_results[case]
    assert result != "hung", "a reader opened the special file and never returned"
    for action, outcome in result.items():
        assert outcome.startswith("CheckpointCorruptError: "), (action, outcome)
        assert "x.safetensors: " + SPECIAL[case][1] in outcome, (action, outcome)


# ---- the optimizer's class --------------------------------------------------------------
def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_strict_load_refuses_another_optimizer_class(pristine: Path) -> None:
    assert ck.inspect_checkpoint(pristine).optimizer == "torch.optim.adamw.AdamW"
    model, _ = _model()
    opt = _sgd(model)
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load(pristine, model, opt)
    assert info.value.report.optimizer_class == ("torch.optim.adamw.AdamW", "torch.optim.sgd.SGD")
    assert (
        "optimizer class: the checkpoint holds the state of torch.optim.adamw.AdamW, "
        "the optimizer given is torch.optim.sgd.SGD" in str(info.value)
    )
    assert opt.state_dict()["state"] == {} and opt.param_groups[0]["lr"] == 0.1


def test_non_strict_load_into_another_class_warns(pristine: Path) -> None:
    model, _ = _model()
    with pytest.warns(ck.CheckpointMismatchWarning, match="optimizer class: .*AdamW"):
        ck.load(pristine, model, _sgd(model), strict=False)


def test_bare_class_name_of_older_indexes_is_still_checked(version: Path) -> None:
    obj = _index(version)
    obj["optimizer"]["class"] = "AdamW"  # what indexes recorded before the qualified name
    _write_index(version, obj)
    model, opt = _model()
    ck.load(version, model, opt)
    with pytest.raises(ck.CheckpointMismatchError, match="state of AdamW"):
        ck.load(version, model, _sgd(model))


# ---- the version directory's own index checksum -----------------------------------------
@pytest.mark.parametrize(
    "old,new", [('"lr": 0.01', '"lr": 0.5'), ('"step": 7', '"step": 8')], ids=["lr", "extra"]
)
def test_edited_index_of_a_version_directory_is_caught(version: Path, old: str, new: str) -> None:
    index = version / "index.json"
    text = index.read_text()
    assert text.count(old) == 1
    index.write_text(text.replace(old, new))  # valid JSON, valid index, different values
    _refused(version, "checksum mismatch: crc32", actions=(ck.verify, _load))


def test_reformatted_index_is_caught_and_older_indexes_load(version: Path) -> None:
    obj = _index(version)
    (version / "index.json").write_text(json.dumps(obj))
    _refused(version, "index_crc32: not the first field", actions=(ck.verify, _load))
    del obj["index_crc32"]  # as written before indexes carried their checksum
    (version / "index.json").write_text(json.dumps(obj, indent=1))
    ck.verify(version)
    assert ck.load(version, _model()[0])["step"] == 7
