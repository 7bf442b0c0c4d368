"""The regression gate: one short, steady benchmark per layer's hot path, what
`scripts/bench-regress` compares by default (through asv_bench/asv.gate.conf.json, whose
benchmark directory asv_bench/gate/ links to this file).

Each runs in-process (no rank processes: world size 1, or a world of 2 simulated by
fsdp_comm's `FakeBackend`), through public entry points, with torch on one thread, and
reports its hot path's time as a ratio to a reference workload that does not depend on this
repository's code, timed right after it, pair by pair: the median of
several hundred such ratios. On a shared 2-core machine the speed of everything moves by 10-20%
from one minute to the next (other processes, the host's clock boost); the operation and its
reference move together, and their ratio stays within ~2% (docs/benchmarks.md has the
measurements). A 10% slowdown of the hot path is a 10% larger ratio. Also:

* samples are short (~0.02-10 ms), so preemption hits few of them, and the median is theirs;
* the timers leave out time this thread spent preempted: `own_time` (wall-clock time less
  the time this thread waited in the run queue, from /proc/thread-self/schedstat), so that a
  sleep or a lock wait in a hot path still counts; the thread's CPU time for the checkpoint,
  whose background thread (deleting the previous version) would otherwise show;
* the state is built and warmed up before the timing; the garbage collector is off while
  sampling, as in asv's own timing.

asv runs `track_` benchmarks once per commit (``rounds = 1``: asv keeps only the last round
of a track benchmark) and `bench-regress` flags a ratio more than 5% higher.
`scripts/bench-regress --self-test` commits a ~10% slowdown into each layer in turn and checks
that the benchmark named for it below is flagged.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

# Imported here, not in the benchmarks, so that asv's forkserver has them loaded before it
# forks a process per benchmark.
import fsdp_ckpt  # noqa: F401
import fsdp_comm  # noqa: F401
import fsdp_engine  # noqa: F401
import fsdp_memory  # noqa: F401
import torch

if TYPE_CHECKING:
    from fsdp_comm import FakeTraffic

# FSDP_BENCH_SMOKE=1 (tests/test_benchmarks_smoke.py) runs every benchmark once, small.
SMOKE = os.environ.get("FSDP_BENCH_SMOKE") == "1"

#: Sharded units of `EngineUnits` (each a Linear(8, 8)); the root adds one more.
UNITS = 8
#: Bytes of fp32 state the checkpoint benchmarks save and load. 4 MiB, not more: at 16 MiB
#: the save's ratio to a raw write moved by 7% between processes (1.20-1.29, five processes
#: under load 2-3), at 4 MiB by 2.7% (2.22-2.28); the memory traffic of larger writes is
#: what varies between processes.
CKPT_BYTES = (1 << 20) if SMOKE else (4 << 20)
#: Seconds of paired samples each benchmark takes (after its warm-up).
SECONDS = 0.05 if SMOKE else 1.0


_SCHEDSTAT = "/proc/thread-self/schedstat"


def own_time() -> float:
    """Seconds of wall-clock time this thread was not waiting in the run queue: its CPU time
    plus the time it slept or blocked (preemption by other processes left out). Falls back
    to `time.process_time` where the kernel does not expose schedstat."""
    with open(_SCHEDSTAT, "rb") as f:
        waited_ns = int(f.read().split()[1])
    return time.perf_counter() - waited_ns * 1e-9


try:
    own_time()
except (OSError, ValueError, IndexError):
    own_time = time.process_time  # type: ignore[assignment]  # noqa: F811


def paired_ratio(
    op, ref, *, op_number=1, ref_number=1, timer=None, seconds=None, between=None
) -> float:
    """Median over pairs of (time of ``op_number`` calls of ``op``) / (time of ``ref_number``
    calls of ``ref``), each pair timed back to back; at least 20 pairs, else ``seconds``.
    ``between``: called after each pair, outside the timing."""
    timer = timer or own_time
    seconds = SECONDS if seconds is None else seconds
    for _ in range(3):
        op()
        ref()
    ratios = []
    gc.collect()
    gc.disable()
    try:
        end = time.perf_counter() + seconds
        while len(ratios) < 20 or time.perf_counter() < end:
            t0 = timer()
            for _ in range(op_number):
                op()
            t1 = timer()
            for _ in range(ref_number):
                ref()
            t2 = timer()
            ratios.append((t1 - t0) / op_number / max((t2 - t1) / ref_number, 1e-12))
            if between is not None:
                between()
    finally:
        gc.enable()
    return statistics.median(ratios)


class _Gate:
    """asv settings shared by the gate."""

    timeout = 120
    rounds = 1


def _tiny_units(n):
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])


def engine_units():
    """(sharded forward+backward, the same unsharded) of `UNITS` Linear(8, 8) and the root."""
    from fsdp_comm import ThreadsBackend
    from fsdp_engine import fully_shard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    backend = ThreadsBackend.create(1)[0]
    model, plain = _tiny_units(UNITS), _tiny_units(UNITS)
    for layer in model:
        fully_shard(layer, mesh=backend)
    fully_shard(model, mesh=backend)
    x = torch.randn(4, 8)

    def sharded():
        model(x).sum().backward()

    def reference():
        plain(x).sum().backward()

    return sharded, reference


class EngineUnits(_Gate):
    """The fp32-resident figure: forward+backward of 8 tiny sharded units (Linear(8, 8)) and
    the root, fp32, world size 1, so never gathered, cast or reduced, over the same model
    unsharded: the engine's per-unit bookkeeping (hooks, views) with almost no compute under
    it. The configuration users run is `EngineUnitsBf16Gathered`."""

    def track_units_over_plain(self):
        sharded, reference = engine_units()
        return paired_ratio(sharded, reference)

    track_units_over_plain.unit = "ratio"


#: Simulated world size of `EngineUnitsBf16Gathered`.
GATHERED_WORLD = 2
#: Models `EngineUnitsBf16Gathered` builds in turn; it reports the median of their ratios.
GATHERED_MODELS = 5


def engine_units_bf16_gathered(
    traffic: FakeTraffic | None = None,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(sharded forward+backward, the same unsharded in bf16) of `UNITS` Linear(8, 8) units
    and the root, in the configuration users run: bf16 parameters, fp32 reduction
    (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``), the
    engine's default resharding (every unit but the last of forward is gathered and resharded
    per forward and gathered again in backward), as rank 0 of a world of `GATHERED_WORLD`
    simulated in process (fsdp_comm's `FakeBackend`: the gathers, casts and reduce-scatters
    run on this rank's data; nothing is exchanged, nothing waits). The model and its sharding
    are `python -m fsdp.bench.engines --unit-overhead`'s (`_Tiny`, `_shard_tiny`).
    ``traffic``: where the backend counts its collectives."""
    from fsdp_comm import FakeBackend

    from fsdp.bench.engines import _shard_tiny, _Tiny

    torch.set_num_threads(1)
    torch.manual_seed(0)
    backend = FakeBackend(rank=0, world_size=GATHERED_WORLD, traffic=traffic)
    model, plain = _Tiny(UNITS, 8), _Tiny(UNITS, 8).to(torch.bfloat16)
    _shard_tiny(model, "ours", backend, bf16=True)
    x = torch.randn(4, 8)
    x_bf16 = x.to(torch.bfloat16)

    def sharded() -> None:
        model(x).sum().backward()

    def reference() -> None:
        plain(x_bf16).sum().backward()

    return sharded, reference


