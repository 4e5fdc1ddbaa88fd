"""scripts/stall_ledger.py on a small source page in Nsight Compute's CSV layout: the shares,
the per-reason sums and the per-page instruction counts between phase markers it prints are
the ones the rows hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stall_ledger.py"
PAGE = """\
"Kernel Name","snapmla_decode_fp8_wgmma",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","stall_short_sb","stall_barrier (Not Issued)"
"0x7f0000000010","S2R R1, SR_TID.X","10","5","128","0","0","0"
"0x7f0000000020","@P0 BAR.SYNC.DEFER_BLOCKING R24, 0x100","50","50","128","50","0","50"
"0x7f0000000030","SHFL.BFLY PT, R25, R25, 0x10, 0x1f","30","20","256","0","30","0"
"0x7f0000000040","BAR.ARV R40, 0x100","10","10","128","10","0","10"
"""


def run_ledger(tmp_path: Path, *args: str) -> str:
    page = tmp_path / "page.csv"
    page.write_text(PAGE)
    done = subprocess.run([sys.executable, str(SCRIPT), str(page), *args], capture_output=True, text=True, check=True)
    return done.stdout


def test_ledger_shares_reasons_and_phases(tmp_path: Path) -> None:
    out = run_ledger(tmp_path, "--pages", "64")
    assert "4 instructions, 100 samples" in out
    assert "50.0%       50  0x7f0000000020  @P0 BAR.SYNC.DEFER_BLOCKING R24, 0x100" in out
    assert "60.0%  barrier" in out and "30.0%  short_sb" in out  # the (Not Issued) columns are not added
    # the first phase ends at the BAR.SYNC (S2R + BAR: 256 instructions / 64 pages), the second at BAR.ARV
    assert "60.0%          4  up to 0x7f0000000020" in out
    assert "40.0%          6  up to 0x7f0000000040" in out


def test_ledger_names_the_header_it_cannot_read(tmp_path: Path) -> None:
    page = tmp_path / "other.csv"
    page.write_text('"Address","Text"\n"0x10","NOP"\n')
    done = subprocess.run([sys.executable, str(SCRIPT), str(page)], capture_output=True, text=True, check=True)
    assert "no Source" in done.stdout and "Address | Text" in done.stdout
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.csv")], capture_output=True, text=True,
                             check=False)
    assert missing.returncode != 0 and "not found" in missing.stderr
