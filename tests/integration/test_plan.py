"""`fsdp plan` against measured runs.

(a) Memory: a small GPT sharded per block plus the root over the threads backend at W = 2 and 4
takes one AdamW step; each rank's sharded parameters, gradients and optimizer state, and the
memory manager's pooled peak, match the plan within 10%. A fake world of 64 ranks (one rank
played on the CPU) checks the same at a scale this machine cannot run.
(b) Communication: a counting backend adds up the bytes every collective of that step moves;
they match the plan's per-collective volumes, and a 1B model built on the meta device and
sharded over a fake world of 64 (full and hybrid) sends what the plan says.
(c) The paper's formulas, the recommendation and the ``fsdp plan`` command.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fsdp_comm import FakeBackend, ThreadsBackend, init_mesh, launch
from fsdp_engine import MixedPrecisionPolicy, fully_shard, sharded_layout
from fsdp_memory import MemoryManager
from torch.distributed.tensor import DTensor

from fsdp.models import GPT, MODEL_SIZES
from fsdp.plan import Plan, PlanError, plan
from fsdp.plan._cli import main

_lock = threading.Lock()
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


# ---- measuring real runs --------------------------------------------------------------------
class CountingThreads(ThreadsBackend):
    """A threads backend adding up calls and full-tensor bytes per collective (an
    all-gather's output, a reduce-scatter's input, an all-reduce's tensor); its sub-groups
    count into the same tally."""

    def __init__(self, *args: Any, counts: Counter[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = counts

    def _add(self, kind: str, t: torch.Tensor) -> None:
        with _lock:
            self.counts[f"{kind}.calls"] += 1
            self.counts[f"{kind}.bytes"] += t.numel() * t.element_size()

    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Any:
        self._add("all_gather", out)
        return super()._all_gather_impl(out, inp, async_op)

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: Any, async_op: bool
    ) -> Any:
        self._add("reduce_scatter", inp)
        return super()._reduce_scatter_impl(out, inp, op, async_op)

    def _all_reduce_impl(self, tensor: torch.Tensor, op: Any, async_op: bool) -> Any:
        self._add("all_reduce", tensor)
        return super()._all_reduce_impl(tensor, op, async_op)

    def _new_group_impl(self, ranks: tuple[int, ...]) -> Any:
        sub = super()._new_group_impl(ranks)
        if not isinstance(sub, ThreadsBackend):
            return None
        return CountingThreads(sub.world, sub.rank, device=sub.device, counts=self.counts)


@dataclass(frozen=True)
class Case:
    """One measured configuration of the small GPT."""

    strategy: str
    gpus: int
    gpus_per_node: int = 8
    param_dtype: str = "fp32"

    def plan(self) -> Plan:
        return plan(
            "small",
            gpus=self.gpus,
            gpus_per_node=self.gpus_per_node,
            strategy=self.strategy,
            param_dtype=self.param_dtype,
        )

    def mesh(self, backend: Any) -> Any:
        w = self.gpus
        if self.strategy == "no_shard":
            return init_mesh((w, 1), backend=backend)
        if self.strategy == "hybrid_shard":
            return init_mesh((w // self.gpus_per_node, self.gpus_per_node), backend=backend)
        return backend

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        if self.param_dtype == "fp32":
            return None
        return MixedPrecisionPolicy(param_dtype={"bf16": torch.bfloat16}[self.param_dtype])


CASES = [
    Case("full_shard", 2),
    Case("full_shard", 4),
    Case("full_shard", 2, param_dtype="bf16"),
    Case("full_shard", 4, param_dtype="bf16"),
    Case("hybrid_shard", 4, gpus_per_node=2),
    Case("hybrid_shard", 4, gpus_per_node=2, param_dtype="bf16"),
    Case("shard_grad_op", 2),
    Case("no_shard", 2, param_dtype="bf16"),
]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's own rows: what this rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_model(case: Case, mesh: Any, memory: Any, device: str = "cpu") -> GPT:
    cfg = MODEL_SIZES["small"]
    with _lock, torch.device(device):  # ranks share the global generator
        torch.manual_seed(0)
        model = GPT(cfg)
    kw: dict[str, Any] = dict(mesh=mesh, memory=memory, mp_policy=case.mp_policy())
    # The plan's model: blocks freed after forward (explicit True, so the last one too), the
    # root kept (None: an explicit True would reshard the root as well, as in FSDP2).
    reshard = case.strategy != "shard_grad_op"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=None if reshard else False, **kw)
    return model


def _step(model: GPT, rank: int, device: str = "cpu") -> torch.optim.Optimizer:
    """One AdamW step on a rank's micro-batch (2 sequences of 16 tokens). What is measured
    (parameter, gradient and optimizer bytes, the pool's peak, the collectives) does not
    depend on the sequence length: the model's full 128 tokens measured the same bytes and
    calls in every case, at 8 times the compute."""
    cfg = MODEL_SIZES["small"]
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (2, 16 + 1), generator=g).to(device)
    logits = model(x[:, :-1]).flatten(0, 1).float()
    F.cross_entropy(logits, x[:, 1:].flatten()).backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return opt


def _held_bytes(model: GPT, opt: torch.optim.Optimizer, memory: MemoryManager) -> dict[str, int]:
    return {
        "params": sum(s.local.numel() * s.local.element_size() for s in sharded_layout(model)),
        "grads": sum(
            _local(p.grad).numel() * p.grad.element_size()
            for p in model.parameters()
            if p.grad is not None
        ),
        "optimizer": sum(
            _local(t).numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if t.dim() > 0
        ),
        "pooled": memory.stats().peak_bytes,
    }


def _measure_rank(backend: ThreadsBackend, case: Case) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    counting = CountingThreads(backend.world, backend.rank, device=backend.device, counts=counts)
    memory = MemoryManager("cpu")
    model = _shard_model(case, case.mesh(counting), memory)
    # The plan is per step: the first step's lazy init also agrees on the shard layout once
    # (Note [layout agreement] in fsdp_engine: one all-reduce of 10 int64), so count the next.
    _step(model, backend.rank)
    model.zero_grad(set_to_none=True)
    counts.clear()
    opt = _step(model, backend.rank)
    return {"counts": dict(counts), **_held_bytes(model, opt, memory)}


@functools.cache
def _measured(case: Case) -> list[dict[str, Any]]:
    """Each rank's bytes and collective tally for one step of ``case`` (run once per case)."""
    return launch(_measure_rank, case.gpus, backend="threads", args=(case,), timeout=60)


def _close(measured: float, planned: float, tol: float = 0.10) -> bool:
    return abs(measured - planned) <= tol * planned


# ---- (a) memory ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.strategy}-W{c.gpus}-{c.param_dtype}")
def test_memory_matches_measured_run(case: Case) -> None:
    mem = case.plan().memory
    for rank, got in enumerate(_measured(case)):
        for key, planned in (
            ("params", mem.sharded_params),
            ("grads", mem.gradients),
            ("optimizer", mem.optimizer_state),
            ("pooled", mem.pooled),
        ):
            assert _close(got[key], planned), (rank, key, got[key], planned)


def test_memory_matches_a_fake_world_of_64() -> None:
    """One rank of 64 (fake backend: right shapes, no exchange) on the CPU with a real memory
    manager: shards are 1/64 of each padded unit and the pool peaks at root + 2 units."""
    for dtype in ("fp32", "bf16"):
        case = Case("full_shard", 64, param_dtype=dtype)
        memory = MemoryManager("cpu")
        model = _shard_model(case, FakeBackend(rank=0, world_size=64), memory)
        got = _held_bytes(model, _step(model, 0), memory)
        mem = case.plan().memory
        for key, planned in (
            ("params", mem.sharded_params),
            ("grads", mem.gradients),
            ("optimizer", mem.optimizer_state),
            ("pooled", mem.pooled),
        ):
            assert _close(got[key], planned), (dtype, key, got[key], planned)


# ---- (b) communication -----------------------------------------------------------------------
def _planned_counts(p: Plan, *, input_bytes: bool = False) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind in KINDS:
        c = p.comm.by_kind(kind)
        if c is not None:
            out[f"{kind}.calls"] = c.calls
            out[f"{kind}.bytes"] = c.input_bytes if input_bytes else c.buffer_bytes
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.strategy}-W{c.gpus}-{c.param_dtype}")
def test_communication_matches_counted_bytes(case: Case) -> None:
    planned = _planned_counts(case.plan())
    for rank, got in enumerate(_measured(case)):
        assert set(got["counts"]) == set(planned), (rank, got["counts"], planned)
        for key, value in planned.items():
            assert _close(got["counts"][key], value, 0.01), (rank, key, got["counts"], planned)


class _MetaMemory:
    """A memory manager for meta tensors (fsdp_memory serves CPU and CUDA only): buffers
    cost nothing and the limiter never waits. Shows the engine's ``memory=`` swap."""

    class _Ticket:
        def release(self, *, after: Any = None) -> None:
            pass

    class _Limiter:
        max_count = None
        max_bytes = None

        def acquire(self, nbytes: int) -> Any:
            return _MetaMemory._Ticket()

    def __init__(self) -> None:
        self.limiter = self._Limiter()

    def allocate(self, numel: int, dtype: torch.dtype, *, stream: Any = None) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="meta")

    def free(self, tensor: torch.Tensor, *, after: Any = None) -> None:
        pass


