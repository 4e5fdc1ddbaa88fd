"""Every registered kernel compiles with NVRTC (no GPU needed) and keeps everything in registers;
the compile cache hits and misses when it should; compile errors name the file.

Runs in CI on machines without a GPU: NVRTC, the CUDA headers and cuobjdump come from pip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from snapmla_cli.errors import NoGpuError, SnapmlaError
from snapmla_cli.numerics import formats
from snapmla_cli.ops.schedule import SplitPolicy
from snapmla_cli.runtime import kernel_cache, nvrtc
from snapmla_cli.runtime.gpu_arch import device_arch
from snapmla_cli.runtime.launch import Kernel, f32, i32, i64, launch
from snapmla_cli.runtime.ptxas import parse_ptxas_log
from snapmla_cli.runtime.registry import (
    KERNEL_SOURCES,
    PREP_DEFINES,
    PREP_KERNELS,
    PREP_SOURCE,
    iter_variants,
    unregistered_sources,
    variant,
)

try:
    import cupy  # noqa: F401

    HAVE_NVRTC = True
except ImportError:
    HAVE_NVRTC = False
needs_nvrtc = pytest.mark.skipif(
    not HAVE_NVRTC, reason="NVRTC comes with CuPy (pip install 'snapmla[cuda]')"
)

REPO_KERNELS = Path(__file__).resolve().parents[1] / "kernels"
_LDG128 = re.compile(r"\bLDG\.E(?:\.[A-Z0-9_]+)*\.128\b")


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets an empty disk cache and an empty in-process cache."""
    folder = tmp_path / "kcache"
    monkeypatch.setenv(kernel_cache.CACHE_DIR_ENV, str(folder))
    nvrtc.clear_memory_cache()
    yield folder
    nvrtc.clear_memory_cache()


