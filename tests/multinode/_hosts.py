"""Two hosts on one machine for multi-node tests: a thin driver of ``scripts/two-hosts``.

The script does the work (network namespaces joined by a veth pair, each command under
``unshare --uts --mount`` with its own hostname, /dev/shm and /etc/hosts); this module starts
torchrun on both hosts, reads the link's byte counters, cuts the link and kills a host. Every
wait has a timeout, and `TwoHosts.down` kills everything left in the namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "two-hosts"
#: This checkout's packages first, whatever the editable installs point at.
SOURCES = [ROOT / "src", *sorted((ROOT / "packages").glob("*/src"))]
#: One file as training data (loading the whole standard library costs each rank about 5 s
#: here), and one that does not change with this repository: argparse's source.
DATA = Path(argparse.__file__)
NPROC = 2  # ranks per host


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every process started here: this checkout's packages first."""
    env = dict(os.environ)
    paths = [str(p) for p in SOURCES] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(paths)
    env.pop("FSDP_COMM_TIMEOUT", None)
    env.update(extra or {})
    return env


def why_not_possible() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add) and mount /dev/shm"
    for tool in ("ip", "unshare", "timeout"):
        if (
            subprocess.run(
                ["sh", "-c", f"command -v {tool}"], capture_output=True, timeout=10
            ).returncode
            != 0
        ):
            return f"needs the {tool} command"
    return None


@dataclass
class Run:
    """One torchrun on one host; its output (every rank's, torchrun's) goes to ``log``."""

    host: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"torchrun on host{self.host} still running after {timeout:g} s;"
                f" its output:\n{self.output()[-4000:]}"
            ) from None
        if self.ended is None:
            self.ended = time.monotonic()
        return rc

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class TwoHosts:
    """hostA and hostB (`scripts/two-hosts`) under a name of their own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.env = environment({"TWO_HOSTS_NAME": name})
        self._port = 29500

    def script(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            [str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"two-hosts {' '.join(args)} failed ({done.returncode}): "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done.stdout

    def up(self) -> None:
        self.script("up")
        self.addr_a, self.addr_b = self.script("addr").split()

    def down(self) -> None:
        self.script("down", timeout=120)

    def link_bytes(self) -> int:
        """Bytes that crossed the link so far, both directions (hostA's tx + rx)."""
        tx, rx = self.script("bytes").split()
        return int(tx) + int(rx)

    def link(self, state: str) -> None:
        self.script("link", state)

    def kill(self, host: str) -> None:
        """SIGKILL every process of ``host`` (A or B)."""
        self.script("kill", host)

    def exec(
        self, host: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> Run:
        out = open(log, "wb")
        try:
            proc = subprocess.Popen(
                [str(SCRIPT), "exec", host, *argv],
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            out.close()
        return Run(host, proc, log)

    def torchrun(
        self, target: Sequence[str], workdir: Path, *, tag: str, env: dict[str, str] | None = None
    ) -> tuple[Run, Run]:
        """torchrun of ``target`` (``-m fsdp train ...`` or ``SCRIPT ...``) on both hosts,
        2 ranks each, hostA's ranks 0 and 1; each rank's stderr also lands in
        ``workdir/tag-logs-A|B/.../<local rank>/stderr.log``."""
        self._port += 1  # a fresh port: the last run's may linger in TIME_WAIT
        runs = []
        for node, host in enumerate("AB"):
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(NPROC),
                "--node-rank",
                str(node),
                "--master-addr",
                self.addr_a,
                "--master-port",
                str(self._port),
                "--log-dir",
                str(workdir / f"{tag}-logs-{host}"),
                "--tee",
                "3",
                *target,
            ]
            runs.append(self.exec(host, argv, workdir / f"{tag}-{host}.log", env))
        return runs[0], runs[1]

    def stop(self, *runs: Run) -> None:
        """Kill what is left of ``runs`` (their process groups), then every process of the
        hosts."""
        for run in runs:
            if run.proc.poll() is None:
                try:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                run.proc.wait(timeout=30)
        self.kill("A")
        self.kill("B")


def rank_stderr(workdir: Path, tag: str) -> dict[int, str]:
    """Each global rank's stderr from torchrun's --log-dir."""
    found = {}
    for node, host in enumerate("AB"):
        for path in (workdir / f"{tag}-logs-{host}").glob("*/attempt_*/*/stderr.log"):
            local = int(path.parent.name)
            found[node * NPROC + local] = path.read_text(errors="replace")
    return found


def summary(run: Run) -> dict:
    """The ``--json`` summary line of ``fsdp train`` in hostA's output."""
    for line in reversed(run.output().splitlines()):
        text = line.split(":", 1)[1] if line.startswith("[default") else line
        if text.lstrip().startswith('{"summary"'):
            return json.loads(text)["summary"]
    raise AssertionError(f"no summary in host{run.host}'s output:\n{run.output()[-4000:]}")
