"""Where a decode kernel's registers go, per source line (no GPU needed).

A design that adds warps to a CTA (a third consumer warpgroup, four of 128 dims each) is decided
by the registers a consumer thread has left beside O, and ptxas reports only the kernel's total.
This compiles one build with NVRTC, reads nvdisasm's register life ranges (the live
general-purpose registers at every SASS instruction) and its line table with inlining, and
prints, per kernel source line, the most registers live at any of its instructions: the
phase that sets the kernel's need, and how far each phase is from a smaller budget.

An instruction of a header (``common/ptx.cuh``'s wgmma wrappers) is charged to the line of the
decode source that inlined it, so a PV wgmma counts for the PV code that issues it.

    python3 scripts/register_peaks.py                      # the 64-row default build
    python3 scripts/register_peaks.py 3:4:1:4:1:1:1:4 --budget 160 --top 30
    python3 scripts/register_peaks.py --rows 32 --define TRACE_PHASES=1
    python3 scripts/register_peaks.py --format bf16
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from snapmla_cli.ops.decode_config import (
    bf16_defines,
    bf16_kernel,
    config_from_spec,
    fp8_defines,
    fp8_kernel,
    heuristic_config,
)
from snapmla_cli.runtime import nvrtc

ARCH = "sm_90a"
DEFAULT_ROWS = 64
DEFAULT_TOP = 25
# nvdisasm's life-range table: "// |  GPR  | PRED | UGPR | UPRED |" after each instruction
_ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
_LOCATION = re.compile(r'//## File "([^"]+)", line (\d+)')
# a definition a source line belongs to: a lambda of consume() (`auto pv_page = [&]`) or a device
# function (`__device__ __forceinline__ void qk_chunk(`)
_DEFINITION = re.compile(r"^\s*(?:auto (\w+) = \[|(?:template <[^>]*>\s*)?__device__ .*?(\w+)\()")


@dataclass(frozen=True)
class LinePeak:
    """The most live GPRs at any instruction of one source line, and how many instructions it has."""

    file: str
    line: int
    peak: int
    instructions: int


def find_nvdisasm() -> str | None:
    """The nvdisasm of the pip CUDA toolkit (next to NVRTC), else one on PATH, else None."""
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_binary_utility("nvdisasm")
    except Exception:  # noqa: BLE001 (an absent or older pathfinder: fall back to PATH)
        found = None
    if found is None:
        import shutil

        found = shutil.which("nvdisasm")
    return None if found is None else str(found)


def nvdisasm() -> str:
    """:func:`find_nvdisasm`, or exit naming the package."""
    found = find_nvdisasm()
    if found is None:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or put CUDA's bin on PATH)")
    return found


def live_gprs(lrm_text: str) -> dict[int, int]:
    """Instruction address -> live GPRs, from ``nvdisasm -lrm count``."""
    live: dict[int, int] = {}
    for text in lrm_text.splitlines():
        address = _ADDRESS.search(text)
        if address is None or "// |" not in text:
            continue
        gpr = text.split("// |", 1)[1].split("|", 1)[0].strip()
        if gpr.isdigit():
            live[int(address.group(1), 16)] = int(gpr)
    return live


def line_of_address(lines_text: str, main_source: str) -> dict[int, tuple[str, int]]:
    """Instruction address -> (file, line) from ``nvdisasm -gi``, which writes before an
    instruction its inlining chain, innermost location first: the first location of the chain
    in ``main_source`` (else the innermost one)."""
    where: dict[int, tuple[str, int]] = {}
    chain: list[tuple[str, int]] = []
    current: tuple[str, int] | None = None
    after_instruction = True
    for text in lines_text.splitlines():
        loc = _LOCATION.search(text)
        if loc is not None:
            if after_instruction:
                chain, after_instruction = [], False
            chain.append((loc.group(1), int(loc.group(2))))
            in_main = [(f, n) for f, n in chain if f.endswith(main_source)]
            file, line = in_main[0] if in_main else chain[0]
            current = (Path(file).name, line)
            continue
        address = _ADDRESS.search(text)
        if address is not None and current is not None:
            where[int(address.group(1), 16)] = current
            after_instruction = True
    return where


def line_peaks(live: dict[int, int], where: dict[int, tuple[str, int]]) -> list[LinePeak]:
    """Per source line its peak live GPRs and instruction count, highest peak first."""
    peaks: dict[tuple[str, int], list[int]] = defaultdict(list)
    for address, count in live.items():
        if address in where:
            peaks[where[address]].append(count)
    out = [LinePeak(f, n, max(v), len(v)) for (f, n), v in peaks.items()]
    return sorted(out, key=lambda p: (-p.peak, p.file, p.line))


def enclosing_definitions(text: list[str]) -> list[str]:
    """Per source line (0-based), the name of the innermost definition whose body holds it
    (bodies found by matching braces, comments dropped); "(top)" outside any."""
    names = ["(top)"] * len(text)
    code = [line.split("//", 1)[0] for line in text]
    for first, line in enumerate(code):
        found = _DEFINITION.match(line)
        if found is None:
            continue
        depth, opened = 0, False
        for last in range(first, len(code)):
            depth += code[last].count("{") - code[last].count("}")
            opened = opened or "{" in code[last]
            if opened and depth <= 0:
                break
        if not opened:  # a declaration
            continue
        name = found.group(1) or found.group(2)
        for i in range(first, last + 1):  # later (inner) definitions overwrite
            names[i] = name
    return names


def definition_peaks(peaks: list[LinePeak], source: str, text: list[str]) -> list[tuple[str, int, int]]:
    """(definition, peak, instructions) of the decode source's lines grouped by the definition
    they sit in (a phase: qk_promoted, softmax_rows_m, pv_page, ...), highest peak first."""
    names = enclosing_definitions(text)
    groups: dict[str, list[LinePeak]] = defaultdict(list)
    for p in peaks:
        if p.file == source and 0 < p.line <= len(names):
            groups[names[p.line - 1]].append(p)
    out = [(name, max(p.peak for p in ps), sum(p.instructions for p in ps)) for name, ps in groups.items()]
    return sorted(out, key=lambda g: (-g[1], g[0]))


def disassemble(cubin: bytes, tool: str) -> tuple[str, str]:
    """(life ranges, line table with inlining) of ``cubin``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)

        def run(*flags: str) -> str:
            return subprocess.run([tool, *flags, "-c", str(path)], capture_output=True, text=True, check=True).stdout

        return run("-lrm", "count"), run("-gi")