class EngineUnitsBf16Gathered(_Gate):
    """The configuration users run: forward+backward of 8 tiny units (Linear(8, 8)) and the
    root with bf16 parameters and fp32 reduction, gathered and resharded, world size 2
    (`engine_units_bf16_gathered`), over the same model unsharded in bf16: the engine's
    per-unit cost with the gathers, casts and reduce-scatters it adds. The median over
    `GATHERED_MODELS` models, each built afresh: one model's ratio moved by up to 5% from the
    next (9.1-10.1 in one process), the median of five by ~2% between processes (9.24-9.59
    in 8 processes under load 3, 2026-11-27; docs/benchmarks.md)."""

    def track_units_over_plain(self) -> float:
        ratios = []
        for _ in range(1 if SMOKE else GATHERED_MODELS):
            sharded, reference = engine_units_bf16_gathered()
            ratios.append(paired_ratio(sharded, reference, seconds=SECONDS / 2))
        return statistics.median(ratios)

    track_units_over_plain.unit = "ratio"


def python_reference():
    """The reference for calls of microseconds: Python and tensor-metadata work of the kind a
    collective call's checks or a pool's bookkeeping do, none of it this repository's."""
    a, b = torch.empty(256), torch.empty(1024)
    table = {}

    def reference():
        for i in range(4):
            table[i] = (
                a.numel() * 4 == b.numel(),
                a.dtype == b.dtype,
                a.is_contiguous(),
                b.view(-1).shape,
                a.device.type,
            )
        table.clear()

    return reference


