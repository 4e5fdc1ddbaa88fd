"""Compile the CUDA sources under ``kernels/`` to cubins with NVRTC, with a disk + memory cache.

Why NVRTC and our own cubin path (KERNEL-NOTES): it needs no GPU (CI compiles every kernel for
sm_90a and reads ptxas' report), it can target ``sm_90a`` (CuPy's ``RawModule`` would pick
``sm_90``, which rejects FP8 wgmma), and it gives us the full log. The cache key hashes every
file under ``kernels/`` (headers included), the options, the arch, the NVRTC version and the
CUDA headers' stamp (:func:`header_stamp`), so a warm start compiles nothing and any edit
recompiles; a program is named by its absolute path, so no header comes from the working
folder. ``cupy`` is imported lazily: the package imports (and the CPU paths run) without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from ..bundled import KERNELS, bundled_dir
from ..errors import SnapmlaError
from ..sizes import counted
from . import kernel_cache
from .ptxas import KernelResources, parse_ptxas_log

KERNEL_DIR_ENV = "SNAPMLA_KERNEL_DIR"
DEFAULT_ARCH = "sm_90a"
FALLBACK_CUDA_INCLUDE = Path("/usr/local/cuda/include")

Defines = Mapping[str, "int | str"]
DefinesKey = tuple[tuple[str, str], ...]

_BASE_OPTIONS = (
    "-std=c++17",
    "-lineinfo",
    "-Xptxas",
    "-v",
    "-Xptxas",
    "--warn-on-spills",
)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VALUE = re.compile(r"^[A-Za-z0-9_.+\-]+$")
_ARCH = re.compile(r"^sm_\d+[a-f]?$")


@dataclass(frozen=True, eq=False)
class CompiledModule:
    """One compiled source: the cubin, NVRTC's full log and ptxas' per-function report."""

    source: str
    arch: str
    defines: DefinesKey
    cubin: bytes
    log: str
    resources: dict[str, KernelResources]
    lowered_names: dict[str, str] = field(default_factory=dict)
    key: str = ""
    origin: str = "nvrtc"  # "nvrtc" (compiled in this process) or "disk" (cache hit)

    def symbol(self, kernel_name: str) -> str:
        """The name the cubin knows ``kernel_name`` by (templates are mangled)."""
        return self.lowered_names.get(kernel_name, kernel_name)

    def kernel(self, kernel_name: str) -> KernelResources:
        sym = self.symbol(kernel_name)
        if sym not in self.resources:
            raise SnapmlaError(
                f"{self.source}: no kernel {kernel_name!r} in the ptxas report for {self.arch} "
                f"(found: {', '.join(self.entry_names()) or 'none'})"
            )
        return self.resources[sym]

    def entry_names(self) -> list[str]:
        return [name for name, res in self.resources.items() if res.is_entry]


def kernel_dir() -> Path:
    """``$SNAPMLA_KERNEL_DIR``, else the shipped ``kernels/`` (:mod:`snapmla_cli.bundled`)."""
    env = os.environ.get(KERNEL_DIR_ENV)
    folder = Path(env).expanduser() if env else bundled_dir(KERNELS)
    if not folder.is_dir():
        # a file given as the folder exists: "not found" sent the user looking for a typo
        if folder.is_file():
            problem = f"{folder} is a file, expected a folder"
        elif folder.exists():
            problem = f"{folder} is not a folder"
        else:
            problem = f"folder {folder} not found"
        raise SnapmlaError(f"kernel sources: {problem} (set {KERNEL_DIR_ENV} to the kernels/ folder)")
    return folder


# kernels/diag/: diagnostic kernels that scripts build (timing probes, racecheck skeletons),
# never part of a decode or prep build
DIAGNOSTIC_FOLDER = "diag"


def source_tree_hash(folder: Path, skip: tuple[str, ...] = ()) -> str:
    """Hash of every file under ``folder`` (relative path + bytes); hidden files are skipped, and
    the top-level folders named in ``skip``."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            continue
        if rel.parts[0] in skip:
            continue
        data = path.read_bytes()
        digest.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def product_sources_hash(folder: Path) -> str:
    """The hash of what the product kernels compile from: the kernel tree without
    :data:`DIAGNOSTIC_FOLDER`. Tuning entries are stamped with it (and ``--version`` prints it):
    a diagnostic added or edited changes no kernel the entries timed, so it must not mark every
    entry stale. (The compile cache keys on the whole tree: a diagnostic is compiled too.)"""
    return source_tree_hash(folder, skip=(DIAGNOSTIC_FOLDER,))


