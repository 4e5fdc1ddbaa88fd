"""Starting the ranks of ``snapmla bench`` and bringing their measurements to rank 0.

Three ways in, one code path (:func:`_rank_body`) once a rank knows who it is:
- ``torchrun`` (env ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set, also multi-node): this process
  is one rank; ``env://`` rendezvous; only rank 0 gets the report back.
- ``--dp N --tp M`` with ``N * M > 1`` and no torchrun: the command spawns ``N * M`` processes
  (torch.multiprocessing, ``spawn``), one per local GPU, rendezvous on a free local TCP port;
  rank 0 hands the gathered measurements to the parent through a file in a temporary folder.
- one rank: in this process, no torch.distributed.

Backends: NCCL for GPU ranks, gloo for the CPU fake workload. Every rank sets
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in its environment before the
process group starts (NVLink multicast must stay off on the lab's machines). Every check that can
fail (GPU present, enough GPUs, torchrun's world size) runs before any rank starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..cache.atomic import write_text_atomic
from ..errors import NoGpuError, SnapmlaError
from ..runtime.gpu_arch import kernels_gpu_problem, refuse_if
from ..sizes import counted
from .plan import BenchPlan
from .results import BenchReport, Measurement
from .timing import CLOCKS, STEADY
from .worker import Comm, Gathered, LocalComm, Progress, StepRunner, run_rank

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
PG_TIMEOUT = timedelta(minutes=10)  # GPU ranks: compiles, cache fills and long steps
FAKE_PG_TIMEOUT = timedelta(seconds=60)  # CPU fake: a hang fails CI in a minute
RUNNER_KINDS = ("gpu", "cpu-fake")
# the CPU runner (CI) keeps its runs short and eager, whatever --steps / --warmup / --graphs say
FAKE_MAX_STEPS, FAKE_MAX_WARMUP = 5, 1
BF16_IMPLS = ("auto", "snapmla", "flashmla")
MAX_PORT = 65535


@dataclass(frozen=True)
class RunnerSpec:
    """How each rank builds its step runner (picklable: sent to spawned ranks)."""

    kind: str = "gpu"  # "gpu": the real kernels; "cpu-fake": tiny torch matmuls on the CPU
    steps: int = 20  # timed steps (median)
    warmup: int = 3
    graphs: bool = True  # capture one step in a CUDA graph and time replays
    bf16_impl: str = "auto"  # BF16 baseline: FlashMLA when importable (auto), or forced
    roofline: bool = True  # measure the GPU's ceilings for the SPEC section 7 roofline
    clocks: str = STEADY.name  # the GPU clock state the steps and ceilings are timed in (timing.Clocks)

    def __post_init__(self) -> None:
        if self.kind not in RUNNER_KINDS:
            raise SnapmlaError(f"runner: {self.kind!r} is not one of {', '.join(RUNNER_KINDS)}")
        if self.kind == "cpu-fake":  # what runs is what the report's meta.runner records
            object.__setattr__(self, "steps", min(self.steps, FAKE_MAX_STEPS))
            object.__setattr__(self, "warmup", min(self.warmup, FAKE_MAX_WARMUP))
            object.__setattr__(self, "graphs", False)
        if self.steps < 1:
            raise SnapmlaError(f"--steps: expected at least 1, got {self.steps}")
        if self.warmup < 0:
            raise SnapmlaError(f"--warmup: expected 0 or more, got {self.warmup}")
        if self.bf16_impl not in BF16_IMPLS:
            raise SnapmlaError(f"--bf16-impl: {self.bf16_impl!r} is not one of {', '.join(BF16_IMPLS)}")
        if self.clocks not in CLOCKS:
            raise SnapmlaError(f"--clocks: {self.clocks!r} is not one of {', '.join(CLOCKS)}")

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "gpu" else "gloo"

    def build(self, local_rank: int) -> StepRunner:
        if self.kind == "gpu":
            from .gpu_step import GpuStepRunner

            return GpuStepRunner(local_rank, self.steps, self.warmup, self.graphs,
                                 self.bf16_impl, self.roofline, self.clocks)
        from .fake_step import CpuFakeRunner

        return CpuFakeRunner(steps=self.steps, warmup=self.warmup)


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world: int
    local_rank: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's place when torchrun (or any launcher setting ``RANK`` and ``WORLD_SIZE``)
    started it; None otherwise."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise SnapmlaError(
            "RANK / WORLD_SIZE / LOCAL_RANK are set but not integers "
            f"({env.get('RANK')!r}, {env.get('WORLD_SIZE')!r}, {env.get('LOCAL_RANK')!r})"
        ) from None
    if not 0 <= rank < world or local < 0:
        raise SnapmlaError(f"RANK {rank} / LOCAL_RANK {local} do not fit WORLD_SIZE {world}")
    if world > 1:
        _check_rendezvous(env)
    return TorchrunEnv(rank, world, local)


def _check_rendezvous(env: Mapping[str, str]) -> None:
    """The ``env://`` rendezvous of more than one rank needs rank 0's address and port; without
    them torch.distributed fails deep inside its store with a traceback, so say so first."""
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not env.get(key)]
    if missing:
        raise SnapmlaError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: the ranks meet at rank 0's "
            "MASTER_ADDR:MASTER_PORT (start the ranks with torchrun, or unset RANK and WORLD_SIZE "
            "to run without a launcher)"
        )
    port = env["MASTER_PORT"]
    if not (port.isascii() and port.isdigit() and len(port) <= len(str(MAX_PORT))
            and 1 <= int(port) <= MAX_PORT):
        raise SnapmlaError(f"MASTER_PORT: expected a TCP port 1..{MAX_PORT}, got {port!r}")


# processes the CPU runner (--cpu-fake, CI) spawns at most: one per rank, on one machine
MAX_CPU_RANKS = 64


def preflight(
    plan: BenchPlan,
    spec: RunnerSpec,
    env: TorchrunEnv | None,
    *,
    cuda_available: bool | None = None,
    device_count: int | None = None,
    have_cupy: bool | None = None,
    gpu_problem: Callable[[int], str | None] = kernels_gpu_problem,
) -> None:
    """Every check that does not need a started rank; the keyword arguments stand in for the
    machine in tests (``gpu_problem(i)``: why GPU ``i`` cannot run the kernels, or None)."""
    layouts = ", ".join(layout.name for layout in plan.layouts)
    if env is not None and env.world != plan.world:
        raise SnapmlaError(
            f"torchrun started {env.world} processes but {layouts} needs {plan.world} "
            f"(one per GPU): use --nproc-per-node/--nnodes with {plan.world} in total"
        )
    if spec.kind != "gpu":
        if env is None and plan.world > MAX_CPU_RANKS:  # each rank is a process of this machine
            raise SnapmlaError(f"{layouts}: {plan.world} CPU ranks, expected at most {MAX_CPU_RANKS} "
                               "(the CPU runner spawns one process per rank)")
        return
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise NoGpuError("snapmla bench needs CUDA GPUs: torch sees none (torch.cuda.is_available() is False)")
    if have_cupy is None:
        have_cupy = importlib.util.find_spec("cupy") is not None
    if not have_cupy:
        raise NoGpuError("CuPy is not installed; the CUDA kernels need it (pip install 'snapmla[cuda]')")
    count = torch.cuda.device_count() if device_count is None else device_count
    if env is None and plan.world > count:
        raise SnapmlaError(
            f"{layouts} runs {plan.world} ranks, one per GPU, but this machine has {counted(count, 'GPU')} "
            "(multi-node: start it with torchrun)"
        )
    if env is not None and env.local_rank >= count:
        raise SnapmlaError(f"LOCAL_RANK {env.local_rank} has no GPU: this node has {count}")
    for index in (range(plan.world) if env is None else (env.local_rank,)):
        refuse_if(gpu_problem(index))


class DistComm:
    """torch.distributed between the ranks (NCCL on GPUs, gloo on the CPU)."""

    def __init__(self, rank: int, world: int, device_index: int | None) -> None:
        self.rank, self.world, self.device_index = rank, world, device_index

    @classmethod
    def start(cls, backend: str, init_method: str, rank: int, world: int,
              device_index: int | None) -> DistComm:
        import torch.distributed as dist

        os.environ.update(MULTICAST_OFF)
        if device_index is not None:
            torch.cuda.set_device(device_index)
        timeout = PG_TIMEOUT if backend == "nccl" else FAKE_PG_TIMEOUT
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout)
        return cls(rank, world, device_index)

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.device_index is not None:
            dist.barrier(device_ids=[self.device_index])
        else:
            dist.barrier()

    def all_gather(self, obj: Gathered) -> list[Gathered]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world  # filled with every rank's object
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_body(plan: BenchPlan, spec: RunnerSpec, local_rank: int, comm: Comm,
               progress: Progress | None, launcher: str) -> BenchReport | None:
    """Everything a rank does once it knows its place; the report on rank 0, None elsewhere."""
    runner = spec.build(local_rank)
    try:
        facts = dict(runner.setup(), rank=comm.rank, local_rank=local_rank, host=socket.gethostname())
        local = run_rank(plan, comm.rank, runner, comm, progress if comm.rank == 0 else None)
    finally:
        runner.close()
    parts = comm.all_gather((local, facts))
    if comm.rank != 0:
        return None
    measurements = [m for part, _ in parts for m in part]
    meta = {
        "launcher": launcher,
        "backend": spec.backend if comm.world > 1 else "none",
        "world": comm.world,
        "torch": torch.__version__,
        "runner": asdict(spec),
        "ranks": [rank_facts for _, rank_facts in parts],
        "env": {key: os.environ.get(key) for key in MULTICAST_OFF},
    }
    return BenchReport(plan, measurements, meta)


def run_benchmark(plan: BenchPlan, spec: RunnerSpec, progress: Progress | None = None,
                  environ: Mapping[str, str] | None = None) -> BenchReport | None:
    """Run the plan on all its ranks; the report in the process that holds rank 0's results
    (None on the other torchrun ranks). Raises :class:`SnapmlaError` before anything starts
    when the machine cannot run the plan, and with the first failing rank's one-line message
    when a rank fails."""
    env = torchrun_env(environ)
    preflight(plan, spec, env)
    if env is not None and env.world == 1:
        # a launcher's single rank has nobody to meet: no process group
        with _rank_failure(env.rank):
            return _rank_body(plan, spec, env.local_rank, LocalComm(), progress, "torchrun")
    if env is not None:
        device = env.local_rank if spec.kind == "gpu" else None
        with _rank_failure(env.rank):
            comm = DistComm.start(spec.backend, "env://", env.rank, env.world, device)
            try:
                return _rank_body(plan, spec, env.local_rank, comm, progress, "torchrun")
            finally:
                comm.close()
    if plan.world == 1:
        with _rank_failure(0):
            return _rank_body(plan, spec, 0, LocalComm(), progress, "inline")
    return _run_spawned(plan, spec, progress)


@contextlib.contextmanager
def _rank_failure(rank: int) -> Iterator[None]:
    """A rank run in this process fails in the one line a spawned rank's failure gives
    (``rank R: OutOfMemoryError: ...``): torch's RuntimeErrors (a GPU out of memory, a rendezvous
    that timed out) and OS errors are the machine's answer to the plan, not snapmla bugs, which
    keep their internal-error report."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        raise SnapmlaError(f"rank {rank}: {_one_line(exc)}") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULT = "result.json"


