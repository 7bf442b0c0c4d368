"""Slurm tasks find each other from ``SLURM_*`` alone (issue #13 item 4): the host list parser,
the derived ``env://`` variables, their errors, and ``fsdp train`` run as two faked Slurm tasks
on this host (two jobs at once, each on its own port)."""

from __future__ import annotations

import os
import random
import shlex
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from fsdp_comm import expand_hostlist, join_slurm_environment, slurm_environment, slurm_port
from fsdp_comm._slurm import SLURM_PORT_BASE, SLURM_PORT_SPAN

from fsdp.train._cli import build_parser, config_from_args
from fsdp.train._train import launcher_problem, launcher_world_size, local_device_problem

_REPO = Path(__file__).resolve().parents[2]
_TASK = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


# ---- host lists -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[08-10]", ["node08", "node09", "node10"]),  # the lower bound's width
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[007]", ["node007"]),
        ("gpu-a[1-2]-b", ["gpu-a1-b", "gpu-a2-b"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # cartesian, left to right
        (
            "node[01-03,07],gpu-a[1-2]-b",
            ["node01", "node02", "node03", "node07", "gpu-a1-b", "gpu-a2-b"],
        ),
        ("a[1,3],b,c[5-6]", ["a1", "a3", "b", "c5", "c6"]),
        ("login.cluster.org,10.0.0.[1-2]", ["login.cluster.org", "10.0.0.1", "10.0.0.2"]),
        ("[1-2]x", ["1x", "2x"]),
        ("  node[1-2]\n", ["node1", "node2"]),  # surrounding white space is ignored
    ],
)
def test_host_lists_expand(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, rule",
    [
        ("", "an empty name"),
        ("node1,", "an empty name"),
        ("a,,b", "an empty name"),
        ("node[1-3", "a '[' is never closed"),
        ("node1-3]", "a ']' closes no '['"),
        ("node[1-[2]]", "brackets do not nest"),
        ("node[]", "[] holds '', not N or N-M"),
        ("node[a-b]", "[a-b] holds 'a-b', not N or N-M"),
        ("node[1-2:2]", "holds '1-2:2', not N or N-M"),
        ("node[1,,2]", "holds '', not N or N-M"),
        ("node[5-3]", "range 5-3 runs backwards"),
        ("node[0-99999999]", "names over"),
        ("n[0-999]m[0-9999]", "it names 10000000 hosts"),
        ("node 1", "holds white space"),
    ],
)
def test_malformed_host_lists_name_variable_rule_and_value(text: str, rule: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_hostlist(text, variable="SLURM_JOB_NODELIST")
    message = str(info.value)
    assert message.startswith("SLURM_JOB_NODELIST must be a Slurm host list")
    assert rule in message and repr(text) in message


# ---- the derived environment ------------------------------------------------------------------
def test_the_env_variables_come_from_slurms() -> None:
    assert slurm_environment(_TASK) == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN),
    }


