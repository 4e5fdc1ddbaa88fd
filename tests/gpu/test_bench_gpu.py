"""`snapmla bench` on a GPU, end to end, on a step small enough for a test (16 heads x 2 layers,
1k context, batch 3).

Why: the CPU tests run the bench's orchestration with a fake step; only here do the real step
(Q-quant, K-append and decode per layer, captured in a CUDA graph), the ceilings and the figures
derived from them meet. The checks are relations the figures must satisfy, not timings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from snapmla_cli.bench.plan import BF16, FP8, TOKEN_BYTES
from snapmla_cli.cli.app import app

pytestmark = pytest.mark.gpu


def test_bench_times_a_small_step_and_relates_it_to_both_rooflines(tmp_path: Path) -> None:
    """Both formats' steps run as CUDA-graph replays with their rounds' spread; the FP8 step's
    speed-up over the BF16 roofline is its own roofline fraction times the two rooflines' ratio,
    which for this memory-bound shape (16 rows) lies between 1 and the cache bytes' ratio
    1152 / 656 (q and out weigh the same in both); the BF16 step has no such ratio."""
    report = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--heads", "16", "--layers", "2", "--ctx", "1k",
                                      "--batch", "3", "--steps", "5", "--quiet", "--clocks", "burst",
                                      "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert f"wrote {report}" in result.stdout
    rows = {m["impl"]: m for m in json.loads(report.read_text())["measurements"]}
    assert sorted(rows) == ["bf16", "fp8"]
    fp8, bf16 = rows["fp8"], rows["bf16"]
    assert fp8["kernel"] == "snapmla-fp8" and fp8["graphed"] and bf16["graphed"]
    for m in (fp8, bf16):
        assert m["step_s"] > 0 and m["spread"] is not None and m["spread"] >= 0
        assert m["t_min_s"] is not None and 0 < m["roof_pct"]
    assert bf16["vs_bf16_roofline"] is None and bf16["bf16_t_min_s"] is None
    roofline_ratio = fp8["bf16_t_min_s"] / fp8["t_min_s"]
    assert 1.0 < roofline_ratio < TOKEN_BYTES[BF16] / TOKEN_BYTES[FP8]
    assert math.isclose(fp8["vs_bf16_roofline"], fp8["roof_pct"] / 100 * roofline_ratio, rel_tol=1e-9)