@pytest.mark.parametrize("strategy", ["full_shard", "hybrid_shard"])
def test_fake_world_of_64_sends_what_the_plan_says(strategy: str) -> None:
    """The 1B GPT built on the meta device, sharded for rank 0 of 64 GPUs (8 per node) with
    bf16 mixed precision: a forward and backward on meta tensors, counted by the fake
    backend (input bytes per rank), against the plan."""
    cfg = MODEL_SIZES["1b"]
    with torch.device("meta"):
        model = GPT(cfg)
    world = FakeBackend(rank=0, world_size=64, device="meta")
    mesh = init_mesh((8, 8), backend=world) if strategy == "hybrid_shard" else world
    kw: dict[str, Any] = dict(
        mesh=mesh, memory=_MetaMemory(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    p = plan("1b", gpus=64, gpus_per_node=8, strategy=strategy, param_dtype="bf16")
    held = sum(s.length for s in sharded_layout(model)) * 4
    assert _close(held, p.memory.sharded_params, 0.01)
    world.traffic.calls.clear()
    world.traffic.bytes.clear()
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device="meta")
    F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    got = {
        f"{k.removesuffix('_tensor').removesuffix('_into')}.{f}": getattr(world.traffic, f)[k]
        for k in world.traffic.calls
        for f in ("calls", "bytes")
    }
    assert got == _planned_counts(p, input_bytes=True)


# ---- (c) the paper's formulas and the recommendation -----------------------------------------
def _big(strategy: str, gpus: int = 64, **kw: Any) -> Plan:
    return plan(
        7e9,
        layers=32,
        d_model=4096,
        gpus=gpus,
        gpus_per_node=8,
        strategy=strategy,
        param_dtype="bf16",
        seq_len=4096,
        **kw,
    )


def test_cross_node_traffic_follows_section_3_2_2() -> None:
    full, hybrid, ddp = _big("full_shard"), _big("hybrid_shard"), _big("no_shard")
    m, root = 2 * full.model.total_params, 2 * full.model.root_numel  # bf16 bytes
    w, g = 64, 8
    # The root unit stays gathered from forward to backward: no backward all-gather for it.
    assert _close(full.comm.cross_node_bytes, (3 * m - root) * (w - 1) / w, 0.001)
    assert _close(ddp.comm.cross_node_bytes, 2 * m * (w - 1) / w, 0.001)
    assert _close(hybrid.comm.cross_node_bytes, 2 * m * (w - g) / (g * w), 0.001)
    assert hybrid.comm.cross_node_bytes <= 2 * m * (w - 1) / (g * w)  # the paper's bound
    assert _close(hybrid.comm.intra_node_bytes, (3 * m - root) * (g - 1) / g, 0.001)
    assert full.comm.intra_node_bytes == ddp.comm.intra_node_bytes == 0
    assert 1.4 < full.comm.total_bytes / ddp.comm.total_bytes <= 1.5  # Section 3.2.1: 1.5x DDP


def test_memory_follows_section_3_2_1() -> None:
    full, hybrid = _big("full_shard"), _big("hybrid_shard")
    total = full.model.total_params
    assert _close(full.memory.sharded_params, 4 * total / 64, 0.001)
    assert _close(hybrid.memory.sharded_params, 4 * total / 8, 0.001)
    assert full.memory.optimizer_state == 8 * total // 64
    largest = full.model.block_numel
    assert _close(full.memory.unsharded_params, 2 * (full.model.root_numel + 2 * largest), 0.01)
    ckpt = _big("full_shard", activation_checkpointing=True)
    assert ckpt.memory.activations < full.memory.activations / 5
    offload = _big("full_shard", cpu_offload=True)
    assert offload.memory.sharded_params == offload.memory.optimizer_state == 0
    assert offload.memory.host == (
        full.memory.sharded_params + full.memory.gradients + full.memory.optimizer_state
    )


def test_recommendation_picks_what_fits() -> None:
    assert _big("full_shard", gpu_memory="80GB").recommendation.strategy == "hybrid_shard"
    big = plan(
        70e9,
        layers=80,
        d_model=8192,
        gpus=8,
        strategy="full_shard",
        param_dtype="bf16",
        seq_len=4096,
        gpu_memory=80,
        host_memory="2TiB",
    )
    rec = big.recommendation
    assert rec.fits and rec.cpu_offload and rec.activation_checkpointing
    assert not big.fits(80 * 2**30) and "does not fit" in rec.text
    assert big.host_memory is not None and big.host_memory.fits
    hopeless = plan(70e9, layers=80, gpus=8, gpu_memory=1, seq_len=4096)
    assert not hopeless.recommendation.fits and "GPUs" in hopeless.recommendation.text


def test_api_errors_name_the_argument() -> None:
    for kwargs, argument in (
        (dict(model="nope", gpus=8), "model"),
        (dict(model="small", gpus=12, strategy="hybrid_shard"), "gpus"),
        (dict(model="small", gpus=0), "gpus"),
        (dict(model="small", gpus=8, param_dtype="fp12"), "param_dtype"),
        (dict(model="small", gpus=8, strategy="zero9"), "strategy"),
        (dict(model="small", gpus=8, shard_size=4), "shard_size"),
        (dict(model="small", gpus=8, layers=3), "layers"),
        (dict(model=1000, gpus=8, layers=4, d_model=64), "params"),
    ):
        with pytest.raises(PlanError) as info:
            plan(**kwargs)
        assert info.value.argument == argument, (kwargs, info.value)


# ---- (c) the command -------------------------------------------------------------------------
def test_cli_prints_the_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--params",
                "7B",
                "--layers",
                "32",
                "--d-model",
                "4096",
                "--gpus",
                "64",
                "--gpus-per-node",
                "8",
                "--strategy",
                "hybrid-shard",
                "--param-dtype",
                "bf16",
                "--gpu-memory",
                "80GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for text in (
        "sharded parameters",
        "sharded gradients",
        "optimizer state",
        "unsharded parameters",
        "activations (estimate)",
        "total",
        "all-gather (forward)",
        "all-gather (backward)",
        "reduce-scatter",
        "all-reduce (replicas)",
        "cross-node",
        "intra-node",
        "recommendation:",
    ):
        assert text in out, text


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "small", "--gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["total"] == plan("small", gpus=4).memory.total
    assert data["config"]["shard_group"] == 4


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--model", "nope", "--gpus", "8"], "--model"),
        (["--params", "7x", "--gpus", "8"], "--params"),
        (["--model", "small", "--gpus", "12", "--strategy", "hybrid_shard"], "--gpus"),
        (["--model", "small", "--gpus", "8", "--strategy", "zero9"], "--strategy"),
        (["--model", "small", "--gpus", "8", "--param-dtype", "fp12"], "--param-dtype"),
        (["--model", "small", "--gpus", "8", "--layers", "4"], "--layers"),
        (["--model", "small", "--gpus", "8", "--gpu-memory", "lots"], "--gpu-memory"),
        (["--model", "small", "--gpus", "8", "--shard-size", "4"], "--shard-size"),
        (["--model", "small"], "--gpus"),
    ],
)
def test_cli_errors_name_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert option in capsys.readouterr().err


