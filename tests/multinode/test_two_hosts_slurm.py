"""`fsdp train` across two hosts from Slurm's variables alone (issue #13, item 4).

Four tasks, two per host, started as ``srun`` would start them: no torchrun, no MASTER_ADDR or
MASTER_PORT, only ``SLURM_JOB_NODELIST`` (resolved by the hosts' /etc/hosts), ``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID`` and ``SLURM_JOB_ID``. The head node and the port come from
them; the losses are those of 4 local ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fsdp_comm import slurm_port

from ._hosts import TwoHosts
from .test_two_hosts import RUN_TIMEOUT, TRAIN, train_local

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(600)]

JOB_ID = 4242


def _task_env(rank: int) -> dict[str, str]:
    return {
        "SLURM_JOB_NODELIST": "hostA,hostB",
        "SLURM_NTASKS": "4",
        "SLURM_NNODES": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 2),
        "SLURM_JOB_ID": str(JOB_ID),
    }


def test_slurm_variables_alone_join_the_two_hosts(two_hosts: TwoHosts, tmp_path: Path) -> None:
    args = [sys.executable, "-m", "fsdp", "train", *TRAIN, "--steps", "2"]
    runs = [
        two_hosts.exec("AB"[rank // 2], args, tmp_path / f"task{rank}.log", _task_env(rank))
        for rank in range(4)
    ]
    try:
        codes = [run.wait(RUN_TIMEOUT) for run in runs]
    finally:
        two_hosts.stop(*runs)
    assert codes == [0, 0, 0, 0], "\n".join(run.output()[-2000:] for run in runs)
    line = next(ln for ln in reversed(runs[0].output().splitlines()) if ln.startswith('{"summary"'))
    losses = json.loads(line)["summary"]["losses"]
    local = train_local([*TRAIN, "--steps", "2"], 4)
    assert losses == local["losses"], (losses, local["losses"])
    assert slurm_port(str(JOB_ID)) == 10000 + JOB_ID % 20000
