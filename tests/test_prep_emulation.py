"""kernels/prep.cu run on the CPU (no GPU): the kernel source compiled as host C++ against a
small CUDA stand-in (tests/emu/), each warp as 32 threads, and its output bytes compared with
the reference on the GPU tests' corner-case data.

Why: the kernels' lane maps, shuffles, the request search and the store maps can then be
checked bit for bit on any machine with g++ and the CUDA headers, before a GPU run. What it does
not check: the PTX wrappers (tests/emu/ptx_shim.cuh stands in for common/ptx.cuh), timing, and
anything about memory ordering between warps. Every global access is bounds- and
alignment-checked against the buffers each case registers. Skipped without g++ (C++20) or
without CUDA headers that compile on the host (``crt/host_defines.h``, from a CUDA toolkit).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from snapmla_cli.cache.layout import quantize_tokens
from snapmla_cli.numerics.formats import D_QK, FP8_TOKEN_BYTES, PAGE_SIZE
from snapmla_cli.numerics.quant import quantize_rows
from snapmla_cli.ops import prep
from snapmla_cli.runtime.registry import PREP_DEFINES

ROOT = Path(__file__).resolve().parents[1]
EMU = Path(__file__).resolve().parent / "emu"


def _gpu_test_helpers():
    """tests/gpu/test_prep.py's data generators (corner rows, paged problems, poisoned caches)."""
    path = EMU.parent / "gpu" / "test_prep.py"
    spec = importlib.util.spec_from_file_location("_prep_gpu_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _gpu_test_helpers()


def _cuda_include() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for base in filter(None, candidates):
        inc = Path(base) / "include"
        if (inc / "crt" / "host_defines.h").is_file() and (inc / "cuda_fp8.h").is_file():
            return inc
    return None


def _build(tmp: Path, defines: dict[str, int]) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    include = _cuda_include()
    if compiler is None or include is None:
        pytest.skip("needs g++ and a CUDA toolkit's headers (crt/host_defines.h) to build on host")
    src = tmp / "src"
    (src / "common").mkdir(parents=True)
    shutil.copy(ROOT / "kernels" / "prep.cu", src)
    for header in ("types.cuh", "convert.cuh", "quant.cuh"):
        shutil.copy(ROOT / "kernels" / "common" / header, src / "common")
    shutil.copy(EMU / "ptx_shim.cuh", src / "common" / "ptx.cuh")
    includes = [f"-I{src}", f"-I{EMU}", f"-I{include}"]
    if (include / "cccl").is_dir():
        includes.append(f"-I{include / 'cccl'}")
    lib = tmp / "prep_emu.so"
    cmd = [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", *includes]
    cmd += [f"-D{k}={v}" for k, v in defines.items()]
    cmd += ["-o", str(lib), str(EMU / "harness.cpp")]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode:
        # skip only when the compiler itself lacks C++20 <barrier> (a probe, not the words
        # "C++20" or "barrier" in the log: emu.h's warps are std::barriers, so a real error in
        # prep.cu can name them, and a C++20 deprecation warning can sit beside any error)
        probe = tmp / "probe.cpp"
        probe.write_text("#include <barrier>\nstd::barrier<> b{1};\nint main() { b.arrive_and_wait(); }\n")
        lacks = subprocess.run([compiler, "-std=c++20", "-pthread", "-fsyntax-only", str(probe)],
                               check=False, capture_output=True, text=True)
        if lacks.returncode:
            pytest.skip(f"host compiler lacks C++20 <barrier>: {lacks.stderr.splitlines()[:1]}")
        raise AssertionError(f"host build of prep.cu failed:\n{done.stderr[-4000:]}")
    return ctypes.CDLL(str(lib))


VARIANTS = {
    "default": dict(PREP_DEFINES),
    "content-map-1": {**PREP_DEFINES, "PREP_CONTENT_MAP": 1},
    "4x1": {**PREP_DEFINES, "PREP_WARPS_PER_CTA": 4, "PREP_ROWS_PER_WARP": 1},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def emu(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Emu:
    return Emu(_build(tmp_path_factory.mktemp(request.param), VARIANTS[request.param]))


class Emu:
    """Registers buffers, launches a kernel over the grid the ops would use, checks accesses."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.per_cta = lib.emu_rows_per_cta()

    def grid(self, rows: int) -> ctypes.c_int:
        return ctypes.c_int(max(1, -(-rows // self.per_cta)))

    def run(self, fn: str, reads: list[torch.Tensor], writes: list[torch.Tensor], *args) -> None:
        self.lib.emu_clear_ranges()
        for t, writable in [(t, 0) for t in reads] + [(t, 1) for t in writes]:
            if t.numel():
                n = t.numel() * t.element_size()
                self.lib.emu_add_range(ctypes.c_size_t(t.data_ptr()), ctypes.c_size_t(n), writable)
        getattr(self.lib, fn)(*args)
        assert self.lib.emu_error_count() == 0, "out-of-bounds or misaligned access (see stderr)"


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


I64 = ctypes.c_int64


def same_bytes(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    H.assert_bytes_equal(name, got, ref)


@pytest.mark.parametrize("rows", [1, 3, 37, 300])
def test_quantize_q(emu: Emu, rows: int) -> None:
    q = H.wide_rows(rows, seed=rows)
    content = torch.full((rows, 512), 0xAB, dtype=torch.uint8)
    scale = torch.full((rows,), 7.0)
    rope = torch.full((rows, 64), 3.0, dtype=torch.bfloat16)
    emu.run(
        "emu_quantize_q", [q], [content, scale, rope],
        emu.grid(rows), ptr(q), ptr(content), ptr(scale), ptr(rope), I64(rows),
    )  # fmt: skip
    ref = quantize_rows(q)
    same_bytes("content", content, ref.content)
    same_bytes("scale", scale, ref.scale)
    same_bytes("rope", rope, ref.rope)


@pytest.mark.parametrize("n", [1, 100, 300])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_append_kv(emu: Emu, n: int, slot_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    kv = H.wide_rows(n, seed=n + 1)
    blocks = (n + 2 * PAGE_SIZE - 1) // PAGE_SIZE + 2
    num_slots = blocks * PAGE_SIZE
    slots = torch.randperm(num_slots, generator=g)[:n].to(slot_dtype)
    if n > 1:
        slots[:: max(2, n // 50)] = -1
        slots[1] = num_slots
        slots[-1] = -12345
    if n > 10 and slot_dtype == torch.int64:
        slots[5] = 2**40
    ref = H.poisoned_cache(blocks)
    H.reference_append(kv, slots, ref)
    got = H.poisoned_cache(blocks)
    emu.run(
        "emu_append_kv", [kv, slots], [got],
        emu.grid(n), ctypes.c_int(int(slot_dtype == torch.int64)), ptr(kv), ptr(slots), I64(n),
        ptr(got), I64(num_slots),
    )  # fmt: skip
    same_bytes("cache", got, ref)


@pytest.mark.parametrize(
    "seqlens",
    [[1], [70, 0, 1, 128, 5], [0, 0, 33], [3, 0, 0, 70, 0, 1] * 12, [1, 0] * 600],
    ids=["1", "5-requests", "leading-empty", "72-requests", "1200-requests"],
)
def test_fetch_dequant_paged(emu: Emu, seqlens: list[int]) -> None:
    layout, _, cache = H.paged_problem(seqlens, seed=len(seqlens))
    table = layout.block_table.clone()
    total = sum(seqlens) + 70
    # the CPU path refuses a garbage entry, so the reference reads the good table; the kernel
    # (unchecked) reads the garbage page as zeros, never out of bounds
    ref = prep.fetch_dequant(cache, layout.block_table, layout.cache_seqlens, total_tokens=total)
    if table.shape[1] > 1 and seqlens[0] > PAGE_SIZE:
        table[0, 1] = cache.shape[0] + 1
        ref[PAGE_SIZE : min(2 * PAGE_SIZE, seqlens[0])] = 0
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(layout.cache_seqlens.clamp(min=0), 0)
    out = torch.full((total, D_QK), 5.0, dtype=torch.bfloat16)
    emu.run(
        "emu_fetch_paged", [cache, table, cu], [out],
        emu.grid(total), ptr(cache), I64(cache.shape[0] * PAGE_SIZE), ptr(table),
        ctypes.c_int(table.shape[1]), ptr(cu), ctypes.c_int(len(seqlens)), ptr(out), I64(total),
    )  # fmt: skip
    same_bytes("paged", out, ref)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_fetch_dequant_slots_and_soa(emu: Emu, slot_dtype: torch.dtype) -> None:
    n_tok = 400
    kv = H.wide_rows(n_tok, seed=21)
    blocks = (n_tok + PAGE_SIZE - 1) // PAGE_SIZE
    cache = H.poisoned_cache(blocks)
    cache.view(-1, FP8_TOKEN_BYTES)[:n_tok] = quantize_tokens(kv)
    g = torch.Generator().manual_seed(1)
    slots = torch.randint(0, n_tok, (n_tok,), generator=g).to(slot_dtype)
    slots[::37] = -1
    slots[1] = blocks * PAGE_SIZE
    is64 = ctypes.c_int(int(slot_dtype == torch.int64))
    out = torch.full((n_tok, D_QK), 5.0, dtype=torch.bfloat16)
    emu.run(
        "emu_fetch_slots", [cache, slots], [out],
        emu.grid(n_tok), is64, ptr(cache), I64(blocks * PAGE_SIZE), ptr(slots), I64(n_tok),
        ptr(out),
    )  # fmt: skip
    same_bytes("slots", out, prep.fetch_dequant_slots(cache, slots))

    rows = quantize_rows(kv)
    content = rows.content.view(torch.uint8).contiguous()
    soa_slots = torch.randint(-3, n_tok + 3, (500,), generator=g).to(slot_dtype)
    out = torch.full((500, D_QK), 5.0, dtype=torch.bfloat16)
    emu.run(
        "emu_fetch_soa", [content, rows.scale, rows.rope, soa_slots], [out],
        emu.grid(500), is64, ptr(content), ptr(rows.scale), ptr(rows.rope), I64(n_tok),
        ptr(soa_slots), I64(500), ptr(out),
    )  # fmt: skip
    same_bytes("soa", out, prep.fetch_dequant_soa(content, rows.scale, rows.rope, soa_slots))
