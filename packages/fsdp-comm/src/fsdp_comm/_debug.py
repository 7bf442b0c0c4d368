"""Cross-rank argument checks run before each collective when ``FSDP_COMM_DEBUG=1``.

Without them a size or dtype that differs across ranks surfaces late: gloo aborts the process
on some mismatches (seen as a dead peer) and NCCL may hang or corrupt memory. The check costs
one small all-gather per collective, so it is off by default.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch

from ._errors import CommError
from ._reduce_op import ReduceKind, ReduceOp

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["check_across_ranks"]

_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_FIELDS = (
    "collective",
    "call number",
    "input numel",
    "output numel",
    "dtype",
    "op",
    "op factor",
    "src",
)


def _float_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _code(values: tuple[object, ...], value: object) -> int:
    return values.index(value) if value in values else len(values)


def _describe_field(field: str, value: int) -> str:
    if field == "collective":
        return _COLLECTIVES[value] if value < len(_COLLECTIVES) else "?"
    if field == "op":
        return list(ReduceKind)[value].name if 0 <= value < len(ReduceKind) else "none"
    if field == "op factor":
        return str(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "dtype":
        return str(_DTYPES[value]) if value < len(_DTYPES) else "other dtype"
    return str(value)


def check_across_ranks(
    backend: Backend,
    collective: str,
    seq: int,
    inp: torch.Tensor,
    out: torch.Tensor,
    *,
    op: ReduceOp | None,
    src: int | None,
) -> None:
    """All-gather a descriptor of this call and raise `CommError` if any rank's differs."""
    op_code = -1 if op is None else list(ReduceKind).index(op.kind)
    factor_bits = 0 if op is None or op.factor is None else _float_bits(op.factor)
    desc = torch.tensor(
        [
            _code(_COLLECTIVES, collective),
            seq,
            inp.numel(),
            out.numel(),
            _code(_DTYPES, inp.dtype),
            op_code,
            factor_bits,
            -1 if src is None else src,
        ],
        dtype=torch.int64,
    ).to(backend.device)
    gathered = torch.empty(
        backend.world_size * desc.numel(), dtype=torch.int64, device=backend.device
    )
    backend._all_gather_impl(gathered, desc, False)
    table = gathered.view(backend.world_size, -1).cpu().tolist()
    mine = table[backend.rank]
    for i, field in enumerate(_FIELDS):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            per_rank = ", ".join(
                f"rank {backend.ranks[r]}: {_describe_field(field, v)}"
                for r, v in enumerate(column)
            )
            differing = [backend.ranks[r] for r, row in enumerate(table) if row[i] != mine[i]]
            raise CommError(
                f"FSDP_COMM_DEBUG: {collective} called with a different {field} across ranks "
                f"({per_rank}); ranks {differing} differ from rank {backend.ranks[backend.rank]}. "
                "No data was exchanged."
            )
