"""scripts/register_peaks.py: nvdisasm's life ranges and inlining chains are read as written
(a header's instruction is charged to the decode line that inlined it), and on the real 64-row
build the PV promotion's line holds at least O and the fresh accumulator (no GPU needed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "register_peaks.py"
MAIN = "decode_fp8_wgmma.cu"
LIFE_RANGES = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;          // |   56  |   3    |    2   |         |
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;  // |  200  |   3    |    2   |         |
        /*0020*/                   FFMA R2, R3, R4, R5 ;           // |  190  |   3    |    2   |         |
        /*0030*/                   FFMA R2, R3, R4, R6 ;           // |  191  |   3    |    2   |         |
"""
LINE_TABLE = f"""\
\t//## File "/x/{MAIN}", line 10
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/x/common/ptx.cuh", line 134 inlined at "/x/{MAIN}", line 600
\t//## File "/x/{MAIN}", line 600 inlined at "/x/{MAIN}", line 900
\t//## File "/x/{MAIN}", line 900
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
\t//## File "/x/{MAIN}", line 700 inlined at "/x/{MAIN}", line 900
\t//## File "/x/{MAIN}", line 900
        /*0020*/                   FFMA R2, R3, R4, R5 ;
        /*0030*/                   FFMA R2, R3, R4, R6 ;
"""


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("register_peaks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_life_ranges_and_chains_give_each_line_its_peak() -> None:
    rp = load_script()
    live = rp.live_gprs(LIFE_RANGES)
    assert live == {0x0: 56, 0x10: 200, 0x20: 190, 0x30: 191}
    where = rp.line_of_address(LINE_TABLE, MAIN)
    # the wgmma wrapper's instruction goes to the decode line that called it (600), not to the
    # header nor to the outermost caller (900); an instruction without a new chain keeps the last
    assert where == {0x0: (MAIN, 10), 0x10: (MAIN, 600), 0x20: (MAIN, 700), 0x30: (MAIN, 700)}
    peaks = rp.line_peaks(live, where)
    assert [(p.line, p.peak, p.instructions) for p in peaks] == [(600, 200, 1), (700, 191, 2), (10, 56, 1)]


def _has_toolchain() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return load_script().find_nvdisasm() is not None


@pytest.mark.skipif(not _has_toolchain(), reason="NVRTC (cupy) or nvdisasm missing: pip install 'snapmla[cuda]'")
def test_the_64_row_build_charges_pv_promotion_with_o_and_its_accumulator() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--rows", "64", "--top", "400"],
                          capture_output=True, text=True, check=True)
    rows = [line.split(None, 3) for line in done.stdout.splitlines() if f"{MAIN}:" in line and line[:5].strip().isdigit()]
    assert rows, done.stdout
    peak_of = {r[2]: int(r[0]) for r in rows}
    # a consumer thread holds O (4 m-tiles x 32) and PV's fresh accumulator (32) where the
    # promotion adds them, and never more than setmaxnreg's 240
    promotion = [int(r[0]) for r in rows if "o_acc[mt][4 * j + 0] = fmaf(gp.x" in r[3]]
    assert promotion and min(promotion) >= 4 * 32 + 32
    assert max(peak_of.values()) <= 240