def kernel_sources_stamp() -> tuple[str | None, str]:
    """(the product kernel sources' hash, "") or (None, why there is none: no folder, or a source that
    cannot be read), for what only reports or compares the stamp: ``snapmla --version`` and
    ``info``, the tuning database's stale marks."""
    try:
        return product_sources_hash(kernel_dir()), ""
    except SnapmlaError as exc:  # its message names the kernel sources already
        return None, str(exc)
    except OSError as exc:
        return None, f"kernel sources: {exc}"


@lru_cache(maxsize=1)
def header_dirs() -> tuple[str, ...]:
    """cudart headers (``cuda_fp8.h``, ``cuda_bf16.h``) and CCCL (``cuda/std/...``)."""
    found: list[str] = []
    try:
        from cuda import pathfinder

        for lib in ("cudart", "cccl"):
            try:
                path = pathfinder.find_nvidia_header_directory(lib)
            except Exception:  # noqa: BLE001 - an unknown/odd install only means "not found"
                path = None
            if path:
                found.append(str(path))
    except ImportError:
        pass
    if len(found) < 2:
        for fallback in (FALLBACK_CUDA_INCLUDE, FALLBACK_CUDA_INCLUDE / "cccl"):
            if fallback.is_dir() and str(fallback) not in found:
                found.append(str(fallback))
    return tuple(found)


# CCCL's version, under its include folder (whose top level holds only folders)
CCCL_VERSION_HEADER = Path("cuda") / "std" / "__cccl" / "version.h"


@lru_cache(maxsize=1)
def header_stamp() -> str:
    """Hash of the CUDA headers the kernels compile against: every top-level file of each header
    folder (cudart's ``cuda_fp8.h``, ``cuda_bf16.h``, ...) and CCCL's version header. They ship
    apart from NVRTC (the cudart headers, ``nvidia-cuda-cccl``), so an upgrade of them keeps the
    folders and NVRTC's version the key held: without this a stale cubin would load. Read once
    per process (about 4 MB)."""
    digest = hashlib.sha256()
    for folder in map(Path, header_dirs()):
        try:
            files = sorted(p for p in folder.iterdir() if p.is_file())
            if (folder / CCCL_VERSION_HEADER).is_file():
                files.append(folder / CCCL_VERSION_HEADER)
            for path in files:
                data = path.read_bytes()
                digest.update(f"{path}\0{len(data)}\0".encode())
                digest.update(data)
        except OSError as exc:  # (NVRTC will say what it cannot read; the key only notes it)
            digest.update(f"{folder}\0{type(exc).__name__}\0".encode())
    return digest.hexdigest()[:16]


def normalize_defines(defines: Defines | None) -> DefinesKey:
    """Validated, sorted ``(name, value)`` pairs; the stable form used in keys and options."""
    if not defines:
        return ()
    out: list[tuple[str, str]] = []
    for name, value in defines.items():
        if not _IDENT.match(name):
            raise SnapmlaError(f"defines: {name!r} is not a valid macro name")
        if isinstance(value, bool):
            value = int(value)
        text = str(value)
        if not isinstance(value, (int, str)) or not _VALUE.match(text):
            raise SnapmlaError(f"defines: {name}={value!r}: expected an int or a simple token")
        out.append((name, text))
    return tuple(sorted(out))


def build_options(arch: str, defines: DefinesKey, src_hash: str, folder: Path) -> list[str]:
    if not _ARCH.match(arch):
        raise SnapmlaError(f"arch: expected something like 'sm_90a' or 'sm_89', got {arch!r}")
    options = [f"-arch={arch}", *_BASE_OPTIONS, f"-I{folder}"]
    options += [f"-I{d}" for d in header_dirs()]
    options += [f"-D{name}={value}" for name, value in defines]
    options.append(f"-DSNAPMLA_SRC_HASH=0x{src_hash}")
    return options


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


_MEMORY: dict[str, CompiledModule] = {}
_LOCK = threading.Lock()


