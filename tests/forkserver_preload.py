"""One forkserver for every launched test rank, with torch's distributed stack, fsdp_engine and
the tests' rank modules imported once.

`fsdp_comm.launch` forks process ranks from a forkserver that preloads only torch,
torch.distributed and fsdp_comm. Every rank then imports the rest itself: fsdp_engine (which
pulls in DTensor, FSDP2, dynamo and sympy) costs ~3 s of CPU on an idle machine, so a 4-rank
launch on 2 cores spent ~6 s (12 s loaded) importing before its first step. Imported once in
the server, every rank starts with them for free. Only faster, never different: the ranks run
the same code, forked from a process that imported it (as under the original forkserver, which
imports torch).

`warm_forkserver()` makes the running forkserver one started with `PRELOAD`: it starts one, or
replaces one started by someone else with a shorter list (launches are sequential in a pytest
process, so no rank is being started meanwhile). A module that does not import in this process
(a library mid-edit) is left out, so a broken import fails in the ranks as before, not in the
server.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os

PRELOAD = (
    "torch",
    "torch.distributed",
    "fsdp_comm",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "fsdp_engine",
    "tests.fsdp2.ranks",
    "tests.engine.parity",
    "tests.fsdp2_ac.ranks",
)

_STARTED: dict[str, int | None] = {"pid": None}


def warm_forkserver() -> None:
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is not None and pid == _STARTED["pid"] and _alive(pid):
        return
    if pid is not None:  # another preload list (or dead): replace it
        try:
            server._stop()
        except (OSError, ChildProcessError):
            server._forkserver_pid = None
            server._forkserver_address = None
            server._forkserver_alive_fd = None
    modules = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - left to the ranks, which report it
            continue
        modules.append(name)
    mp.set_forkserver_preload(modules)
    forkserver.ensure_running()
    _STARTED["pid"] = server._forkserver_pid


def _alive(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == 0
    except ChildProcessError:
        return False