def comm_call():
    """The torch backend's all-gather of 1 KiB in a gloo world of one, its torch.distributed
    collective replaced by a no-op while the call runs: the call path itself (checks,
    dispatch, work handle), without gloo's worker thread, whose scheduling on a busy machine
    moves the figure more than the call costs."""
    import fsdp_comm._torch_backend as tb
    from fsdp_comm import TorchBackend

    torch.set_num_threads(1)
    be = TorchBackend()  # a gloo world of one, unless torchrun's environment says otherwise
    inp, out = torch.ones(256), torch.empty(256)
    real = getattr(tb, "_ALL_GATHER", None)

    def noop(*args, **kwargs):
        return None  # what a completed synchronous collective returns

    def call():
        if real is not None:
            tb._ALL_GATHER = noop
        try:
            be.all_gather_into_tensor(out, inp)
        finally:
            if real is not None:
                tb._ALL_GATHER = real

    return call


class CommCall(_Gate):
    """`TorchBackend.all_gather_into_tensor` (the collective a no-op): what the torch backend
    adds to a collective call, over `python_reference` (bandwidth: `comm.GlooCollectives`)."""

    def track_all_gather_call(self):
        return paired_ratio(comm_call(), python_reference(), op_number=20, ref_number=20)

    track_all_gather_call.unit = "ratio"


def memory():
    from fsdp_memory import MemoryManager, RateLimiter

    mm, limiter = MemoryManager("cpu"), RateLimiter(max_count=2)
    mm.free(mm.allocate(1 << 20, torch.float32))  # the cycle reuses this block

    def cycle():
        mm.free(mm.allocate(1 << 20, torch.float32))

    def limit():
        limiter.acquire(4 << 20).release()

    return cycle, limit


class MemoryCycle(_Gate):
    """`MemoryManager.allocate` + `free` of a 4 MiB unit buffer on CPU (pooled: the reuse path
    every unshard takes), and `RateLimiter.acquire` + `release` that do not block, over
    `python_reference`."""

    def track_allocate_free(self):
        return paired_ratio(memory()[0], python_reference(), op_number=20, ref_number=20)

    track_allocate_free.unit = "ratio"

    def track_limiter(self):
        return paired_ratio(memory()[1], python_reference(), op_number=20, ref_number=20)

    track_limiter.unit = "ratio"