@pytest.fixture(scope="module")
def compiled_variants(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, int, str], nvrtc.CompiledModule]:
    """Compile every registered variant once for the module (its own cache folder)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(kernel_cache.CACHE_DIR_ENV, str(tmp_path_factory.mktemp("variants")))
    try:
        out = {}
        for source, var, arch in iter_variants():
            index = KERNEL_SOURCES[source].index(var)
            out[(source, index, arch)] = nvrtc.compile_module(source, var.defines, arch)
        return out
    finally:
        mp.undo()


def _variant_ids() -> list[tuple[str, int, str]]:
    return [(s, KERNEL_SOURCES[s].index(v), a) for s, v, a in iter_variants()]


# ------------------------------------------------------------------ registered kernels


@needs_nvrtc
@pytest.mark.parametrize("vid", _variant_ids(), ids=lambda v: f"{v[0]}-v{v[1]}-{v[2]}")
def test_variant_compiles_without_spills(vid, compiled_variants) -> None:
    source, index, arch = vid
    module = compiled_variants[vid]
    var = KERNEL_SOURCES[source][index]
    assert module.cubin[:4] == b"\x7fELF"
    for name in var.kernels:
        res = module.kernel(name)
        assert res.is_entry and res.arch == arch, res
        assert res.registers > 0, res
    for res in module.resources.values():  # entries and any non-inlined callee
        assert not res.spills, f"{source} {arch} {var.defines}: spills: {res.summary()}"
        assert res.stack_frame_bytes == 0, f"{source} {arch}: stack frame: {res.summary()}"
        assert res.local_bytes == 0, f"{source} {arch}: local memory: {res.summary()}"


def test_prep_is_registered_for_sm90a_and_sm89() -> None:
    archs = {a for s, _, a in iter_variants() if s == PREP_SOURCE}
    assert {"sm_90a", "sm_89"} <= archs
    assert any(dict(v.defines) == PREP_DEFINES for v in KERNEL_SOURCES[PREP_SOURCE])


# diagnostic kernels (scripts/racecheck_handover.py, scripts/wgmma_rate.py,
# scripts/cluster_handover.py): not part of the runtime's registry, each compiled and checked by
# its own test in this module
DIAGNOSTIC_SOURCES = {"diag/handover_race.cu", "diag/wgmma_rate.cu", "diag/cluster_handover.cu"}


def test_every_kernel_source_is_registered() -> None:
    """Each .cu file under kernels/ is compiled and checked here: through a KERNEL_SOURCES entry,
    or (a diagnostic) by its own test."""
    assert set(unregistered_sources()) == DIAGNOSTIC_SOURCES
    assert not DIAGNOSTIC_SOURCES & set(KERNEL_SOURCES)


def test_every_combine_width_the_ops_launch_is_registered() -> None:
    from snapmla_cli.ops.split_fold import combine_rows_per_cta

    registered = {int(v.defines["COMBINE_ROWS"]) for v in KERNEL_SOURCES["combine.cu"]}
    assert {combine_rows_per_cta(rows) for rows in (1, 1024, 1025, 2**20)} == registered == {1, 4}


def test_registry_entry_is_one_line() -> None:
    v = variant("k1", "k2", archs=("sm_90a",), TILE=64)
    assert v.kernels == ("k1", "k2") and dict(v.defines) == {"TILE": 64}


def _cuobjdump() -> str | None:
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_binary_utility("cuobjdump")
    except Exception:  # noqa: BLE001
        found = None
    return found or shutil.which("cuobjdump")


def _sass_by_function(sass: str) -> dict[str, str]:
    parts = re.split(r"\n\s*Function : (\S+)\n", "\n" + sass)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
def test_prep_sass_uses_128bit_global_loads(arch: str, tmp_path: Path) -> None:
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    module = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, arch)
    cubin = tmp_path / "prep.cubin"
    cubin.write_bytes(module.cubin)
    sass = subprocess.run(
        [tool, "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    functions = _sass_by_function(sass)
    for name in PREP_KERNELS:
        assert name in functions, f"{name} missing from SASS ({list(functions)})"
        body = functions[name]
        assert _LDG128.search(body), f"{name} [{arch}]: no 128-bit global load in SASS"
        assert "LDL" not in body and "STL" not in body, f"{name} [{arch}]: local memory traffic"


def test_types_header_mirrors_formats() -> None:
    text = (REPO_KERNELS / "common" / "types.cuh").read_text()
    consts = dict(re.findall(r"constexpr\s+(?:int|float)\s+(\w+)\s*=\s*([^;]+);", text))
    for name in (
        "D_CONTENT",
        "D_ROPE",
        "D_QK",
        "D_V",
        "PAGE_SIZE",
        "P_BLOCK_TOKENS",
        "FP8_TOKEN_BYTES",
        "CONTENT_OFFSET",
        "SCALE_OFFSET",
        "PAD_OFFSET",
        "ROPE_OFFSET",
        "ROPE_BYTES",
    ):
        assert int(consts[name]) == getattr(formats, name), name
    assert float(consts["E4M3_MAX"].rstrip("f")) == formats.E4M3_MAX
    assert float.fromhex(consts["KV_SCALE_FLOOR"].rstrip("f")) == formats.KV_SCALE_FLOOR
    assert float.fromhex(consts["P_SCALE_FLOOR"].rstrip("f")) == formats.P_SCALE_FLOOR


# ------------------------------------------------------------------ the caches


@needs_nvrtc
def test_memory_cache_returns_same_module() -> None:
    a = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    b = nvrtc.compile_module(PREP_SOURCE, dict(reversed(list(PREP_DEFINES.items()))), "sm_90a")
    assert a is b and a.origin == "nvrtc"


@needs_nvrtc
def test_second_compile_hits_disk_cache(
    monkeypatch: pytest.MonkeyPatch, isolated_caches: Path
) -> None:
    first = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert list(isolated_caches.glob("*.cubin")) and list(isolated_caches.glob("*.json"))
    nvrtc.clear_memory_cache()

    def no_nvrtc(*args, **kwargs):
        raise AssertionError("NVRTC was called on a warm cache")

    monkeypatch.setattr(nvrtc, "_nvrtc_compile", no_nvrtc)
    second = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert second.origin == "disk"
    assert second.cubin == first.cubin and second.key == first.key
    assert second.resources == first.resources


def _damage_flip_a_byte(cubin: Path, meta: Path) -> None:
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x5A  # same size: only the content hash can tell
    cubin.write_bytes(bytes(data))


def _damage_meta_not_a_mapping(cubin: Path, meta: Path) -> None:
    meta.write_text("[]")


def _damage_names_not_a_mapping(cubin: Path, meta: Path) -> None:
    fields = json.loads(meta.read_text())
    fields["lowered_names"] = list(fields["lowered_names"].items())
    meta.write_text(json.dumps(fields))


def _damage_a_name_not_a_string(cubin: Path, meta: Path) -> None:
    fields = json.loads(meta.read_text())
    fields["lowered_names"] = {name: 7 for name in fields["lowered_names"]} or {"k": 7}
    meta.write_text(json.dumps(fields))


def _damage_meta_nested_too_deep(cubin: Path, meta: Path) -> None:
    meta.write_text("[" * 100_000 + "]" * 100_000)  # (json's RecursionError escaped the load)


@needs_nvrtc
@pytest.mark.parametrize("damage", [_damage_flip_a_byte, _damage_meta_not_a_mapping, _damage_names_not_a_mapping,
                                    _damage_a_name_not_a_string, _damage_meta_nested_too_deep])
def test_a_damaged_disk_entry_is_a_miss(damage: Callable[[Path, Path], None], isolated_caches: Path) -> None:
    """A cache entry damaged on disk is compiled again (and rewritten), never loaded: a cubin
    of the right size with one byte changed would otherwise reach the driver's module load."""
    first = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    cubin, meta = isolated_caches / f"{first.key}.cubin", isolated_caches / f"{first.key}.json"
    damage(cubin, meta)
    assert kernel_cache.load(first.key) is None
    nvrtc.clear_memory_cache()
    again = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert again.origin == "nvrtc" and again.cubin == first.cubin
    restored = kernel_cache.load(first.key)
    assert restored is not None and restored.cubin == first.cubin


def _copy_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "kernels"
    shutil.copytree(REPO_KERNELS, folder)
    monkeypatch.setenv(nvrtc.KERNEL_DIR_ENV, str(folder))
    return folder


@needs_nvrtc
def test_changed_header_misses_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = _copy_kernels(tmp_path, monkeypatch)
    calls: list[str] = []
    real = nvrtc._nvrtc_compile

    def counting(text, name, options, names, arch):
        calls.append(name)
        return real(text, name, options, names, arch)

    monkeypatch.setattr(nvrtc, "_nvrtc_compile", counting)
    first = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    nvrtc.clear_memory_cache()
    nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    program = str(folder / PREP_SOURCE)  # (the program's name: the source's absolute path)
    assert calls == [program]  # warm: no second NVRTC call
    header = folder / "common" / "types.cuh"
    header.write_text(header.read_text() + "\n// touched\n")
    nvrtc.clear_memory_cache()
    second = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert calls == [program, program]  # an edited header recompiles
    assert second.key != first.key and second.origin == "nvrtc"


