"""Where a decode kernel's warps wait, instruction by instruction: Nsight Compute's warp-state
sampling (the SourceCounters section, exported as the SASS source page's CSV) summed per
instruction, per opcode and per stall reason, so that a lever is chosen from measured stalls
rather than from a reading of the SASS.

Collect on the GPU machine (``bash scripts/gpu_check.sh stalls`` does it), then read here or on
any machine::

    ncu --clock-control none -k regex:snapmla_decode_fp8_wgmma --launch-skip 1 -c 1 \\
        --section SourceCounters -o rep python3 scripts/profile_decode.py --heads 32 --ctx 16384
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 scripts/stall_ledger.py rep.csv

The CSV's column names differ between Nsight Compute versions: the columns are found by their
words (address, source, samples), and every numeric column whose name names a stall reason is
summed as one.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path

SAMPLES_ALL = "warp stall sampling (all"
SAMPLES_NOT_ISSUED = "warp stall sampling (not"
TOP_INSTRUCTIONS = 30
# a phase marker: the instructions that close a phase of the page loop, by opcode prefix
PHASE_MARKERS = ("BAR.SYNC", "BAR.ARV", "WARPGROUP.DEPBAR", "SYNCS.PHASECHK", "WARPGROUP.ARRIVE")


def _largest(totals: dict[str, float], count: int) -> list[tuple[str, float]]:
    """The ``count`` largest totals, largest first."""
    return sorted(totals.items(), key=lambda item: -item[1])[:count]


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def _cell(row: list[str], column: int | None, default: str = "") -> str:
    """The row's text in ``column``, or ``default`` where the page has no such column."""
    return row[column] if column is not None and column < len(row) else default


def _find(header: list[str], *words: str) -> int | None:
    for i, name in enumerate(header):
        low = name.lower()
        if all(w in low for w in words):
            return i
    return None


def opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate (``@!P0 FADD R1, ...`` -> ``FADD``)."""
    text = re.sub(r"^\s*@!?U?P\w+\s+", "", sass.strip())
    return text.split()[0] if text else ""


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="") as handle:
        lines = [line for line in handle if line.strip()]
    # the page may start with notes before the header: the header is the first row naming Source
    start = next((i for i, line in enumerate(lines) if "Source" in line), 0)
    table = list(csv.reader(lines[start:]))
    return table[0], table[1:]


def ledger(path: Path, top: int, pages: int = 0) -> None:
    header, rows = read_rows(path)
    i_src = _find(header, "source")
    i_addr = _find(header, "address")
    i_all = _find(header, SAMPLES_ALL)
    i_not = _find(header, SAMPLES_NOT_ISSUED)
    if i_src is None or i_all is None:
        print(f"{path.name}: no Source / '{SAMPLES_ALL}' columns; the header is:")
        print("  " + " | ".join(header))
        return
    i_exec = _find(header, "instructions executed")
    reasons = [i for i, name in enumerate(header)
               if name.lower().startswith("stall_") and "not issued" not in name.lower()]
    rows = [r for r in rows if len(r) > i_all]
    total = sum(_number(r[i_all]) for r in rows)
    print(f"== {path.name}: {len(rows)} instructions, {total:.0f} samples")
    if total == 0:
        return
    by_op: dict[str, float] = defaultdict(float)  # samples (Nsight may print fractions)
    by_reason: dict[str, float] = defaultdict(float)
    # (marker, samples, warp instructions executed) between phase markers, in address order
    phases: list[tuple[str, float, float]] = []
    running = executed = 0.0
    for r in rows:
        samples = _number(r[i_all])
        op = opcode(r[i_src])
        by_op[op] += samples
        running += samples
        executed += _number(_cell(r, i_exec))
        for i in reasons:
            by_reason[header[i]] += _number(_cell(r, i))
        if op.startswith(PHASE_MARKERS):
            phases.append((f"{_cell(r, i_addr, '?')} {r[i_src].strip()[:60]}", running, executed))
            running = executed = 0.0
    print("-- top instructions (share of all samples, not issued)")
    for r in sorted(rows, key=lambda r: -_number(r[i_all]))[:top]:
        not_issued = _number(_cell(r, i_not, "nan"))
        print(f"  {100 * _number(r[i_all]) / total:5.1f}%  {not_issued:7.0f}  {_cell(r, i_addr, '?'):>8}  "
              f"{r[i_src].strip()[:90]}")
    print("-- by opcode")
    for op, samples in _largest(by_op, 20):
        print(f"  {100 * samples / total:5.1f}%  {op}")
    if by_reason:
        print("-- by stall reason (share of all samples)")
        for name, samples in _largest(by_reason, 12):
            print(f"  {100 * samples / total:5.1f}%  {name.removeprefix('stall_')}")
    per = f", warp instructions per {'page' if pages else 'call'}" if i_exec is not None else ""
    print(f"-- samples up to each phase marker (address order; >= 1% of all){per}")
    for label, samples, executed in phases:
        if samples >= 0.01 * total:
            count = f"  {executed / (pages or 1):9.0f}" if i_exec is not None else ""
            print(f"  {100 * samples / total:5.1f}%{count}  up to {label}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", type=Path, help="source-page CSVs (ncu --page source --csv --print-source sass)")
    ap.add_argument("--top", type=int, default=TOP_INSTRUCTIONS)
    ap.add_argument("--pages", type=int, default=0,
                    help="KV pages of the profiled call (b * ctx / 64): instructions are then given per page")
    args = ap.parse_args()
    for path in args.csv:
        if not path.is_file():
            sys.exit(f"csv: {path} not found")
        try:
            ledger(path, args.top, args.pages)
        except BrokenPipeError:  # the reader (`| head`) has what it wanted
            sys.stderr.close()
            return


if __name__ == "__main__":
    main()