class CkptState:
    """A 4 MiB plain model (4 Linear weights) and a checkpoint path in shared memory
    (/dev/shm when there is one: no disk in the timing); `close` removes it (asv's benchmark
    processes end without running `atexit`, which left 1.4 GB of these in /dev/shm).
    References: `raw_commit`, and the same bytes read back with their CRC-32."""

    def __init__(self):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="fsdp-gate-ckpt-", dir=shm)
        self.path = os.path.join(self.dir, "ckpt")
        self.raw = os.path.join(self.dir, "raw")
        rows = 256
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(CKPT_BYTES // 16 // rows, rows, bias=False) for _ in range(4)]
        )
        self.views = [
            p.detach().view(-1).view(torch.uint8).numpy().data for p in self.model.parameters()
        ]
        self.save()
        self.index = _saved_index(self.path)
        self.commits = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        fsdp_ckpt.wait_for_cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)

    def save(self):
        fsdp_ckpt.save(self.path, self.model)

    def load(self):
        fsdp_ckpt.load(self.path, self.model)

    def raw_write(self):
        crc = 0
        with open(self.raw, "wb") as f:
            for v in self.views:
                f.write(v)
                crc = zlib.crc32(v, crc)

    def raw_commit(self):
        """A commit done with the standard library alone, the shape of the save: a new
        directory, the bytes and their CRC-32 behind a JSON header, an index of the same
        JSON, fsync, renames, and a thread started and joined. Its work is of the same kinds
        as the save's (Python, memory traffic, file system calls), so the two move together
        when other processes take the caches or the cores; a raw write alone is only memory
        traffic, and its ratio to the save moved by 7-15% with the machine's load."""
        self.commits += 1
        staging = os.path.join(self.dir, "staging")
        final = os.path.join(self.dir, f"done-{self.commits}")
        os.mkdir(staging)
        crc = 0
        with open(os.path.join(staging, "data"), "wb") as f:
            f.write(json.dumps(self.index, separators=(",", ":")).encode())
            for v in self.views:
                f.write(v)
                crc = zlib.crc32(v, crc)
            os.fsync(f.fileno())
        with open(os.path.join(staging, "index.json"), "w") as f:
            f.write(json.dumps({"crc": crc, "index": self.index}, indent=1))
            os.fsync(f.fileno())
        worker = threading.Thread(target=os.listdir, args=(staging,))
        worker.start()
        worker.join()
        os.rename(staging, final)

    def between_saves(self):
        """Outside the timing: the previous versions of both are deleted."""
        fsdp_ckpt.wait_for_cleanup()
        for name in os.listdir(self.dir):
            if name.startswith("done-"):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def raw_read(self):
        crc = 0
        with open(self.raw, "rb") as f:
            for v in self.views:
                crc = zlib.crc32(f.read(v.nbytes), crc)


def _saved_index(path):
    """The JSON index the save wrote (data for `raw_commit` to encode, not our code)."""
    for root, _, files in os.walk(path):
        if "index.json" in files:
            with open(os.path.join(root, "index.json")) as f:
                return json.load(f)
    return {}


class CkptSaveLoad(_Gate):
    """`fsdp_ckpt.save` of a 4 MiB plain model at world size 1 over the same commit done with
    the standard library (`CkptState.raw_commit`): the tensor-file writer and the commit
    protocol around it. Thread CPU time:
    the previous version is deleted by a background thread. (`load`'s ratio to a raw read
    moves by ~7% between processes here, too much for a 5% gate: it is `ckpt.LoadOverRead`
    in the full suite.)"""

    def track_save(self):
        # The median over three checkpoints, each with a model of its own: one model's pages
        # moved the ratio by a few percent (five in one process: 1.15-1.24 against a raw
        # write), three in a row by ~1%.
        ratios = []
        for _ in range(3):
            with CkptState() as state:
                # The previous version's deletion (a background thread) is waited for
                # between pairs, so it does not compete with the next pair.
                ratios.append(
                    paired_ratio(
                        state.save,
                        state.raw_commit,
                        timer=time.thread_time,
                        seconds=SECONDS / 2,
                        between=state.between_saves,
                    )
                )
        return statistics.median(ratios)

    track_save.unit = "ratio"


#: Latency of every collective of `ExposedComm`'s backend, seconds: well under a block's
#: forward (~10 ms here), so a gather issued one block ahead is always done when waited for.
LATENCY_S = 5e-3