@needs_nvrtc
def test_sources_edited_during_a_compile_are_never_cached_under_the_old_key(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path,
                                                                             isolated_caches: Path) -> None:
    """The key is made from the tree before NVRTC reads it: a checkout in between (while another
    compile held the lock) stored the new sources' cubin under the old sources' key, which a
    later run on the old sources then loaded as a valid hit."""
    folder = _copy_kernels(tmp_path, monkeypatch)
    real = nvrtc._nvrtc_compile

    def edit_then_compile(text, name, options, names, arch):
        header = folder / "common" / "types.cuh"
        header.write_text(header.read_text() + "\n// edited during the compile\n")
        return real(text, name, options, names, arch)

    monkeypatch.setattr(nvrtc, "_nvrtc_compile", edit_then_compile)
    module = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert module.origin == "nvrtc"
    assert kernel_cache.load(module.key) is None  # not on disk under the old tree's key
    monkeypatch.setattr(nvrtc, "_nvrtc_compile", real)
    again = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert again.key != module.key and again.origin == "nvrtc"  # nor in memory


@needs_nvrtc
def test_defines_change_the_key() -> None:
    a = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    b = nvrtc.compile_module(PREP_SOURCE, {**PREP_DEFINES, "PREP_ROWS_PER_WARP": 1}, "sm_90a")
    assert a.key != b.key
    assert ("PREP_ROWS_PER_WARP", "1") in b.defines


@needs_nvrtc
def test_unwritable_cache_is_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(kernel_cache.CACHE_DIR_ENV, str(blocker / "sub"))
    module = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_89")
    assert module.origin == "nvrtc" and module.cubin


@needs_nvrtc
def test_a_cache_folder_that_cannot_be_searched_is_not_an_error(monkeypatch: pytest.MonkeyPatch,
                                                                isolated_caches: Path) -> None:
    """A folder without search permission made the atomic write's look at the path a plain
    SnapmlaError ('cannot check it: Permission denied'), not an OSError: every compile failed.
    (Root searches any folder, so the stat of the paths in it is refused here.)"""
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if Path(path).parent == isolated_caches:
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    module = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert module.origin == "nvrtc" and module.cubin and not list(isolated_caches.glob("*"))


@needs_nvrtc
def test_headers_in_the_working_folder_are_never_compiled_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             isolated_caches: Path) -> None:
    """NVRTC looks for a quoted include next to the program's name first: with a bare name that
    was the working folder, whose stray common/types.cuh was compiled in and cached under the
    key of the real one."""
    decoy = tmp_path / "cwd"
    (decoy / "common").mkdir(parents=True)
    (decoy / "common" / "types.cuh").write_text("#error decoy header from the working folder\n")
    monkeypatch.chdir(decoy)
    module = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert module.origin == "nvrtc" and module.cubin


@needs_nvrtc
def test_the_cuda_headers_are_in_the_cache_key(monkeypatch: pytest.MonkeyPatch, isolated_caches: Path) -> None:
    """cudart's and CCCL's headers ship apart from NVRTC: an upgrade that keeps their folders and
    NVRTC's version must not load the cubins built against the old ones."""
    first = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    nvrtc.clear_memory_cache()
    monkeypatch.setattr(nvrtc, "header_stamp", lambda: "other-headers")
    second = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert second.key != first.key and second.origin == "nvrtc"


def test_the_header_stamp_follows_the_header_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cudart, cccl = tmp_path / "include", tmp_path / "include" / "cccl"
    (cccl / nvrtc.CCCL_VERSION_HEADER).parent.mkdir(parents=True)
    (cudart / "cuda_bf16.h").write_text("// bf16\n")
    version = cccl / nvrtc.CCCL_VERSION_HEADER
    version.write_text("#define CCCL_VERSION 3003005\n")
    monkeypatch.setattr(nvrtc, "header_dirs", lambda: (str(cudart), str(cccl)))
    stamps = []
    for edit in (None, lambda: (cudart / "cuda_bf16.h").write_text("// bf16, patched\n"),
                 lambda: version.write_text("#define CCCL_VERSION 3003006\n")):
        if edit is not None:
            edit()
        nvrtc.header_stamp.cache_clear()
        stamps.append(nvrtc.header_stamp())
    nvrtc.header_stamp.cache_clear()
    assert len(set(stamps)) == 3


# ------------------------------------------------------------------ errors


@needs_nvrtc
def test_syntax_error_names_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = _copy_kernels(tmp_path, monkeypatch)
    (folder / "broken.cu").write_text('extern "C" __global__ void k(int* x) { x[0] = ; }\n')
    with pytest.raises(SnapmlaError) as err:
        nvrtc.compile_module("broken.cu")
    message = str(err.value)
    first_line = message.splitlines()[0]
    assert "broken.cu" in first_line and "sm_90a" in first_line and "error" in first_line
    assert "broken.cu(1)" in message  # NVRTC's log, with the line number
    assert err.value.__cause__ is None and err.value.__suppress_context__


@needs_nvrtc
def test_missing_source_and_bad_arguments() -> None:
    with pytest.raises(SnapmlaError, match="nope.cu"):
        nvrtc.compile_module("nope.cu")
    with pytest.raises(SnapmlaError, match="macro name"):
        nvrtc.compile_module(PREP_SOURCE, {"BAD NAME": 1})
    with pytest.raises(SnapmlaError, match="arch"):
        nvrtc.compile_module(PREP_SOURCE, arch="hopper")


def test_defines_and_options_are_validated_and_canonical(tmp_path: Path) -> None:
    """No NVRTC needed: the defines' stable form, the option list and the arch check."""
    assert nvrtc.normalize_defines({"B": 1, "A": True, "C": "x.y-1"}) == (("A", "1"), ("B", "1"), ("C", "x.y-1"))
    assert nvrtc.normalize_defines(None) == () and nvrtc.normalize_defines({}) == ()
    for bad in ({"A": "x y"}, {"A": "1;rm"}, {"A": 1.5}, {"A B": 1}):
        with pytest.raises(SnapmlaError, match="defines: "):
            nvrtc.normalize_defines(bad)
    options = nvrtc.build_options("sm_89", (("A", "1"),), "00ff", tmp_path)
    assert options[0] == "-arch=sm_89" and f"-I{tmp_path}" in options and "-DA=1" in options
    assert options[-1] == "-DSNAPMLA_SRC_HASH=0x00ff"
    for arch in ("hopper", "sm_90x", "compute_90"):
        with pytest.raises(SnapmlaError, match="arch: expected something like 'sm_90a' or 'sm_89'"):
            nvrtc.build_options(arch, (), "00ff", tmp_path)