def ptxas_summary(log: str) -> str:
    """ptxas' register count and spill line for the build."""
    keep = [t.strip() for t in log.splitlines() if "Used" in t or ("spill" in t and "warning" not in t)]
    return "; ".join(keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", help="kernel spec (config_from_spec); default: the heuristic's for --rows")
    parser.add_argument("--format", choices=("fp8", "bf16"), default="fp8", help="which decode kernel (default fp8)")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="rows a CTA's tile serves (default 64)")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra compile-time define (repeatable)")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="source lines to print")
    parser.add_argument("--budget", type=int, default=None,
                        help="also count the lines whose peak exceeds this many registers")
    args = parser.parse_args()
    fp8 = args.format == "fp8"
    try:
        cfg = config_from_spec(args.spec) if args.spec else heuristic_config(args.rows, fp8=fp8)
    except ValueError as exc:
        sys.exit(str(exc))
    source, _ = fp8_kernel(cfg) if fp8 else bf16_kernel(cfg)
    defines: dict[str, int | str] = dict(fp8_defines(cfg) if fp8 else bf16_defines(cfg))
    for item in args.define:
        name, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"--define: expected NAME=VALUE, got {item!r}")
        defines[name] = int(value) if value.lstrip("-").isdigit() else value
    module = nvrtc.compile_module(source, defines, ARCH)
    lrm, lines = disassemble(module.cubin, nvdisasm())
    peaks = line_peaks(live_gprs(lrm), line_of_address(lines, source))
    if not peaks:
        sys.exit("no register life ranges found in nvdisasm's output")
    text = (nvrtc.kernel_dir() / source).read_text().splitlines()
    print(f"{source} {defines}")
    print(f"ptxas: {ptxas_summary(module.log)}")
    print(f"peak live GPRs: {peaks[0].peak} (at {peaks[0].file}:{peaks[0].line})")
    if args.budget is not None:
        over = [p for p in peaks if p.peak > args.budget]
        print(f"lines above {args.budget}: {len(over)}, {sum(p.instructions for p in over)} instructions")
    print(f"{'peak':>5} {'instr':>6}  definition (the lines inside it)")
    for name, peak, count in definition_peaks(peaks, source, text)[: args.top]:
        print(f"{peak:>5} {count:>6}  {name}")
    print(f"{'peak':>5} {'instr':>6}  line")
    for p in peaks[: args.top]:
        snippet = text[p.line - 1].strip()[:90] if p.file == source and p.line <= len(text) else ""
        print(f"{p.peak:>5} {p.instructions:>6}  {p.file}:{p.line}  {snippet}")


if __name__ == "__main__":
    main()