def latency_backend(world_size: int = 2):
    """Rank 0 of a simulated world (fsdp_comm's `FakeBackend`: shape-correct, nothing
    exchanged) whose every collective completes `LATENCY_S` after it is issued."""
    from fsdp_comm import FakeBackend, Work

    class Delayed(Work):
        def __init__(self) -> None:
            self.due = time.perf_counter() + LATENCY_S

        def wait(self, timeout=None) -> None:
            left = self.due - time.perf_counter()
            if left > 0:
                time.sleep(left)

        def is_completed(self) -> bool:
            return time.perf_counter() >= self.due

    class LatencyBackend(FakeBackend):
        def _all_gather_impl(self, out, inp, async_op):
            super()._all_gather_impl(out, inp, async_op)
            return Delayed()

        def _reduce_scatter_impl(self, out, inp, op, async_op):
            super()._reduce_scatter_impl(out, inp, op, async_op)
            return Delayed()

    return LatencyBackend(rank=0, world_size=world_size)


class _Blocks(torch.nn.Module):
    """8 blocks (Linear(512, 512), tanh) and a head in the root, as a GPT has its output
    layer: the root's backward comes first and can hide the last block's all-gather."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
            for _ in range(UNITS)
        )
        self.head = torch.nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def exposed_waits(steps: int = 3) -> float:
    """Waits per step that blocked for half a latency or more (the step timeline of
    `fsdp_engine.profile_steps`, stamped in this thread's own time: `own_clock`), less the
    two reduce-scatters the end of every backward waits for (the last block's and the
    root's, issued last: how much of them is exposed depends on how fast those last
    hooks ran). Mean over ``steps``."""
    from fsdp_engine import fully_shard, profile_steps

    torch.set_num_threads(1)
    torch.manual_seed(0)
    be = latency_backend()
    model = _Blocks(128 if SMOKE else 512)
    for block in model.blocks:
        fully_shard(block, mesh=be)
    fully_shard(model, mesh=be)
    x = torch.randn(32 if SMOKE else 384, model.head.in_features)
    model(x).sum().backward()  # builds the units
    blocked = 0
    with own_clock(), profile_steps(model) as prof:
        for _ in range(steps):
            lo = prof.timeline.step_marks[-1]
            model(x).sum().backward()
            prof.step()
            waits = [w for w in prof.timeline.waits if w.start >= lo]
            reduces = [w for w in waits if w.name == "wait_reduce"]
            counted = [w for w in waits if w.name != "wait_reduce"] + reduces[:-2]
            blocked += sum(w.end - w.start >= LATENCY_S * 1e9 / 2 for w in counted)
    return blocked / steps


@contextlib.contextmanager
def own_clock():
    """The step timeline's stamps in `own_time` (this thread's time less its waits in the run
    queue), where they are `time.perf_counter_ns`: on a loaded machine a sleeping wait is
    woken late and a hook preempted, and wall-clock stamps counted both as exposed time
    (5 latencies instead of 2 with a 4-rank job beside it, 2026-11-23)."""
    import fsdp_engine._profile as profile_mod
    import fsdp_engine._timeline as timeline_mod

    def now() -> int:
        return int(own_time() * 1e9)

    real = timeline_mod._now, profile_mod._now
    timeline_mod._now = profile_mod._now = now
    try:
        yield
    finally:
        timeline_mod._now, profile_mod._now = real


class ExposedComm(_Gate):
    """Overlap: waits per training step that the step timeline shows blocked (`exposed_waits`),
    for 8 blocks and a head whose collectives each take a fixed 5 ms (`latency_backend`),
    world size 2 simulated in process. With every collective issued a unit ahead, one: the
    root's forward all-gather, which nothing runs before. A prefetch lost, or a
    reduce-scatter waited for as soon as it is issued, adds one per unit, a rise of 100% or
    more. A count, so load does not move it: the blocks' compute (~10 ms each) is twice the
    latency even unloaded, and the stamps leave out time spent preempted. Measured
    2026-11-23: 1.0 (9.0 before the root's all-gather stopped holding a limiter ticket
    through forward, Note [tickets of units that stay] in fsdp_engine)."""

    def track_exposed_waits_per_step(self):
        return exposed_waits(1 if SMOKE else 3)

    track_exposed_waits_per_step.unit = "waits"