def test_the_cache_key_covers_the_name_expressions_and_the_source_hash(tmp_path: Path) -> None:
    options = nvrtc.build_options("sm_90a", (), "00ff", tmp_path)
    key = nvrtc._cache_key("prep.cu", "sm_90a", options, (), (12, 8), "h1")
    assert key != nvrtc._cache_key("prep.cu", "sm_90a", options, ("k<1>",), (12, 8), "h1")
    edited = nvrtc.build_options("sm_90a", (), "0100", tmp_path)
    assert key != nvrtc._cache_key("prep.cu", "sm_90a", edited, (), (12, 8), "h1")
    assert key != nvrtc._cache_key("prep.cu", "sm_90a", options, (), (12, 8), "h2")


def test_the_source_tree_hash_skips_hidden_files_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(nvrtc.KERNEL_DIR_ENV, raising=False)
    assert nvrtc.kernel_dir() == REPO_KERNELS
    (tmp_path / "a.cu").write_text("int a;")
    before = nvrtc.source_tree_hash(tmp_path)
    (tmp_path / ".a.cu.swp").write_text("editor state")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"x")
    assert nvrtc.source_tree_hash(tmp_path) == before
    (tmp_path / "a.cu").write_text("int a ;")
    assert nvrtc.source_tree_hash(tmp_path) != before


def test_the_product_hash_ignores_the_diagnostics_and_nothing_else(tmp_path: Path) -> None:
    """Tuning entries are stamped with the product sources' hash: a diagnostic kernel added or
    edited under diag/ leaves it (and every entry current), while the whole tree's hash, which
    keys the compile cache, changes; a header or kernel outside diag/ changes both."""
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "ptx.cuh").write_text("// helpers")
    (tmp_path / "decode.cu").write_text("int a;")
    product, whole = nvrtc.product_sources_hash(tmp_path), nvrtc.source_tree_hash(tmp_path)
    (tmp_path / nvrtc.DIAGNOSTIC_FOLDER).mkdir()
    (tmp_path / nvrtc.DIAGNOSTIC_FOLDER / "probe.cu").write_text("int probe;")
    assert nvrtc.product_sources_hash(tmp_path) == product
    assert nvrtc.source_tree_hash(tmp_path) != whole
    (tmp_path / "common" / "ptx.cuh").write_text("// helpers, edited")
    assert nvrtc.product_sources_hash(tmp_path) != product
    (tmp_path / "decode.cu").write_text("int a ;")
    assert nvrtc.product_sources_hash(tmp_path) != product


def test_missing_kernel_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(nvrtc.KERNEL_DIR_ENV, str(tmp_path / "absent"))
    with pytest.raises(SnapmlaError, match=nvrtc.KERNEL_DIR_ENV):
        nvrtc.compile_module(PREP_SOURCE)


# ------------------------------------------------------------------ launch helpers (no GPU)


def test_device_arch() -> None:
    assert device_arch((9, 0)) == "sm_90a"
    assert device_arch((8, 9)) == "sm_89"
    assert device_arch((8, 0)) == "sm_80"
    assert device_arch((12, 0)) == "sm_120"


def test_scalar_wrappers() -> None:
    import numpy as np

    assert isinstance(i32(5), np.int32) and isinstance(i64(2**40), np.int64)
    assert isinstance(f32(0.5), np.float32)
    with pytest.raises(SnapmlaError, match="^kernel argument 2147483648 does not fit a 32-bit int"):
        i32(2**31)
    assert i32(-(2**31)) == -(2**31) and i32(2**31 - 1) == 2**31 - 1  # both ends of a C int
    with pytest.raises(SnapmlaError, match="does not fit a 32-bit int"):
        i32(-(2**31) - 1)


def test_launch_rejects_bare_python_numbers() -> None:
    fake = Kernel(name="k", source="prep.cu", device_index=0, function=None, compiled=None)
    with pytest.raises(SnapmlaError, match="argument 1"):
        launch(fake, 1, 32, [None, 7])
    with pytest.raises(SnapmlaError, match="argument 0"):
        launch(fake, 1, 32, [1.5])


def test_get_kernel_without_gpu_raises_nogpu() -> None:
    import torch

    from snapmla_cli.runtime.launch import get_kernel

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(NoGpuError):
        get_kernel(PREP_SOURCE, "snapmla_quantize_q", PREP_DEFINES)


# ------------------------------------------------------------------ ptxas report parser


