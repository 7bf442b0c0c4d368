"""Joining a Slurm job step: torchrun's ``env://`` variables from ``SLURM_*`` alone.

Under ``srun`` every task is one rank, and Slurm says which (``SLURM_PROCID``), how many
(``SLURM_NTASKS``), which on its node (``SLURM_LOCALID``), on which nodes (a compressed host
list such as ``gpu[01-04,07]``) and in which job (``SLURM_JOB_ID``). `slurm_environment`
turns these into what `TorchBackend` reads to rendezvous: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` (the first node: task 0 runs there under Slurm's default block
distribution) and ``MASTER_PORT`` (`slurm_port`: derived from the job id, so two jobs sharing a
node pick different ports). A variable already set is kept, so ``MASTER_ADDR`` or
``MASTER_PORT`` can be given by hand.

The host list parser is our own: python-hostlist (NSC) is maintained but GPL-2.0-or-later,
which this BSD-3-Clause package does not take on as a dependency; the grammar needed is small.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping

__all__ = [
    "expand_hostlist",
    "slurm_environment",
    "join_slurm_environment",
    "slurm_port",
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
]

#: `slurm_port` maps job ids onto ``SLURM_PORT_BASE .. SLURM_PORT_BASE + SLURM_PORT_SPAN - 1``:
#: below Linux's default ephemeral range (32768-60999), so no outgoing connection holds it.
#: Two jobs on one node collide only when their ids are equal modulo ``SLURM_PORT_SPAN``.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000
#: Where the nodes of this step are listed, most specific first (``srun`` on part of an
#: allocation sets the step's list; task 0 runs on the step's first node).
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_MAX_HOSTS = 1 << 20  # a host list naming more hosts than this is a mistake, not a cluster
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


# ---- host lists -------------------------------------------------------------------------------
def _split_top_level(text: str, variable: str) -> list[str]:
    """``text`` split at the commas outside brackets; ValueError for unbalanced brackets."""
    items: list[str] = []
    depth = start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(_bad(variable, text, "brackets do not nest"))
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(_bad(variable, text, "a ']' closes no '['"))
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(_bad(variable, text, "a '[' is never closed"))
    items.append(text[start:])
    return items


def _bad(variable: str, text: str, rule: str) -> str:
    return (
        f"{variable} must be a Slurm host list (names, commas, bracket ranges such as "
        f"node[01-03,07]): {rule}, got {text!r}"
    )


def _numbers(group: str, variable: str, text: str) -> list[str]:
    """The names one bracket group stands for: ``01-03,7`` -> 01, 02, 03, 7 (a range keeps the
    width of its lower bound: ``08-10`` gives 08, 09, 10)."""
    out: list[str] = []
    for part in group.split(","):
        m = _RANGE.match(part)
        if m is None:
            raise ValueError(_bad(variable, text, f"[{group}] holds {part!r}, not N or N-M"))
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise ValueError(_bad(variable, text, f"range {part} runs backwards"))
        if int(high) - int(low) >= _MAX_HOSTS:
            raise ValueError(_bad(variable, text, f"range {part} names over {_MAX_HOSTS} hosts"))
        width = len(low)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def _pattern(item: str, variable: str, text: str) -> list[list[str]]:
    """One comma-free item as a list of alternatives per piece: ``a[1-2]-b[3,5]`` ->
    [["a"], ["1", "2"], ["-b"], ["3", "5"]]."""
    if not item:
        raise ValueError(_bad(variable, text, "an empty name"))
    if any(ch.isspace() for ch in item):
        raise ValueError(_bad(variable, text, f"{item!r} holds white space"))
    pieces: list[list[str]] = []
    for i, piece in enumerate(re.split(r"\[([^\]]*)\]", item)):
        if i % 2:
            pieces.append(_numbers(piece, variable, text))
        elif piece:
            pieces.append([piece])
    return pieces


def _expand(text: str, variable: str) -> Iterator[str]:
    patterns = [_pattern(item, variable, text) for item in _split_top_level(text.strip(), variable)]
    total = 0
    for pieces in patterns:
        count = 1
        for alternatives in pieces:
            count *= len(alternatives)
        total += count
    if total > _MAX_HOSTS:
        raise ValueError(_bad(variable, text, f"it names {total} hosts, over {_MAX_HOSTS}"))
    for pieces in patterns:
        for combo in itertools.product(*pieces):
            yield "".join(combo)


def expand_hostlist(text: str, *, variable: str = "host list") -> list[str]:
    """Every host of a Slurm host list, in order: ``"node[01-03,07],gpu-a[1-2]-b"`` ->
    node01, node02, node03, node07, gpu-a1-b, gpu-a2-b. Several bracket groups in one name
    expand left to right (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2). Raises `ValueError`
    naming ``variable``, the rule broken and the text."""
    return list(_expand(text, variable))


def _first_host(text: str, variable: str) -> str:
    return next(_expand(text, variable))  # the whole list is checked before the first is given


# ---- the rendezvous environment --------------------------------------------------------------
def _int(env: Mapping[str, str], name: str, minimum: int, meaning: str) -> int:
    if name not in env:
        raise ValueError(
            f"{name} is not set: under Slurm (SLURM_PROCID is set) it must be "
            f"{meaning}; run the ranks with srun"
        )
    text = env[name]
    try:
        value = int(text.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} ({meaning}), got {text!r}")
    return value


def slurm_port(job_id: int | str) -> int:
    """The rendezvous port of a Slurm job: ``SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN``."""
    value = _int({"SLURM_JOB_ID": str(job_id)}, "SLURM_JOB_ID", 0, "the job id")
    return SLURM_PORT_BASE + value % SLURM_PORT_SPAN


def _master_addr(env: Mapping[str, str]) -> str:
    for name in NODELIST_VARIABLES:
        if env.get(name, "").strip():
            return _first_host(env[name], name)
    raise ValueError(
        "SLURM_JOB_NODELIST is not set (nor SLURM_STEP_NODELIST, SLURM_NODELIST): "
        "under Slurm the first node of the job is the rendezvous host; set "
        "MASTER_ADDR to give it by hand"
    )


def slurm_environment(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The ``env://`` variables of this Slurm task (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``), or None outside Slurm (no ``SLURM_PROCID``).

    A variable already in ``environ`` is returned as it is (and not derived, so
    ``MASTER_ADDR`` set by hand needs no node list). Raises `ValueError` naming the missing or
    malformed variable, the rule and the value.
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env:
        return None
    derived: dict[str, Callable[[], str]] = {
        "RANK": lambda: str(_int(env, "SLURM_PROCID", 0, "this task's rank")),
        "WORLD_SIZE": lambda: str(_int(env, "SLURM_NTASKS", 1, "the number of tasks")),
        "LOCAL_RANK": lambda: str(_int(env, "SLURM_LOCALID", 0, "this task's index on its node")),
        "MASTER_ADDR": lambda: _master_addr(env),
        "MASTER_PORT": lambda: str(slurm_port(_job_id(env))),
    }
    out = {name: env[name] if name in env else make() for name, make in derived.items()}
    if "RANK" not in env and "WORLD_SIZE" not in env:
        rank, world = int(out["RANK"]), int(out["WORLD_SIZE"])
        if rank >= world:
            raise ValueError(f"SLURM_PROCID must be below SLURM_NTASKS ({world}), got {rank}")
    return out


def _job_id(env: Mapping[str, str]) -> str:
    if "SLURM_JOB_ID" not in env:
        raise ValueError(
            "SLURM_JOB_ID is not set: under Slurm the rendezvous port is derived "
            "from the job id; set MASTER_PORT to give it by hand"
        )
    return env["SLURM_JOB_ID"]


def join_slurm_environment(environ: MutableMapping[str, str] | None = None) -> bool:
    """Under Slurm, set the ``env://`` variables `slurm_environment` derives (keeping any already
    set) so `TorchBackend` rendezvous with the job's other tasks; True under Slurm, else False
    (nothing changed)."""
    env = os.environ if environ is None else environ
    found = slurm_environment(env)
    if found is None:
        return False
    for name, value in found.items():
        env.setdefault(name, value)
    return True
