"""`fsdp --version` names every package, torch with CUDA and NCCL, and the known backends."""

from __future__ import annotations

import pytest

from fsdp._cli import main


def test_version_lists_every_package_torch_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    for name in (
        "fsdp ",
        "fsdp-comm ",
        "fsdp-memory ",
        "fsdp-engine ",
        "fsdp-ckpt ",
        "torch ",
        "CUDA ",
        "NCCL ",
        "backends known: ",
    ):
        assert name in out, out
    assert "threads" in out and "torch" in out.split("backends known: ")[1]