PTXAS_LOG = """\
ptxas info    : Overriding maximum register limit 256 for 'sp' with  24 of maxrregcount option
ptxas warning : Registers are spilled to local memory in function 'sp', 876 bytes spill stores, 1216 bytes spill loads
ptxas info    : 120 bytes gmem, 240 bytes cmem[4]
ptxas info    : Compiling entry function 'sp' for 'sm_89'
ptxas info    : Function properties for sp
ptxas         .     704 bytes stack frame, 876 bytes spill stores, 1216 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 704 bytes cumulative stack size, 364 bytes cmem[0]
ptxas info    : Compile time = 56.705 ms
ptxas info    : Compiling entry function '_Z2ktILi3EEvPf' for 'sm_90a'
ptxas info    : Function properties for _Z2ktILi3EEvPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 13.026 ms
ptxas info    : Function properties for _Z1fPfi
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_parse_ptxas_report() -> None:
    report = parse_ptxas_log(PTXAS_LOG)
    sp = report["sp"]
    assert sp.is_entry and sp.arch == "sm_89" and sp.registers == 24
    assert (sp.spill_store_bytes, sp.spill_load_bytes, sp.stack_frame_bytes) == (876, 1216, 704)
    assert sp.local_bytes == 704 and sp.const0_bytes == 364 and sp.spills and not sp.clean
    kt = report["_Z2ktILi3EEvPf"]
    assert kt.is_entry and kt.registers == 10 and kt.barriers == 1 and kt.shared_bytes == 1024
    assert kt.clean
    callee = report["_Z1fPfi"]
    assert not callee.is_entry and callee.stack_frame_bytes == 16 and not callee.clean
    assert list(report) == ["sp", "_Z2ktILi3EEvPf", "_Z1fPfi"]


PTXAS_EDGE_LOG = """\
ptxas info    : Compiling entry function 'a' for 'sm_90a'
ptxas info    : Function properties for a
ptxas         .     0 bytes stack frame, 8 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 64 bytes lmem, 16 bytes cumulative stack size, 400 bytes cmem[0], 8 bytes cmem[2]
ptxas warning : Registers are spilled to local memory in function 'a', 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Compiling entry function 'c' for 'sm_90a'
ptxas info    : Function properties for c
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 32 bytes lmem, 0 bytes smem
ptxas         .     5 bytes stack frame, 5 bytes spill stores, 5 bytes spill loads
ptxas info    : Used 99 registers
ptxas info    : Compiling entry function 'b' for 'sm_90a'
ptxas info    : Function properties for b
ptxas         .     0 bytes stack frame, 8 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers
"""


def test_parse_ptxas_report_edge_cases() -> None:
    """A spill warning after the stack line keeps the larger counts; the largest local size of a
    Used line counts, and only cmem[0] is the parameter bank; stores alone are spills and local
    memory alone is not clean; a stack or Used line with no function announced is ignored."""
    report = parse_ptxas_log(PTXAS_EDGE_LOG)
    a, b, c = report["a"], report["b"], report["c"]
    assert (a.spill_store_bytes, a.spill_load_bytes, a.registers, a.barriers) == (8, 12, 255, 1)
    assert (a.local_bytes, a.const0_bytes) == (64, 400) and a.spills and not a.clean
    assert (b.spill_store_bytes, b.spill_load_bytes) == (8, 0) and b.spills and not b.clean
    assert c.registers == 32 and c.local_bytes == 32 and c.stack_frame_bytes == c.spill_store_bytes == 0
    assert not c.spills and not c.clean
    assert list(report) == ["a", "c", "b"]


@needs_nvrtc
def test_parse_ptxas_report_of_a_real_compile() -> None:
    module = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert set(PREP_KERNELS) <= set(module.entry_names())
    assert module.resources == parse_ptxas_log(module.log)
    assert "Used" in module.log


def _wgmma_kernel_sass(source: str, name: str, defines: dict, tmp_path: Path) -> str:
    """SASS of kernel ``name`` compiled for sm_90a, after checking that ptxas did not serialize
    its wgmmas (info C7510-C7520); skips without cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    module = nvrtc.compile_module(source, defines, "sm_90a")
    assert "serialized" not in module.log, module.log
    cubin = tmp_path / "decode.cubin"
    cubin.write_bytes(module.cubin)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    body = _sass_by_function(sass)[name]
    assert "UTMALDG" in body, "pages are not loaded by TMA"
    assert "LDL" not in body and "STL" not in body, "local memory traffic"
    return body


@needs_nvrtc
@pytest.mark.parametrize(("rows", "promote", "wg_mode"),
                         [(r, p, m) for r in (16, 32, 64) for p, m in [(1, 0), (1, 1), (1, 2), (1, 3), (0, 0)]]
                         + [(64, 1, 4)])  # rows = M: 64-row tiles only
def test_wgmma_decode_sass_has_qgmma_hgmma_and_no_serialization(rows: int, promote: int, wg_mode: int,
                                                                tmp_path: Path) -> None:
    """Issue 7: the Hopper decode kernel runs its FP8 GEMMs on QGMMA and the RoPE tile on HGMMA,
    ptxas did not serialize the wgmmas (info C751x) and nothing touches local memory. The
    compile also proves the host's shared-memory formula (SNAPMLA_EXPECT_SMEM static_assert).
    Every warpgroup mode with promotion (what runs and what the tuner searches; rows = M at
    its 64 rows), and the diagnostic unpromoted kernel in the dims-split mode."""
    from snapmla_cli.ops.decode_config import FP8_WGMMA, fp8_defines, fp8_kernel, variant_config

    cfg = variant_config(rows, FP8_WGMMA, qk_promote=promote, pv_promote=promote, wg_mode=wg_mode)
    source, name = fp8_kernel(cfg)
    body = _wgmma_kernel_sass(source, name, fp8_defines(cfg), tmp_path)
    assert re.search(r"\bQGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", body), "no FP8 QGMMA in SASS"
    assert re.search(r"\bHGMMA\.64x\d+x16\.F32\.BF16", body), "no bf16 HGMMA in SASS"