def clear_memory_cache() -> None:
    """Forget in-process compile results (tests use it to exercise the disk cache)."""
    with _LOCK:
        _MEMORY.clear()


def compile_module(
    source: str,
    defines: Defines | None = None,
    arch: str = DEFAULT_ARCH,
    name_expressions: Iterable[str] = (),
) -> CompiledModule:
    """Compile ``kernels/<source>`` for ``arch`` (no GPU needed); cached in memory and on disk.

    A compile error raises :class:`KernelCompileError` (one line: the source, the arch and the
    first error; NVRTC's log on its ``log``). A kernel folder edited while this compile ran gives
    the compiled module uncached: its cubin may hold the new sources, the key the old ones.
    """
    folder = kernel_dir()
    path = folder / source
    if not path.is_file():
        raise SnapmlaError(f"kernel source: {path} not found")
    defs = normalize_defines(defines)
    names = tuple(name_expressions)
    tree = source_tree_hash(folder)
    options = build_options(arch, defs, tree, folder)
    version = nvrtc_version()
    headers = header_stamp()
    key = _cache_key(source, arch, options, names, version, headers)
    with _LOCK:
        module = _MEMORY.get(key)
        if module is not None:
            return module
        cached = kernel_cache.load(key)
        if cached is not None:
            module = _make_module(
                source, arch, defs, cached.cubin, cached.log, cached.lowered_names, key, "disk"
            )
        else:
            # named by its absolute path: NVRTC looks for a quoted include next to the program's
            # name first, so a bare name took headers from the working folder, under this key
            cubin, log, lowered = _nvrtc_compile(path.read_text(), str(path), options, names, arch)
            module = _make_module(source, arch, defs, cubin, log, lowered, key, "nvrtc")
            if source_tree_hash(folder) != tree:  # edited since the key was made (a checkout
                return module  # while another compile held the lock): never cached under it
            kernel_cache.store(
                key,
                kernel_cache.CachedKernel(cubin=cubin, log=log, lowered_names=lowered),
                {
                    "source": source,
                    "arch": arch,
                    "defines": dict(defs),
                    "tree_hash": tree,
                    "nvrtc": list(version),
                    "headers": headers,
                },
            )
        _MEMORY[key] = module
        return module


def _cache_key(
    source: str, arch: str, options: list[str], names: tuple[str, ...], version: tuple[int, int],
    headers: str,
) -> str:
    blob = json.dumps([source, arch, options, list(names), list(version), headers], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _make_module(
    source: str,
    arch: str,
    defs: DefinesKey,
    cubin: bytes,
    log: str,
    lowered: dict[str, str],
    key: str,
    origin: str,
) -> CompiledModule:
    return CompiledModule(
        source=source,
        arch=arch,
        defines=defs,
        cubin=cubin,
        log=log,
        resources=parse_ptxas_log(log),
        lowered_names=lowered,
        key=key,
        origin=origin,
    )


def _nvrtc() -> ModuleType:
    try:
        import cupy
    except ImportError:
        raise SnapmlaError(
            "NVRTC unavailable: CuPy is not installed (pip install 'snapmla[cuda]')"
        ) from None
    return cupy.cuda.nvrtc


class KernelCompileError(SnapmlaError):
    """NVRTC refused a kernel source (an edited ``SNAPMLA_KERNEL_DIR``): the message is one line
    with the first error; ``log`` holds NVRTC's whole log, which the message used to carry over
    as many lines."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


def _nvrtc_compile(
    text: str, name: str, options: list[str], name_expressions: tuple[str, ...], arch: str
) -> tuple[bytes, str, dict[str, str]]:
    """The only place that calls NVRTC (tests monkeypatch it to prove a cache hit); ``name``:
    the source's absolute path, the program's name."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(text, name, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog).strip()
            first = next((ln for ln in log.splitlines() if "error" in ln), "see log")
            raise KernelCompileError(
                f"{Path(name).name}: NVRTC failed to compile for {arch}: {first.strip()} "
                f"({counted(len(log.splitlines()), 'line')} of log in the exception's `log`)", log) from None
        log = nvrtc.getProgramLog(prog)
        # getCUBIN drops the cubin's final byte (KERNEL-NOTES): put it back.
        cubin = nvrtc.getCUBIN(prog) + b"\0"
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, log, lowered