def test_cluster_line_of_fewer_gpus_than_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    """2 GPUs with the default 8 per node are one node of 2 GPUs, not of 8."""
    from fsdp.plan._cli import main

    assert main(["--params", "7B", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "cluster    2 GPUs = 1 node x 2 GPUs;" in out, out


def test_no_recommendation_and_no_fits_without_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --gpu-memory nothing can be said to fit, so nothing is recommended."""
    import json

    from fsdp.plan._cli import main

    assert main(["--params", "7B", "--gpus", "8", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["fits"] is None and rec["text"].startswith("none without a memory budget")
    assert main(["--params", "7B", "--gpus", "8"]) == 0
    assert (
        "recommendation: none without a memory budget: pass --gpu-memory" in capsys.readouterr().out
    )


# ---- (c) presets, config files and host memory -----------------------------------------------
def _offload_70b(**kw: Any) -> Plan:
    """70B on one node of 8 x 80 GiB: only CPU offload (with checkpointing) fits the GPUs."""
    return plan(
        70e9, layers=80, d_model=8192, gpus=8, param_dtype="bf16", seq_len=4096, gpu_memory=80, **kw
    )


def test_cpu_offload_needs_the_host_memory_of_a_node() -> None:
    fits = _offload_70b(host_memory="2TiB")
    host = fits.host_memory
    assert host is not None and fits.recommendation.cpu_offload and fits.recommendation.fits
    offloaded = _offload_70b(host_memory="2TiB", cpu_offload=True, activation_checkpointing=True)
    assert host.per_gpu == offloaded.memory.host  # sharded fp32 params + grads + AdamW
    assert host.per_node == 8 * host.per_gpu and host.source == "given"
    assert "pinned per node, fits 80% of 2 TiB (given)" in fits.recommendation.text
    short = _offload_70b(host_memory="512GiB")
    rec = short.recommendation
    assert rec.fits is False and rec.host is not None and rec.host.fits is False
    assert "its host memory does not" in rec.text and "--host-memory" in rec.text
    assert short.to_dict()["host_memory"]["fits"] is False


def test_host_memory_defaults_to_this_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import fsdp.plan._plan as P

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert P.machine_memory() == total
    monkeypatch.setattr(P, "machine_memory", lambda: 4 * 2**40)
    p = _offload_70b()
    assert p.host_memory is not None and p.host_memory.source == "this machine's"
    assert p.host_memory.available == 4 * 2**40 and p.recommendation.cpu_offload
    monkeypatch.setattr(P, "machine_memory", lambda: None)
    unknown = _offload_70b(cpu_offload=True)
    assert unknown.host_memory is not None and unknown.host_memory.fits is None
    assert "host memory unknown" in unknown.host_memory.text()


def test_no_host_memory_without_offload(capsys: pytest.CaptureFixture[str]) -> None:
    p = plan("small", gpus=4, gpu_memory=80)
    assert p.host_memory is None and p.to_dict()["host_memory"] is None
    asked = plan("small", gpus=4, cpu_offload=True, host_memory="1KiB")
    assert asked.recommendation.fits is None and asked.host_memory is not None
    assert "does not fit host memory" in asked.recommendation.text


def test_cli_presets_and_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--model",
                "llama3-70b",
                "--gpus",
                "8",
                "--param-dtype",
                "bf16",
                "--seq-len",
                "4096",
                "--gpu-memory",
                "80",
                "--host-memory",
                "2T",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model      llama3-70b: 70.55B parameters" in out
    assert "shape      80 layers, d_model 8192, 64 heads (8 kv), FFN 28672" in out
    assert "host memory per node (recommended CPU offload): 8 GPUs x" in out
    assert main(["--params", "70B", "--gpus", "8", "--json", "--host-memory", "1.5TiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["total_params"] == 70_553_706_496
    assert "llama3-70b" in data["model"]["note"]
    assert data["config"]["host_memory"] == 1536 * 2**30
    assert main(["--params", "1B", "--gpus", "8"]) == 0
    assert "note       layers and d_model guessed" in capsys.readouterr().out


def test_cli_hf_config(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mistral",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 176,
                "vocab_size": 101,
                "max_position_embeddings": 128,
            }
        )
    )
    assert main(["--hf-config", str(tmp_path), "--gpus", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["architecture"]["n_kv_heads"] == 2
    assert data["model"]["seq_len"] == 128


def test_cli_help_lists_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in (
        "tiny",
        "8x512",
        "llama2-7b",
        "llama3-70b",
        "gpt2-xl",
        "--hf-config",
        "--host-memory",
    ):
        assert name in out, name


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--hf-config", "/nonexistent/dir", "--gpus", "8"], "--hf-config"),
        (["--model", "llama3-8b", "--gpus", "8", "--host-memory", "lots"], "--host-memory"),
        (["--model", "llama3-8b", "--hf-config", "x", "--gpus", "8"], "--hf-config"),
        (["--hf-config", "x", "--gpus", "8", "--layers", "4"], "--layers"),
    ],
)
def test_cli_model_errors_name_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert option in capsys.readouterr().err


def test_gpu_memory_is_read_by_the_shared_size_rule() -> None:
    from fsdp_comm import parse_size

    from fsdp.plan import parse_memory

    for text in ("80", "80GB", "80GiB", "81920M", "0.5T", 80):
        assert parse_memory(text) == parse_size(text, default_unit="g")
    with pytest.raises(PlanError) as info:
        parse_memory("lots", argument="host_memory")
    assert info.value.argument == "host_memory" and "'lots'" in info.value.message