@needs_nvrtc
def test_bf16_wgmma_decode_sass_has_hgmma_tma_and_no_spills(tmp_path: Path) -> None:
    """Issue 7's BF16 baseline on Hopper instructions: QK as HGMMA m64n64k16, PV as HGMMA
    m64n256k16 (V read in place, transposed by the instruction), pages by TMA, no local memory,
    no serialized wgmmas; the compile proves the host's shared-memory formula too."""
    from snapmla_cli.ops.decode_config import (
        BF16_WGMMA,
        bf16_defines,
        bf16_kernel,
        heuristic_config,
    )

    cfg = heuristic_config(16, False, BF16_WGMMA)
    source, name = bf16_kernel(cfg)
    assert source == "decode_bf16_wgmma.cu"
    body = _wgmma_kernel_sass(source, name, bf16_defines(cfg), tmp_path)
    assert re.search(r"\bHGMMA\.64x64x16\.F32\.BF16", body), "no QK HGMMA in SASS"
    assert re.search(r"\bHGMMA\.64x256x16\.F32\.BF16", body), "no PV HGMMA in SASS"
    assert "QGMMA" not in body
    wrong = {**bf16_defines(cfg), "SNAPMLA_EXPECT_SMEM": bf16_defines(cfg)["SNAPMLA_EXPECT_SMEM"] + 16}
    with pytest.raises(SnapmlaError, match="shared-memory"):
        nvrtc.compile_module(source, wrong, "sm_90a")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.parametrize("fmt_rows", ["fp8-16", "fp8-32", "fp8-64", "bf16-64"])
def test_wgmma_kernels_are_not_serialized_by_the_system_ptxas(fmt_rows: str, tmp_path: Path) -> None:
    """The same check with the installed toolkit's ptxas, which can be older than pip's NVRTC
    (the GPU machine's NVRTC 13.0 serialized a BF16 kernel that NVRTC 13.5 compiled clean):
    a developer machine with the GPU machine's nvcc catches it before device time is spent."""
    from snapmla_cli.ops.decode_config import (
        bf16_defines,
        bf16_kernel,
        fp8_defines,
        fp8_kernel,
        heuristic_config,
    )

    fmt, rows = fmt_rows.split("-")
    cfg = heuristic_config(int(rows), fmt == "fp8")
    source, _ = fp8_kernel(cfg) if fmt == "fp8" else bf16_kernel(cfg)
    defines = fp8_defines(cfg) if fmt == "fp8" else bf16_defines(cfg)
    cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-std=c++17", "-I", str(REPO_KERNELS), "-Xptxas", "-v",
           "-o", str(tmp_path / "k.cubin"), *(f"-D{k}={v}" for k, v in defines.items()), str(REPO_KERNELS / source)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "serialized" not in done.stderr, done.stderr
    assert "spill" not in done.stderr or " 0 bytes spill stores, 0 bytes spill loads" in done.stderr


@needs_nvrtc
@pytest.mark.parametrize("rows", [16, 32, 64])
@pytest.mark.parametrize(("switch", "symbol"), [("TRACE_PHASES", b"snapmla_phase_trace"),
                                                ("CTA_TIMES", b"snapmla_cta_times")])
def test_wgmma_diagnostic_builds_compile_and_export_their_buffers(switch: str, symbol: bytes, rows: int) -> None:
    """The diagnostic builds of scripts/trace_decode.py (TRACE_PHASES=1) and scripts/cta_times.py
    (CTA_TIMES=1) compile for the default layouts and export the buffer the script reads back by
    name; the shipped build carries neither. CTA_TIMES times the real kernel, so it must not
    spill (the trace's clock64 stores sit in the chains and spill 28 bytes at 64 rows: its
    phases are read relative to each other)."""
    from snapmla_cli.ops.decode_config import FP8_WGMMA, fp8_defines, heuristic_config

    defines = fp8_defines(heuristic_config(rows, True, FP8_WGMMA))
    module = nvrtc.compile_module("decode_fp8_wgmma.cu", {**defines, switch: 1}, "sm_90a")
    assert symbol in module.cubin
    if switch == "CTA_TIMES":
        assert module.resources["snapmla_decode_fp8_wgmma"].spill_store_bytes == 0
    plain = nvrtc.compile_module("decode_fp8_wgmma.cu", defines, "sm_90a")
    assert symbol not in plain.cubin


@needs_nvrtc
@pytest.mark.parametrize("defines", [{}, {"PRODUCER": 0, "REGS": 0, "EPI_BAR": 6}])
def test_racecheck_skeleton_compiles_without_spills(defines) -> None:
    """scripts/racecheck_handover.py's kernel (the alternate-pages barrier skeleton) builds for
    sm_90a in each of its switch settings, so the device call never finds a compile error."""
    module = nvrtc.compile_module("diag/handover_race.cu", defines, "sm_90a")
    res = module.resources["snapmla_diag_handover"]
    assert res.spill_store_bytes == 0 and res.local_bytes == 0


@needs_nvrtc
@pytest.mark.parametrize("mode,payload", [(0, 0), (1, 0), (1, 4096), (1, 16384)])
def test_cluster_handover_diagnostic_compiles_with_its_cluster_instructions(mode: int, payload: int,
                                                                           tmp_path: Path) -> None:
    """scripts/cluster_handover.py's kernel builds for sm_90a in every case the script runs,
    without spills, and its SASS holds what it exists to time: the cluster barrier, and in the
    ping-pong the 16-byte stores into the partner CTA and the remote mbarrier arrival."""
    module = nvrtc.compile_module("diag/cluster_handover.cu", {"MODE": mode, "PAYLOAD_BYTES": payload}, "sm_90a")
    res = module.resources["snapmla_diag_cluster_handover"]
    assert res.spill_store_bytes == 0 and res.local_bytes == 0
    assert res.shared_bytes >= payload
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    cubin = tmp_path / "cluster_handover.cubin"
    cubin.write_bytes(module.cubin)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass  # barrier.cluster
    assert ("SYNCS.ARRIVE.TRANS64.RED" in sass) == (mode == 1)  # the remote arrival
    assert ("ST.E.128" in sass) == (mode == 1 and payload > 0)  # st.shared::cluster.v4