def _spawn_entry(index: int, plan: BenchPlan, spec: RunnerSpec, init_method: str, folder: str,
                 progress: Progress | None) -> None:
    try:
        device = index if spec.kind == "gpu" else None
        comm = DistComm.start(spec.backend, init_method, index, plan.world, device)
        try:
            report = _rank_body(plan, spec, index, comm, progress, "spawn")
        finally:
            comm.close()
        if report is not None:
            payload = {"measurements": [asdict(m) for m in report.measurements], "meta": report.meta}
            write_text_atomic(Path(folder) / _RESULT, json.dumps(payload))
    except BaseException as exc:
        (Path(folder) / f"error-{index}.txt").write_text(f"{time.time():.6f}\n{_one_line(exc)}")
        raise


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, SnapmlaError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _first_failure(folder: Path, exc: BaseException) -> str:
    """The rank that failed first (the others usually fail because it left)."""
    failures = []
    for path in folder.glob("error-*.txt"):
        stamp, _, message = path.read_text().partition("\n")
        failures.append((float(stamp), int(path.stem.split("-")[1]), message))
    if not failures:
        return f"a bench rank died: {_one_line(exc)}"
    _, rank, message = min(failures)
    return f"rank {rank}: {message}"


def _run_spawned(plan: BenchPlan, spec: RunnerSpec, progress: Progress | None) -> BenchReport:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="snapmla-bench-") as tmp:
        folder = Path(tmp)
        try:
            mp.start_processes(_spawn_entry, args=(plan, spec, init_method, tmp, progress),
                               nprocs=plan.world, join=True, start_method="spawn")
        except ProcessException as exc:  # a rank raised, or died
            raise SnapmlaError(_first_failure(folder, exc)) from None
        result = folder / _RESULT
        if not result.exists():
            raise SnapmlaError("the bench ranks finished without results from rank 0")
        data = json.loads(result.read_text())
    measurements = [Measurement.from_dict(d) for d in data["measurements"]]
    return BenchReport(plan, measurements, data["meta"])