def test_outside_slurm_there_is_nothing_to_derive() -> None:
    assert slurm_environment({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"}) is None  # salloc shell
    env: dict[str, str] = {}
    assert join_slurm_environment(env) is False and env == {}


def test_variables_already_set_are_kept() -> None:
    env = {**_TASK, "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    del env["SLURM_JOB_NODELIST"], env["SLURM_JOB_ID"]  # not needed when given by hand
    assert join_slurm_environment(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == ("head", "29500", "1")


def test_the_step_node_list_comes_first() -> None:
    env = {**_TASK, "SLURM_STEP_NODELIST": "gpu[08]"}  # srun on part of the allocation
    assert slurm_environment(env)["MASTER_ADDR"] == "gpu08"  # type: ignore[index]
    del env["SLURM_STEP_NODELIST"], env["SLURM_JOB_NODELIST"]
    env["SLURM_NODELIST"] = "old[1-2]"
    assert slurm_environment(env)["MASTER_ADDR"] == "old1"  # type: ignore[index]


def test_ports_differ_between_jobs_and_stay_in_range() -> None:
    assert slurm_port(123456) != slurm_port(123457)
    assert slurm_port("0") == SLURM_PORT_BASE
    assert slurm_port(SLURM_PORT_SPAN - 1) == SLURM_PORT_BASE + SLURM_PORT_SPAN - 1
    assert slurm_port(7) == slurm_port(7 + SLURM_PORT_SPAN)  # the documented collision
    assert SLURM_PORT_BASE + SLURM_PORT_SPAN <= 32768  # below Linux's ephemeral ports


@pytest.mark.parametrize(
    "name, value, message",
    [
        (
            "SLURM_NTASKS",
            None,
            "SLURM_NTASKS is not set: under Slurm (SLURM_PROCID is set) it must "
            "be the number of tasks",
        ),
        ("SLURM_LOCALID", None, "SLURM_LOCALID is not set"),
        (
            "SLURM_JOB_ID",
            None,
            "SLURM_JOB_ID is not set: under Slurm the rendezvous port is "
            "derived from the job id; set MASTER_PORT",
        ),
        ("SLURM_JOB_NODELIST", None, "SLURM_JOB_NODELIST is not set"),
        (
            "SLURM_NTASKS",
            "0",
            "SLURM_NTASKS must be an integer >= 1 (the number of tasks), got '0'",
        ),
        ("SLURM_PROCID", "-1", "SLURM_PROCID must be an integer >= 0 (this task's rank), got '-1'"),
        ("SLURM_PROCID", "4", "SLURM_PROCID must be below SLURM_NTASKS (4), got 4"),
        (
            "SLURM_LOCALID",
            "x",
            "SLURM_LOCALID must be an integer >= 0 (this task's index on its node), got 'x'",
        ),
        ("SLURM_JOB_ID", "12a", "SLURM_JOB_ID must be an integer >= 0 (the job id), got '12a'"),
        ("SLURM_JOB_NODELIST", "gpu[07-", "SLURM_JOB_NODELIST must be a Slurm host list"),
    ],
)
def test_errors_name_the_variable_rule_and_value(
    name: str, value: str | None, message: str
) -> None:
    env = dict(_TASK)
    if value is None:
        del env[name]
    else:
        env[name] = value
    with pytest.raises(ValueError) as info:
        slurm_environment(env)
    assert message in str(info.value)


# ---- what `fsdp train` makes of it --------------------------------------------------------------
def test_fsdp_train_reads_the_world_from_slurm_alone() -> None:
    assert launcher_world_size(_TASK) == ("SLURM_NTASKS", "4")
    assert launcher_problem(_TASK) is None
    assert launcher_problem({**_TASK, "SLURM_JOB_ID": "x"}) == (
        "SLURM_JOB_ID must be an integer >= 0 (the job id), got 'x'"
    )
    # torchrun inside an allocation (srun torchrun ...): torchrun's variables win
    assert launcher_problem({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0"}) is None


def test_a_rank_needs_a_gpu_of_its_own() -> None:
    assert local_device_problem({"LOCAL_RANK": "3"}, 4) is None
    assert local_device_problem({}, 1) is None
    # srun --gpus-per-task=1: every task sees its own GPU alone, as device 0
    assert local_device_problem({"LOCAL_RANK": "3"}, 1) is None
    assert local_device_problem({"LOCAL_RANK": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4) == (
        "LOCAL_RANK 4 names cuda:4, but this process sees 4 CUDA device(s) "
        "(CUDA_VISIBLE_DEVICES='0,1,2,3'): LOCAL_RANK must be below the device count, so start "
        "at most 4 ranks per node (torchrun --nproc-per-node, sbatch --ntasks-per-node)"
    )


def test_a_bad_slurm_variable_stops_fsdp_train_before_it_starts() -> None:
    env = {
        **_clean_env(),
        **_TASK,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "node[1-",
    }
    run = subprocess.run(
        [sys.executable, "-m", "fsdp", "train", "--model", "tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "SLURM_JOB_NODELIST must be a Slurm host list" in run.stderr
    assert "'node[1-'" in run.stderr


def _readme_command(prefix: str) -> list[str]:
    """The ``fsdp train`` arguments of the several-hosts page's command that starts with
    ``prefix`` (docs/several-hosts.md, linked from the README)."""
    text = (_REPO / "docs" / "several-hosts.md").read_text()
    start = text.index(prefix) + len(prefix)
    return shlex.split(text[start : text.index("```", start)].replace("\\\n", " "))


@pytest.mark.parametrize(
    "prefix, launcher",
    [
        ("srun python -m fsdp train", {**_TASK, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}),
        ("-m fsdp train", {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}),  # torchrun's
    ],
)
def test_the_readmes_several_host_commands_fit_their_world(
    prefix: str, launcher: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [*_TASK, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    argv = _readme_command(prefix)
    assert argv[:2] == ["--model", "200m"]
    parser = build_parser()
    cfg = config_from_args(parser, parser.parse_args(argv))
    assert (cfg.world_size, cfg.strategy, cfg.shard_size) == (4, "hybrid_shard", 2)


def test_python_dash_m_fsdp_works() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "fsdp", "--version"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "fsdp" in run.stdout and "torch" in run.stdout


# ---- two faked Slurm jobs of two tasks each, at once, on this host ----------------------------
def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_")
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "FSDP_LOG_LEVEL",
        )
    }
    return env


def _free_job_id(taken: set[int]) -> int:
    """A job id whose derived port nothing listens on here (and no other test job took)."""
    rng = random.Random()
    for _ in range(200):
        job = rng.randrange(1, 10_000_000)
        port = slurm_port(job)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in the Slurm range")


def _corpus(tmp: Path) -> str:
    """``--data``: 256 KiB of the standard library's top-level modules. The default corpus is
    the whole standard library (32 MiB), which each task reads: four tasks at once."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"\n".join(f.read_bytes() for f in sorted(root.glob("*.py"))[:40])[: 256 << 10]
    (tmp / "corpus.txt").write_bytes(text)
    return str(tmp / "corpus.txt")


def _start_task(job: int, task: int, tmp: Path, corpus: str) -> subprocess.Popen[str]:
    env = {
        **_clean_env(),
        "SLURM_JOB_ID": str(job),
        "SLURM_PROCID": str(task),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(task),
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "localhost,localhost",
        "FSDP_LOG_LEVEL": "INFO",
        "FSDP_COMM_TIMEOUT": "240",
        "CUDA_VISIBLE_DEVICES": "",
    }  # gloo on CPU: two tasks of one job share no GPU here
    argv = [
        sys.executable,
        "-m",
        "fsdp",
        "train",
        "--model",
        "tiny",
        "--steps",
        "2",
        "--global-batch",
        "2",
        "--no-progress",
        "--threads-per-rank",
        "1",
        "--data",
        corpus,
    ]
    log = tmp / f"job{job}-task{task}.log"
    return subprocess.Popen(
        argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, cwd=_REPO
    )


@pytest.mark.slow
def test_two_slurm_jobs_train_at_once_on_their_own_ports(tmp_path: Path) -> None:
    first = _free_job_id(set())
    second = _free_job_id({slurm_port(first)})
    corpus = _corpus(tmp_path)
    tasks = {
        (job, task): _start_task(job, task, tmp_path, corpus)
        for job in (first, second)
        for task in (0, 1)
    }
    try:
        codes = {key: p.wait(timeout=540) for key, p in tasks.items()}
    finally:
        for p in tasks.values():
            if p.poll() is None:
                p.kill()
    logs = {key: (tmp_path / f"job{key[0]}-task{key[1]}.log").read_text() for key in tasks}
    assert all(code == 0 for code in codes.values()), logs
    for job in (first, second):
        port = slurm_port(job)
        for task in (0, 1):
            assert (
                f"Slurm job {job}: rank {task} of 2 (local rank {task}), rendezvous at "
                f"localhost:{port}"
            ) in logs[job, task]
        assert "2 ranks over torch" in logs[job, 0]  # rank 0's summary
        assert "steps 0->2" in logs[job, 0]