# The FP8 wgmma kernel's A/B switches (defines, not DecodeConfig fields) and the layouts each one
# must change (it applies there) or leave as they were (variant_config arguments: rows, overrides).
SWITCH_LAYOUTS = [
    # a turn's two PVs as one pair: alternate pages, up to 32 rows, one CTA per SM
    ("PV_PAIRS", 0, [(32, {"wg_mode": 3})], [(64, {"wg_mode": 4, "row_groups": 4}),
                                              (16, {"wg_mode": 3, "stages": 2, "min_ctas_per_sm": 2})]),
    # every warp derives the rows' state: mode 3 up to 32 rows
    ("WARP_ROW_STATE", 0, [(32, {"wg_mode": 3}), (16, {"wg_mode": 3, "stages": 5, "min_ctas_per_sm": 1})],
     [(64, {"wg_mode": 3, "row_groups": 4, "stages": 3}), (16, {"wg_mode": 0, "stages": 2, "min_ctas_per_sm": 2})]),
    # transposed statistics: 4 or 8 rows per thread, up to 32 rows per softmax
    ("TRANSPOSED_STATS", 0, [(32, {"wg_mode": 3}), (64, {"wg_mode": 0, "row_groups": 4, "stages": 3})],
     [(64, {"wg_mode": 3, "row_groups": 4, "stages": 3}), (16, {"wg_mode": 0, "stages": 2, "min_ctas_per_sm": 2}),
      (64, {"wg_mode": 4, "row_groups": 4})]),
    # three promoted QK chunks in flight: the pipelined swapped layouts (16-32 rows); rows = M
    # keeps two (a third spills next to its O)
    ("QK_DEPTH", 2, [(32, {"wg_mode": 3}), (16, {"wg_mode": 3, "stages": 2, "min_ctas_per_sm": 2})],
     [(64, {"wg_mode": 4, "row_groups": 4}), (64, {"wg_mode": 3, "row_groups": 4, "stages": 3})]),
    # the paired PVs' fragments two m-tiles ahead: wherever the pairs run, except the column
    # build (balanced columns), where the third fragment set spills with NVRTC 13.0
    ("PV_FRAG_AHEAD", 0, [(32, {"wg_mode": 3}), (16, {"wg_mode": 3, "stages": 4, "min_ctas_per_sm": 1})],
     [(64, {"wg_mode": 4, "row_groups": 4}), (16, {"wg_mode": 3, "stages": 2, "min_ctas_per_sm": 2}),
      (32, {"wg_mode": 3, "rope_ring": 0, "split": SplitPolicy(balanced=True)})]),
    # a partial page's tail zeroed in shared memory instead of V^T byte masks: rows = M only (one
    # item per CTA and balanced columns); the swapped layouts and WG_MODE 6 keep their code
    ("TAIL_ZERO", 0, [(64, {"wg_mode": 4, "row_groups": 4}),
                      (64, {"wg_mode": 4, "row_groups": 4, "split": SplitPolicy(balanced=True)})],
     [(32, {"wg_mode": 3}), (64, {"wg_mode": 3, "row_groups": 4, "stages": 3}),
      (64, {"wg_mode": 6, "row_groups": 4}), (16, {"wg_mode": 0, "stages": 2, "min_ctas_per_sm": 2})]),
    # a whole page's scale loads and exponentials without per-token tests: the rows = M softmax
    # (modes 4 and 6); the swapped softmax has its own whole-page path
    ("ROWS_M_WHOLE", 0, [(64, {"wg_mode": 4, "row_groups": 4}), (64, {"wg_mode": 6, "row_groups": 4})],
     [(32, {"wg_mode": 3})]),
    # the V^T fragments' addresses from one offset per page: alternate pages, one item per CTA
    ("V_OFFSETS", 0, [(64, {"wg_mode": 4, "row_groups": 4}), (32, {"wg_mode": 3})],
     [(64, {"wg_mode": 4, "row_groups": 4, "split": SplitPolicy(balanced=True)}),
      (16, {"wg_mode": 0, "stages": 2, "min_ctas_per_sm": 2})]),
]


@needs_nvrtc
@pytest.mark.parametrize("define,old_value,changed,unchanged", SWITCH_LAYOUTS,
                         ids=[row[0] for row in SWITCH_LAYOUTS])
def test_ab_switch_changes_only_the_layouts_it_applies_to(define, old_value, changed, unchanged) -> None:
    """Each switch builds a different kernel where it applies and leaves the other layouts'
    code as it was (the same cubin with the old value), so a claim like "64 rows keep the old
    code" is checked without a GPU."""
    from snapmla_cli.ops.decode_config import FP8_WGMMA, fp8_defines, variant_config

    def cubins(rows, overrides):  # (the old value, the kernel's default)
        cfg = variant_config(rows, FP8_WGMMA, **overrides)
        assert cfg.stages == overrides.get("stages", cfg.stages), "the layout must fit as given"
        defines = fp8_defines(cfg)
        return [nvrtc.compile_module("decode_fp8_wgmma.cu", d, "sm_90a").cubin
                for d in ({**defines, define: old_value}, defines)]

    for rows, overrides in changed:
        old, new = cubins(rows, overrides)
        assert old != new, (define, rows, overrides)
    for rows, overrides in unchanged:
        old, new = cubins(rows, overrides)
        assert old == new, (define, rows, overrides)


@needs_nvrtc
def test_bf16_turn_orders_both_build_without_spills() -> None:
    """The BF16 wgmma kernel's QK-first turn (HANDOVER_FIRST=0, the A/B's old side) still builds,
    as a different kernel from the default hand-over-first turn, and neither spills."""
    from snapmla_cli.ops import decode_config as dc

    cfg = dc.heuristic_config(64, False, dc.BF16_WGMMA)
    source, name = dc.bf16_kernel(cfg)
    builds = [nvrtc.compile_module(source, {**dc.bf16_defines(cfg), **extra}, "sm_90a")
              for extra in ({}, {"HANDOVER_FIRST": 0})]
    assert builds[0].cubin != builds[1].cubin
    for module in builds:
        res = module.resources[name]
        assert res.spill_store_bytes == 0 and res.local_bytes == 0


@needs_nvrtc
def test_wgmma_smem_mirror_is_checked_by_the_kernel() -> None:
    """A wrong host-side shared-memory size must be a compile error, not a silent overflow."""
    from snapmla_cli.ops.decode_config import FP8_WGMMA, fp8_defines, heuristic_config

    defines = fp8_defines(heuristic_config(64, True, FP8_WGMMA))
    defines["SNAPMLA_EXPECT_SMEM"] += 16
    with pytest.raises(SnapmlaError, match="shared-memory"):
        nvrtc.compile_module("decode_fp8_wgmma.cu", defines, "sm_90a")


def _wgmma_rate_cases() -> tuple[tuple[tuple[int, ...], bool], ...]:
    """The warpgroup mixes scripts/wgmma_rate.py runs (imported from the script, so the two
    cannot drift apart)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "wgmma_rate.py"
    spec = importlib.util.spec_from_file_location("wgmma_rate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.CASES


# the SASS instruction each shape code of kernels/diag/wgmma_rate.cu must become
WGMMA_RATE_SASS = {1: "QGMMA.64x64x32.F32.E4M3.E4M3", 2: "QGMMA.64x64x32.F32.E4M3.E4M3",
                   3: "QGMMA.64x64x32.F32.E4M3.E4M3", 4: "HGMMA.64x64x16.F32.BF16",
                   5: "QGMMA.64x256x32.F32.E4M3.E4M3"}


@needs_nvrtc
@pytest.mark.parametrize(("shapes", "stream"), _wgmma_rate_cases(),
                         ids=lambda c: c if isinstance(c, bool) else "-".join(map(str, c)))
def test_wgmma_rate_diagnostic_compiles_unserialized(shapes: tuple[int, ...], stream: bool, tmp_path: Path) -> None:
    """Every mix scripts/wgmma_rate.py runs builds for sm_90a without spills, with the wgmma of
    each shape in its SASS and no serialized wgmmas (a serialized loop would measure ptxas'
    waits, not the tensor cores), and the ldmatrix of the fragment-loading shape (3) only there."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    defines = {"NUM_WG": len(shapes), "STREAM": int(stream), **{f"WG{i}_SHAPE": s for i, s in enumerate(shapes)}}
    module = nvrtc.compile_module("diag/wgmma_rate.cu", defines, "sm_90a")
    assert "serialized" not in module.log, module.log
    res = module.resources["snapmla_diag_wgmma_rate"]
    assert res.spill_store_bytes == 0 and res.local_bytes == 0
    cubin = tmp_path / "rate.cubin"
    cubin.write_bytes(module.cubin)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    body = _sass_by_function(sass)["snapmla_diag_wgmma_rate"]
    for code in set(shapes):
        assert WGMMA_RATE_SASS[code] in body, f"shape {code}: no {WGMMA_RATE_SASS[code]}"
    assert ("LDSM" in body) == (3 in shapes)
    assert ("UBLKCP" in body) == stream, "the streaming warp's bulk copies"


@needs_nvrtc
def test_a_compile_error_is_one_line_with_the_log_kept_apart(tmp_path: Path) -> None:
    """NVRTC's log came in the message over many lines (and a CLI line of many KB); it is the
    first error on one line now, the whole log on the exception."""
    source = tmp_path / "broken.cu"
    source.write_text('extern "C" __global__ void k() { int x = ; }\n__device__ void f() { undefined_thing(); }\n')
    with pytest.raises(nvrtc.KernelCompileError) as caught:
        nvrtc._nvrtc_compile(source.read_text(), str(source), ["--gpu-architecture=sm_90a"], (), "sm_90a")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("broken.cu: NVRTC failed to compile for sm_90a: ")
    assert "error: expected an expression" in message and "undefined_thing" not in message
    assert "undefined_thing" in caught.value.log and caught.value.log.count("\n") >= 4


@needs_nvrtc
def test_a_folder_at_an_entrys_name_is_no_compile_error(isolated_caches: Path) -> None:
    """The store refused the folder as an output (a SnapmlaError, not the OSError it caught), so
    every compile of that kernel failed after NVRTC had succeeded."""
    first = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    for suffix in (".cubin", ".json"):
        (isolated_caches / f"{first.key}{suffix}").unlink()
        (isolated_caches / f"{first.key}{suffix}").mkdir()
    nvrtc.clear_memory_cache()
    again = nvrtc.compile_module(PREP_SOURCE, PREP_DEFINES, "sm_90a")
    assert again.origin == "nvrtc" and again.cubin == first.cubin



def test_temp_files_of_killed_writers_are_swept_once_old(isolated_caches: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL runs no clean-up: the hidden temp files piled up in the cache without limit."""
    monkeypatch.setattr(kernel_cache, "_SWEPT", set())
    isolated_caches.mkdir()
    old, fresh = isolated_caches / ".k1.cubin.0badf00d.tmp", isolated_caches / ".k2.json.feedf00d.tmp"
    for tmp in (old, fresh):
        tmp.write_bytes(b"half")
    hours_ago = time.time() - 2 * kernel_cache.STALE_TEMP_SECONDS
    os.utime(old, (hours_ago, hours_ago))
    entry = kernel_cache.CachedKernel(cubin=b"\x7fELF-cubin", log="", lowered_names={})
    assert kernel_cache.store("k3", entry, {})
    assert not old.exists() and fresh.exists()  # (a fresh one may be another process's live write)
    assert kernel_cache.load("k3") is not None
